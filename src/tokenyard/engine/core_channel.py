"""Many core requests' outputs for one consumer that stays: each engine step's outputs of
all of them arrive together, in one call on the consumer's event loop.

A `CoreStream` (`engine/core_stream.py`) belongs to the requests admitted with it and ends
with them; a channel belongs to a connection (a gateway's multiplexed link to this replica,
`engine/mux_server.py`) and takes requests as they come. The step thread treats both
alike: a request's outputs go to whoever it was submitted into, one hand-over per loop
per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenyard.engine.core import EngineCoreOutput
from tokenyard.engine.request import Request

if TYPE_CHECKING:
    from tokenyard.engine.async_core import AsyncEngineCore


class CoreChannel:
    """Requests submitted over time; `on_step` gets each step's outputs of all of them
    (a request's last output carries its finish_reason), `on_failure` a failed step's
    exception (every request of the channel then failed). Both run on the loop that made
    the channel. `close` aborts whatever has not finished."""

    def __init__(self, engine: AsyncEngineCore,
                 on_step: Callable[[list[EngineCoreOutput]], None],
                 on_failure: Callable[[BaseException], None]) -> None:
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._on_step = on_step
        self._on_failure = on_failure
        self._closed = False
        # Step-thread side: the channel's requests that have not finished yet.
        self._pending: dict[str, Request] = {}

    async def submit(self, request: Request) -> None:
        """Admit `request` into this channel (raises what `AsyncEngineCore.submit` does)."""
        await self._engine.submit([request], into=self)

    def _put(self, item: list[EngineCoreOutput] | BaseException, ended: bool) -> None:
        """On the channel's loop: one step's outputs (or the failure) arrived."""
        if self._closed:
            return
        if isinstance(item, BaseException):
            self._on_failure(item)
        else:
            self._on_step(item)

    def close(self) -> None:
        """Stop delivering; the unfinished requests are aborted before the next step."""
        if not self._closed:
            self._closed = True
            self._engine._submit(lambda: self._engine._abort_owned(self))
