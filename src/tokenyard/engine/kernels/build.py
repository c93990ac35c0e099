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
import importlib.util
import logging
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

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
    # holds it knows that a baton still there is a dead builder's (_build removes it).
    module_name = f"tokenyard_{name}_{digest}"
    built = _load_built(build_dir, module_name, python_module)
    if built is None:
        with open(build_dir / "tokenyard.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            built = _load_built(build_dir, module_name, python_module)  # built meanwhile
            if built is None:
                built = _build(cpp_extension, source, build_dir, module_name, python_module)
    log.info("kernel %s ready in %.1f s (%s)", name, time.perf_counter() - t0, build_dir)
    return built if python_module else ModuleType(name)  # ops: loaded into torch.ops


#: Written beside the library once a build succeeded: what _load_built trusts.
_BUILT = "tokenyard.built"


def _load_built(build_dir: Path, module_name: str, python_module: bool) -> ModuleType | None:
    """The library a finished build left in `build_dir`, loaded as it is, or None.

    The directory's name hashes everything the build depends on, so a finished build is
    current: no ninja run to check it (~0.2 s a kernel), and checkouts of one source in
    different places (ninja keys on the path) no longer rebuild each other's library."""
    library = build_dir / f"{module_name}.so"
    if not (build_dir / _BUILT).exists() or not library.exists():
        return None
    if not python_module:
        torch.ops.load_library(str(library))
        return ModuleType(module_name)
    spec = importlib.util.spec_from_file_location(module_name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(cpp_extension: Any, source: Path, build_dir: Path, module_name: str,
           python_module: bool) -> ModuleType:
    (build_dir / "lock").unlink(missing_ok=True)
    module = cpp_extension.load(
        name=module_name,
        sources=[str(source)],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
        is_python_module=python_module,
    )
    (build_dir / _BUILT).write_text(module_name + "\n")
    if not python_module:
        return ModuleType(module_name)
    assert isinstance(module, ModuleType)
    return module
