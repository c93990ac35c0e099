"""The full pool's wait: requests that found every replica full wait here, by priority
(then arrival), until a lease is released, their deadline passes, or half a second goes
by (a replica's own queue may have room without a release here), then look again."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time

from tokenyard.balancer.replica_client import ReplicaOverloaded


class WaitQueue:
    """Waiters as a heap of (priority, arrival, future); `wake` lets the first try again."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, priority: int, deadline: float, full: ReplicaOverloaded,
                   max_waiting: int, pool: str) -> None:
        """Wait for a turn; refuse (503/529) past `deadline` or with `max_waiting` ahead."""
        left = deadline - time.monotonic()
        if left <= 0 or len(self._waiters) >= max_waiting:
            raise ReplicaOverloaded(full.retry_after or 1.0,
                                    f"every replica of {pool} is busy", "overloaded")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._seq), future)
        heapq.heappush(self._waiters, entry)
        try:
            await asyncio.wait_for(asyncio.shield(future), min(left, 0.5))
        except TimeoutError:
            pass  # look again: a replica's own queue may have room without a release here
        finally:
            if not future.done():
                future.cancel()
            if entry in self._waiters:  # not woken: leave no stale entry to count
                self._waiters.remove(entry)
                heapq.heapify(self._waiters)

    def wake(self) -> None:
        """Let the first waiter (by priority) try again."""
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)
                return
