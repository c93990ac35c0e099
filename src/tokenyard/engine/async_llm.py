"""The asynchronous API: per-step deltas of one request, aborted when the consumer stops.

The step loop runs on its own thread so model steps never block the caller's event loop
(torch releases the GIL inside its kernels). Requests and aborts cross to that thread
through a queue; outputs come back through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from tokenyard.config import EngineConfig
from tokenyard.engine.core import EngineStats
from tokenyard.engine.frontend import Frontend, Prompt
from tokenyard.engine.outputs import RequestOutput
from tokenyard.engine.sampling_params import SamplingParams
from tokenyard.text.tokenizer import Tokenizer


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]


class AsyncLLM:
    def __init__(self, model: str | None = None, *, show_progress: bool = False, **config: Any):
        self.frontend = Frontend(EngineConfig.from_env(model=model, **config), show_progress)
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tokenyard-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.frontend.tokenizer

    def stats(self) -> EngineStats:
        return self.frontend.core.stats()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield this request's deltas step by step until every completion finishes.

        Leaving the iteration early (break, cancellation, a closed client) aborts the
        request in the engine and frees its KV blocks.
        """
        if self._closed:
            raise RuntimeError("the engine is shut down")
        request_id = request_id or uuid.uuid4().hex
        prompt_ids = self.frontend.prompt_token_ids(prompt)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        admitted: asyncio.Future[None] = stream.loop.create_future()

        def add() -> None:
            try:
                self.frontend.add_request(
                    request_id, prompt_ids, params, cache_salt=cache_salt, priority=priority
                )
            except Exception as exc:
                stream.loop.call_soon_threadsafe(_settle, admitted, exc)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_settle, admitted, None)

        self._submit(add)
        await admitted  # raises the engine's refusal (too long, queue full) here
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        def do() -> None:
            self._streams.pop(request_id, None)
            self.frontend.abort(request_id)

        self._submit(do)

    def shutdown(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._closed:
            while True:
                try:
                    self._commands.get_nowait()()
                except queue.Empty:
                    break
            if not self.frontend.has_work:
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.frontend.step()
            except Exception as exc:  # a failed step fails its requests, not the engine
                for request_id, stream in list(self._streams.items()):
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
                    self.frontend.abort(request_id)
                self._streams.clear()
                continue
            for out in outputs:
                target = self._streams.get(out.request_id)
                if target is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                target.loop.call_soon_threadsafe(target.queue.put_nowait, out)


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
