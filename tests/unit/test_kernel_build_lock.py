"""A replica killed while it built (or loaded) a kernel leaves torch's build baton, a
file named `lock`, in the build directory; torch waits for that file to go away forever,
so every later replica start hung there. The build now holds an flock (released with its
process) and clears a baton left by a dead builder. A finished build is loaded as it is:
no ninja run, so a second checkout of the same source (ninja keys on the path) does not
rebuild it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tokenyard.config import default_cache_dir


def test_a_dead_builders_baton_does_not_hang_the_next_load() -> None:
    cache = default_cache_dir()
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from tokenyard.engine.kernels.build import (
            _build_hash, _SOURCE_DIR, load_kernel, unavailable_reason)
        digest = _build_hash((_SOURCE_DIR / "paged_decode.cpp").read_bytes())
        build_dir = Path({str(cache)!r}) / "kernels" / f"paged_decode-{{digest}}"
        build_dir.mkdir(parents=True, exist_ok=True)
        (build_dir / "lock").touch()  # what a builder killed mid-build leaves
        (build_dir / "tokenyard.built").unlink(missing_ok=True)  # ... before it finished
        module = load_kernel("paged_decode", Path({str(cache)!r}))
        if module is None:
            print(unavailable_reason("paged_decode"), file=sys.stderr)
        sys.exit(0 if module is not None else 3)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", code], timeout=600, capture_output=True,
                              text=True)
    except subprocess.TimeoutExpired:
        pytest.fail("loading a kernel waited on a dead builder's baton")
    if done.returncode == 3 and "build failed" not in done.stderr:
        pytest.skip(f"the paged_decode kernel is off here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_finished_build_loads_without_a_build_step() -> None:
    cache = default_cache_dir()
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from torch.utils import cpp_extension
        from tokenyard.engine.kernels.build import load_ops, unavailable_reason
        if sys.argv[1] == "again":  # torch's loader (a ninja run) must not be needed now
            def refuse(*args, **kwargs):
                raise AssertionError("a finished build went through cpp_extension.load")
            cpp_extension.load = refuse
        if not load_ops("decode_step", Path({str(cache)!r})):
            print(unavailable_reason("decode_step"), file=sys.stderr)
            sys.exit(3)
    """)
    first = subprocess.run([sys.executable, "-c", code, "first"], timeout=600,
                           capture_output=True, text=True)
    if first.returncode == 3 and "build failed" not in first.stderr:
        pytest.skip(f"the decode_step kernel is off here: {first.stderr.strip()[-300:]}")
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([sys.executable, "-c", code, "again"], timeout=600,
                           capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
