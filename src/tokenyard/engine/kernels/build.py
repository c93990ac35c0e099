"""Compiles the C++ kernels once per machine into the tokenyard cache and loads them.

The build directory is `<cache_dir>/kernels/<name>-<hash>`, the hash covering the source
and the shared headers (`*.h`), the compile flags, the torch version and the Python ABI,
so a changed kernel or a torch upgrade builds afresh while every later process just loads
the built library.
`torch.utils.cpp_extension.load` serialises concurrent builds of one directory with a lock
file (FileBaton), so two processes starting together compile it once.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from tokenyard.config import kernels_disabled

log = logging.getLogger(__name__)

_SOURCE_DIR = Path(__file__).resolve().parent
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_ops_loaded: dict[str, bool] = {}
_reasons: dict[str, str] = {}


def _build_hash(source: bytes) -> str:
    h = hashlib.sha256(source)
    for header in sorted(_SOURCE_DIR.glob("*.h")):  # the sources include them
        h.update(b"\0" + header.read_bytes())
    for part in (*_CFLAGS, *_LDFLAGS, torch.__version__, sys.version, sys.platform,
                 _cpu_flags()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags: `-march=native` compiles for them, so a cache moved to
    another CPU builds afresh instead of loading code it may not run."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return ""


def load_kernel(name: str, cache_dir: Path) -> ModuleType | None:
    """The compiled extension `<name>.cpp`, or None (the reason logged once at INFO).

    Builds at most once per process; a failure is remembered and not retried.
    """
    with _lock:
        if name in _loaded:
            return _loaded[name]
        module: ModuleType | None = None
        try:
            if kernels_disabled():
                raise _Unavailable("TOKENYARD_DISABLE_KERNELS is set")
            module = _compile(name, cache_dir)
        except _Unavailable as exc:
            _reasons[name] = str(exc)
        except Exception as exc:  # any build/load failure: fall back to the torch path
            _reasons[name] = f"build failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if module is None:
            log.info("kernel %s unavailable, using the torch path (%s)", name, _reasons[name])
        _loaded[name] = module
        return module


def load_ops(name: str, cache_dir: Path) -> bool:
    """Build and load `<name>.cpp` as a torch op library (ops under `torch.ops.<ns>`,
    registered with TORCH_LIBRARY: no pybind11, so it compiles in a quarter of the time).

    True when loaded; False (the reason logged once at INFO) otherwise. Builds at most once
    per process; a failure is remembered and not retried.
    """
    with _lock:
        if name in _ops_loaded:
            return _ops_loaded[name]
        ok = False
        try:
            if kernels_disabled():
                raise _Unavailable("TOKENYARD_DISABLE_KERNELS is set")
            _compile(name, cache_dir, python_module=False)
            ok = True
        except _Unavailable as exc:
            _reasons[name] = str(exc)
        except Exception as exc:  # any build/load failure: fall back to the torch path
            _reasons[name] = f"build failed: {type(exc).__name__}: {str(exc).strip()[-2000:]}"
        if not ok:
            log.info("kernel %s unavailable, using the torch path (%s)", name, _reasons[name])
        _ops_loaded[name] = ok
        return ok


def unavailable_reason(name: str) -> str | None:
    return _reasons.get(name)


class _Unavailable(Exception):
    pass


def _compile(name: str, cache_dir: Path, python_module: bool = True) -> ModuleType:
    from torch.utils import cpp_extension  # imported lazily: slow, and only needed here

    source = _SOURCE_DIR / f"{name}.cpp"
    digest = _build_hash(source.read_bytes())
    build_dir = Path(cache_dir) / "kernels" / f"{name}-{digest}"
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # torch's own baton is a file that a builder killed mid-build leaves behind, and every
    # later load then waits for it forever (a replica killed while it started). An flock,
    # which the kernel releases with its process, serializes our builders instead; whoever
    # holds it knows that a baton still there is a dead builder's.
    with open(build_dir / "tokenyard.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        module = cpp_extension.load(
            name=f"tokenyard_{name}_{digest}",
            sources=[str(source)],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(build_dir),
            verbose=False,
            is_python_module=python_module,
        )
    log.info("kernel %s ready in %.1f s (%s)", name, time.perf_counter() - t0, build_dir)
    if not python_module:  # the library is loaded into torch.ops; `load` gave its path
        return ModuleType(name)
    assert isinstance(module, ModuleType)
    return module
