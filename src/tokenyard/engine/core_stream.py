"""The outputs of core requests admitted together (`AsyncEngineCore.submit` without a
channel): one list per engine step, on the caller's event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol

from tokenyard.engine.core import EngineCoreOutput
from tokenyard.engine.request import Request


class _Engine(Protocol):
    """What a stream asks of its engine (`AsyncEngineCore`): to run a command on the
    step thread, and there to abort what a closed stream left."""

    def _submit(self, command: Any) -> None: ...

    def _abort_owned(self, stream: Any) -> None: ...


class _End:
    """Queued after a stream's last batch."""


_END = _End()
_Item = list[EngineCoreOutput] | BaseException | _End


class CoreStream:
    """The outputs of core requests admitted together, one list per engine step.

    Each item holds this group's outputs from one step. The stream ends after the step in
    which the last of its requests finished; a request finished from outside (`abort`,
    `finish_with_stop_string`) gets a last output with no tokens and finish_reason
    "abort" or "stop". Closing the stream early aborts its unfinished requests.
    """

    def __init__(
        self, engine: _Engine, requests: Sequence[Request],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.request_ids: tuple[str, ...] = tuple(r.request_id for r in requests)
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._done = False
        self._held: _Item | None = None  # taken off the queue by `ready`, not yet returned
        # Step-thread side: the requests of this stream that have not finished yet
        # (filled as the step thread admits them).
        self._pending: dict[str, Request] = {}

    def __aiter__(self) -> CoreStream:
        return self

    async def __anext__(self) -> list[EngineCoreOutput]:
        if self._done:
            raise StopAsyncIteration
        item, self._held = self._held, None
        if item is None:
            item = await self._queue.get()
        if isinstance(item, _End):
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item

    def ready(self) -> list[EngineCoreOutput]:
        """The outputs of the further steps already delivered, taken without waiting.

        A consumer that fell behind the engine (a busy event loop, a wide batch) sends
        them with the step it holds, in one write, instead of one write and one wake-up
        of its reader per step. The end or a failure stays queued for `__anext__`.
        """
        outputs: list[EngineCoreOutput] = []
        while self._held is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, list):
                outputs.extend(item)
            else:
                self._held = item
        return outputs

    @property
    def done(self) -> bool:
        """True once the stream ended, failed or was closed."""
        return self._done

    def _put(self, item: list[EngineCoreOutput] | BaseException, ended: bool) -> None:
        """On the stream's loop: one step's outputs (or the failure) arrived."""
        self._queue.put_nowait(item)
        if ended and not isinstance(item, BaseException):
            self._queue.put_nowait(_END)

    def close(self) -> None:
        """Stop consuming; the unfinished requests are aborted before the next step.

        Synchronous so that it can run in an async generator's `finally` even when that
        generator is closed by the garbage collector.
        """
        if not self._done:
            self._done = True
            self._engine._submit(lambda: self._engine._abort_owned(self))

    async def aclose(self) -> None:
        """`close` for `async with` and `contextlib.aclosing`."""
        self.close()

    async def __aenter__(self) -> CoreStream:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
