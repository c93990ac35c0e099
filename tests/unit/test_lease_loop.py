"""gateway/lease_loop.py: an idle lane asks the store less and less often, and at once
when woken; a run cut while it still reads its key is cut inside its lane's run."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenyard.gateway.lease_loop import LeaseLoop, Runs


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
                                              name=str, running=Runs(), lease_s=30.0,
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


class OneItem(NoWork):
    """One item to claim; its run records how it ended."""

    def __init__(self) -> None:
        super().__init__()
        self.outcome: list[str] = []

    async def claim(self, worker: str, limit: int) -> list[Any]:
        self.claims += 1
        return ["item"] if self.claims == 1 else []

    async def run(self, item: Any, key: Any) -> None:
        try:
            await asyncio.sleep(10)
            self.outcome.append("ran")
        except asyncio.CancelledError as cut:
            self.outcome.append(f"cut: {cut.args[0] if cut.args else None}")


class SlowKeys:
    """A store whose key lookups wait until released."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def find_key_by_id(self, key_id: str) -> None:
        await self.release.wait()


def test_a_run_cut_while_reading_its_key_is_cut_inside_its_lanes_run() -> None:
    async def main() -> None:
        work, store, runs = OneItem(), SlowKeys(), Runs[str]()
        loop: LeaseLoop[Any, str] = LeaseLoop("lane", work, store,  # type: ignore[arg-type]
                                              name=str, running=runs, lease_s=30.0,
                                              poll_s=0.02)
        loop.start()
        try:
            while "item" not in runs:
                await asyncio.sleep(0.005)
            assert runs.cut("item", "cancelled by its client")  # still reading its key
            store.release.set()
            while "item" in runs:
                await asyncio.sleep(0.005)
            # The lane saw the cut (it used to escape before the run, the item leased).
            assert work.outcome == ["cut: cancelled by its client"]
            assert not runs.cut("item")
        finally:
            await loop.close(0.1)

    asyncio.run(main())
