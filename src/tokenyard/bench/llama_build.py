"""llama.cpp's `llama-server`, built once into the cache for `tokenyard bench peers`.

The source is the llama.cpp that the `llama_cpp_python` sdist vendors, pinned by version, so
every machine measures the same peer. A statically linked `llama-server`, and beside it
`llama-quantize` (which `bench_model.py` uses to quantize the 1.7B model), are copied into
``<cache>/peers/`` and later runs reuse them; the build (about ten minutes on two cores) runs
under ``nice`` because it shares the machine. The unpacked source stays too: its
``convert_hf_to_gguf.py`` and ``gguf-py`` convert a Hugging Face folder to GGUF.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

LLAMA_CPP_PYTHON = "0.3.36"
#: Not AMX: `-march=native` turns it on where the CPU lists it, but a virtual machine may
#: not grant the tile state to processes, and the first AMX matmul then dies of SIGILL
#: (seen on a Sapphire Rapids guest). AVX-512/VNNI stay on where the CPU has them.
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
#: The server alone: no web UI (it would download or build one), no HTTPS, no curl (the
#: model is a local file), one static binary tuned to this CPU.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
    f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}",
    "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
)
#: Names the binary and its build tree, so that changed flags build a new one.
BUILD_TAG = hashlib.sha256(" ".join(CMAKE_FLAGS).encode()).hexdigest()[:8]


def peers_dir(cache_dir: Path) -> Path:
    """Where the peers' sources, build trees and binaries live in the cache."""
    return cache_dir / "peers"


#: The binaries built and cached.
TARGETS = ("llama-server", "llama-quantize")


def llama_binary_path(cache_dir: Path, target: str = "llama-server") -> Path:
    """The cached binary `target` (present once built)."""
    return peers_dir(cache_dir) / f"{target}-{LLAMA_CPP_PYTHON}-{BUILD_TAG}"


def llama_server_path(cache_dir: Path) -> Path:
    """The cached `llama-server` (present once built)."""
    return llama_binary_path(cache_dir)


def llama_source_path(cache_dir: Path) -> Path:
    """The unpacked llama.cpp tree (present once a build unpacked it)."""
    return (peers_dir(cache_dir) / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor"
            / "llama.cpp")


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run `cmd` (in `env`, else this environment), its output appended to `log`; raise
    with the log's tail if it fails."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{' '.join(cmd[:4])} … failed ({done.returncode}); log {log}:\n"
                           f"{tail}")


def _unpack_source(root: Path, log: Path) -> Path:
    """The vendored llama.cpp of the pinned sdist, downloaded and unpacked under `root`
    (kept, so a failed build resumes without downloading again)."""
    source = llama_source_path(root.parent)
    if (source / "CMakeLists.txt").exists():
        return source
    with tempfile.TemporaryDirectory(prefix="tokenyard-sdist-") as tmp:
        run_logged([sys.executable, "-m", "pip", "download", "--no-binary", ":all:",
                    "--no-deps", "--dest", tmp, f"llama_cpp_python=={LLAMA_CPP_PYTHON}"], log)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(root, filter="data")
    if not (source / "CMakeLists.txt").exists():
        raise RuntimeError(f"the sdist holds no vendored llama.cpp at {source}")
    return source


def ensure_llama_server(cache_dir: Path, jobs: int = 2,
                        say: Callable[[str], None] = print) -> Path:
    """The cached `llama-server`, built first (with `llama-quantize`, and the source kept
    unpacked) if any of them is not there yet."""
    binary = llama_server_path(cache_dir)
    if (all(llama_binary_path(cache_dir, t).exists() for t in TARGETS)
            and (llama_source_path(cache_dir) / "convert_hf_to_gguf.py").exists()):
        return binary
    for tool in ("cmake", "nice"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama-server needs {tool} on PATH")
    root = peers_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    log = root / f"build-{LLAMA_CPP_PYTHON}.log"
    say(f"building {', '.join(TARGETS)} from llama_cpp_python {LLAMA_CPP_PYTHON} (log {log})")
    started = time.monotonic()
    source = _unpack_source(root, log)
    build = root / f"build-{LLAMA_CPP_PYTHON}-{BUILD_TAG}"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    run_logged(["nice", "-n", "10", "cmake", "-S", str(source), "-B", str(build), *generator,
                *CMAKE_FLAGS], log)
    run_logged(["nice", "-n", "10", "cmake", "--build", str(build), "--target", *TARGETS,
                f"-j{jobs}"], log)
    for target in TARGETS:
        path = llama_binary_path(cache_dir, target)
        partial = path.with_suffix(".partial")
        shutil.copy2(build / "bin" / target, partial)
        partial.replace(path)  # atomic: a binary in place is a whole one
    say(f"built {', '.join(TARGETS)} in {time.monotonic() - started:.0f} s")
    return binary
