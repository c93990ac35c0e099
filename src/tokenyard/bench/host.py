"""What machine a benchmark ran on, and the figure a benchmark reports (torch-free)."""

from __future__ import annotations

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


@dataclass
class Figure:
    """One benchmark figure: what was measured, its value and unit, the goal it is held to."""

    name: str
    value: float
    unit: str
    goal: str = ""
    note: str = ""
