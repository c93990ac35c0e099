"""Sampling CPU time and resident memory from Linux /proc: of one process, of its tree of
descendants, of the whole machine.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcSample:
    """A process's CPU time (user + system, s) and resident memory (MiB) at one moment."""

    at: float
    cpu_s: float
    rss_mib: float
    peak_rss_mib: float


def _stat(pid: int) -> list[int]:
    """utime, stime, cutime, cstime of /proc/<pid>/stat, in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name, which is in parentheses and may hold spaces.
    rest = stat[stat.rindex(")") + 2:].split()
    return [int(v) for v in rest[11:15]]


def _memory_mib(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of /proc/<pid>/status, MiB (0 for a zombie)."""
    memory = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            memory[key] = int(value.split()[0]) / 1024  # kB
    return memory.get("VmRSS", 0.0), memory.get("VmHWM", 0.0)


def sample_proc(pid: int) -> ProcSample:
    """Read /proc/<pid>/stat and /proc/<pid>/status (Linux)."""
    utime, stime, _, _ = _stat(pid)
    rss, peak = _memory_mib(pid)
    return ProcSample(time.perf_counter(), (utime + stime) / os.sysconf("SC_CLK_TCK"), rss,
                      peak)


def child_pids(pid: int) -> list[int]:
    """`pid`'s children: /proc/<pid>/task/*/children (each thread's), or a scan of every
    process's parent where the kernel lacks those files; [] once it has exited."""
    tasks = Path(f"/proc/{pid}/task")
    if (tasks / str(pid) / "children").exists():
        found: list[int] = []
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):
                found += [int(c) for c in (task / "children").read_text().split()]
        return found
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                if int(stat[stat.rindex(")") + 2:].split()[1]) == pid:
                    found.append(int(entry.name))
    return found


def tree_pids(root: int, exclude: Collection[int] = ()) -> list[int]:
    """`root` and all its descendants, less each pid in `exclude` and its subtree."""
    out: list[int] = []
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in exclude or pid in out:
            continue
        out.append(pid)
        todo += child_pids(pid)
    return out


@dataclass(frozen=True)
class TreeSample:
    """A process tree's CPU time (s) and resident memory (MiB) at one moment, summed over
    its processes; `root_cpu_s` is the root's own CPU time alone."""

    at: float
    cpu_s: float
    root_cpu_s: float
    rss_mib: float
    peak_rss_mib: float
    processes: int


def sample_tree(root: int, exclude: Collection[int] = ()) -> TreeSample:
    """Sum /proc's figures over `tree_pids(root, exclude)`. Each process counts its own
    CPU time and its reaped children's (cutime, cstime), so a descendant that exited
    between two samples still counts. A process that exits while it is read is skipped.
    RSS is summed per process (pages shared between them count once per process)."""
    cpu = root_ticks = processes = 0
    rss = peak = 0.0
    for pid in tree_pids(root, exclude):
        try:
            times = _stat(pid)
            memory = _memory_mib(pid)
        except (OSError, ValueError, IndexError):
            continue
        cpu += sum(times)
        if pid == root:
            root_ticks = times[0] + times[1]
        rss, peak, processes = rss + memory[0], peak + memory[1], processes + 1
    ticks = os.sysconf("SC_CLK_TCK")
    return TreeSample(time.perf_counter(), cpu / ticks, root_ticks / ticks, rss, peak,
                      processes)


def process_cpu_s(pid: int) -> float:
    """`pid`'s own CPU time (every thread, live or gone), in seconds to the nanosecond:
    the process's CPU clock (Linux's clock_getcpuclockid, which Python does not wrap: the
    clock id is (~pid << 3) | CPUCLOCK_SCHED). Falls back to /proc's 10 ms ticks."""
    try:
        return time.clock_gettime((~pid << 3) | 2)
    except OSError:
        utime, stime = _stat(pid)[:2]
        return (utime + stime) / os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU time the whole machine spent busy (all cores, not idle nor iowait), from
    /proc/stat, in seconds; 0 where it cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        ticks = [int(v) for v in fields]
    except (OSError, ValueError):
        return 0.0
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_pct_between(a: ProcSample | TreeSample, b: ProcSample | TreeSample) -> float:
    """CPU use between two samples, in % of one core."""
    wall = b.at - a.at
    return 100.0 * (b.cpu_s - a.cpu_s) / wall if wall > 0 else 0.0
