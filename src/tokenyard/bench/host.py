"""What machine a benchmark ran on, and the figure a benchmark reports (torch-free)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class OtherLoad:
    """How much of the machine's CPU went to processes other than this one and its
    waited-for descendants while a benchmark ran: /proc/stat's busy time (steal included)
    less our own and our reaped children's CPU time. The load average cannot tell: the
    benchmark's own threads raise it."""

    def __init__(self) -> None:
        self._busy, self._own = _busy_cpu_s(), _own_cpu_s()

    def share(self, wall_s: float) -> float | None:
        """The other processes' CPU as a share of all cores over `wall_s` (None off
        Linux). Call it after every child of the benchmark has been waited for."""
        busy = _busy_cpu_s()
        if busy is None or self._busy is None or wall_s <= 0:
            return None
        other = (busy - self._busy) - (_own_cpu_s() - self._own)
        return max(0.0, other) / (wall_s * (os.cpu_count() or 1))


def _busy_cpu_s() -> float | None:
    try:
        with open("/proc/stat") as stat:
            ticks = [int(v) for v in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Figure:
    """One benchmark figure: what was measured, its value and unit, the goal it is held to."""

    name: str
    value: float
    unit: str
    goal: str = ""
    note: str = ""
