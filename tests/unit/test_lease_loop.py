"""gateway/lease_loop.py: an idle lane asks the store less and less often, and at once
when woken."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenyard.gateway.lease_loop import LeaseLoop


class NoWork:
    """A lane with nothing to claim; counts its claims."""

    def __init__(self) -> None:
        self.claims = 0

    async def round(self) -> None:
        pass

    def room(self, now: float, running: int) -> tuple[int, int]:
        return 8, 1

    async def claim(self, worker: str, limit: int) -> list[Any]:
        self.claims += 1
        return []

    async def renew(self, worker: str) -> None:
        pass

    async def release(self, worker: str, item: Any) -> None:
        pass

    def key_id(self, item: Any) -> str:
        return "k"

    async def run(self, item: Any, key: Any) -> None:
        pass

    def ended(self, item: Any) -> None:
        pass

    def describe(self, item: Any) -> str:
        return "item"


def test_an_idle_lane_backs_off_and_a_wake_claims_at_once() -> None:
    async def main() -> None:
        work = NoWork()
        loop: LeaseLoop[Any, str] = LeaseLoop("lane", work, store=None,  # type: ignore[arg-type]
                                              name=str, running={}, lease_s=30.0,
                                              poll_s=0.02, idle_poll_s=0.16)
        loop.start()
        try:
            await asyncio.sleep(1.0)
            # Waits 0.02, 0.04, 0.08, then 0.16: about 9 claims in a second, not 50.
            assert 4 <= work.claims <= 14, work.claims
            before = work.claims
            loop.wake()
            await asyncio.sleep(0.01)
            assert work.claims == before + 1
        finally:
            await loop.close(0.1)

    asyncio.run(main())
