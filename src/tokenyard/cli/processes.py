"""Starting the replica processes `tokenyard serve` runs as its children (`tokenyard
engine`, `tokenyard embed`): on a local port, with the shared secret in the environment,
killed by the kernel if this process dies, and returned once they print their ready line."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from tokenyard.config import REPLICA_TOKEN_ENV, ServeConfig

#: The ready line a replica prints once it listens: "... serving at <url>".
READY_MARK = " serving at "
_PR_SET_PDEATHSIG = 1


def end_process(code: int) -> NoReturn:
    """Exit now with `code`, after the exit handlers and the log lines, without the
    interpreter's teardown: a server that has drained and closed has nothing left to
    free, and freeing torch's modules and objects took ~0.9 s of every replica's stop
    (a restart, a drain and each test's server pay it). Under a profiler (``python -m
    cProfile``, which `tokenyard bench host` runs the gateway under) it exits normally,
    so the profiler writes its statistics."""
    from tokenyard.telemetry import logs

    if sys.getprofile() is not None:
        sys.exit(code)

    atexit._run_exitfuncs()  # what a normal exit runs (Ray's disconnect, say)
    logs.stop()
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def die_with_parent() -> None:
    """In the child before exec: the kernel sends it SIGTERM when this process dies, so a
    crashed or SIGKILLed server never leaves an orphan replica holding the model."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def replica_niceness() -> int:
    """How much lower than the HTTP process a replica child runs (Linux nice increment):
    ``TOKENYARD_REPLICA_NICE``, default `REPLICA_NICE`."""
    try:
        return int(os.environ.get(REPLICA_NICE_ENV, REPLICA_NICE))
    except ValueError:
        return REPLICA_NICE


def replica_preexec() -> None:
    """In a replica child before exec: `die_with_parent`, and a lower scheduling priority
    (inherited by every thread it starts), so the model's compute threads never starve
    the HTTP process's event loop on the cores they share; alone on the machine the
    replica still gets all the CPU it wants."""
    die_with_parent()
    with contextlib.suppress(OSError):
        os.nice(replica_niceness())


async def forward_output(stream: asyncio.StreamReader) -> None:
    """Copy a child's remaining output to our stderr (its logs stay visible)."""
    while line := await stream.readline():
        sys.stderr.write(line.decode("utf-8", "replace"))
        sys.stderr.flush()


#: The replica children's nice increment (see `replica_preexec`); 0 runs them level.
REPLICA_NICE = 10
REPLICA_NICE_ENV = "TOKENYARD_REPLICA_NICE"


async def start_child(
    command: Sequence[str], config: ServeConfig, token: str, *, port: int = 0,
    what: str = "engine replica",
) -> tuple[asyncio.subprocess.Process, str, asyncio.Task[None]]:
    """Start `tokenyard <command...>` on 127.0.0.1:`port` (0: a free one), requiring
    `token` of its callers (passed in its environment: argv is visible to every user of
    the machine); return the process, its URL and the task copying its output, once it
    listens."""
    cmd = [sys.executable, "-m", "tokenyard.cli", command[0], "--host", "127.0.0.1",
           "--port", str(port), "--drain-timeout", str(config.drain_timeout_s), *command[1:]]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=None, preexec_fn=replica_preexec,
        env={**os.environ, REPLICA_TOKEN_ENV: token},
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(config.replica_start_timeout_s):
            while raw := await proc.stdout.readline():
                line = raw.decode("utf-8", "replace")
                if READY_MARK in line:
                    url = line.rsplit(READY_MARK, 1)[1].strip()
                    return proc, url, asyncio.create_task(forward_output(proc.stdout))
                sys.stderr.write(line)
            code = await proc.wait()
            raise RuntimeError(f"the {what} exited with code {code} before it was ready "
                               "(see its output above)")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise
