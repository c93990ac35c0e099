"""The full pool's wait: requests that found every replica full wait here, by priority,
then arrival, until a lease is released, their deadline passes, or — for the first in
line only — half a second goes by (a replica's own queue may have room without a
release here), then look again.

Order within a class is arrival order, kept: a request takes its place (`arrival`) when
it first comes to the pool and keeps it each time it goes back to wait; the look again
is the first waiter's alone, so a later one's timer never takes the room an earlier one
is waiting for; and a newcomer with waiters ahead of it in line (`ahead`) queues behind
them rather than trying the replicas first.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

from tokenyard.balancer.replica_client import ReplicaOverloaded

#: How often the first waiter looks again without being woken (seconds).
LOOK_AGAIN_S = 0.5


class WaitQueue:
    """Waiters as a heap of (priority, arrival, future); `wake` lets the first try again."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []

    def __len__(self) -> int:
        return len(self._waiters)

    def arrival(self) -> int:
        """A new request's place in line among those of its priority."""
        return next(self._seq)

    def ahead(self, priority: int, arrival: int) -> bool:
        """Whether a waiter comes before (`priority`, `arrival`): then a request with
        that place waits its turn rather than trying the replicas now."""
        return any((p, a) < (priority, arrival) and not f.done() for p, a, f in self._waiters)

    async def wait(self, priority: int, arrival: int, deadline: float, retry_after: float,
                   max_waiting: int, pool: str) -> None:
        """Wait for a turn in (`priority`, `arrival`) order; refuse (503/529) past
        `deadline` or with `max_waiting` ahead. Returns when woken, when this waiter is
        first in line and LOOK_AGAIN_S went by, or at the deadline (one last look)."""
        left = deadline - time.monotonic()
        if left <= 0 or len(self._waiters) >= max_waiting:
            raise ReplicaOverloaded(retry_after or 1.0, f"every replica of {pool} is busy",
                                    "overloaded")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, arrival, future)
        heapq.heappush(self._waiters, entry)
        try:
            while True:
                left = max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(asyncio.shield(future), min(left, LOOK_AGAIN_S))
                    return
                except TimeoutError:
                    # Woken as the timer fired (`wake` took it off the heap, which may be
                    # empty now), the deadline, or the first in line: it looks again.
                    if (left <= LOOK_AGAIN_S or entry not in self._waiters
                            or self._waiters[0] is entry):
                        return
        finally:
            if not future.done():
                future.cancel()
            if entry in self._waiters:  # not woken: leave no stale entry to count
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)

    def wake(self) -> None:
        """Let the first waiter (by priority, then arrival) try again."""
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
