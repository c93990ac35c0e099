"""The HTTP processes' garbage collector, tuned for many short requests.

Each request leaves reference cycles (tasks, generators, its generation's parts) that only
the cyclic collector frees. With CPython's default thresholds (a young collection every
700 allocations) a request's objects are still alive at its first collections, so they
are promoted and end up in full collections that walk every object of the process,
a large share of its CPU under load (`tokenyard bench gateway`'s CPU ms per request
shows it). A young generation of `YOUNG` allocations lets a request's objects die young
(by reference count, or in a cheap young collection) instead; the garbage it can hold
is a few MB.
"""

from __future__ import annotations

import gc

#: Allocations between young collections (CPython's default: 700).
YOUNG = 50_000
#: Young collections per middle one, middle ones per full one (defaults: 10, 10).
MIDDLE = 20
OLD = 10


def tune_gc() -> None:
    """Set this process's collector thresholds (before it serves)."""
    gc.set_threshold(YOUNG, MIDDLE, OLD)
