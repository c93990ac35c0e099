"""Dynamic batching: inputs that arrive while a forward pass runs are merged into the next.

Requests put their inputs in one FIFO queue and wait. One worker task takes, oldest first,
up to `max_batch_inputs` waiting inputs (a round), sorts them by length and cuts them into
forward passes whose padded size (inputs × the longest) stays within `max_batch_tokens`:
sorting keeps short inputs from being padded to a long one. The passes run in one worker
thread (torch releases the GIL), so the event loop keeps accepting requests meanwhile;
they are the next round. An input whose request went away before its pass is dropped
unrun.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from tokenyard.wire.embeddings import EmbedStats

#: Token ids of inputs in → each input's vector out (bytes of little-endian float32).
Encode = Callable[[list[list[int]]], list[bytes]]


class QueueFull(Exception):
    """The waiting queue cannot take a request's inputs: refuse it (503), do not queue."""


@dataclass(eq=False)
class _Waiting:
    ids: list[int]
    future: asyncio.Future[bytes]
    queued_ns: int = field(default_factory=time.perf_counter_ns)
    started_ns: int = 0  # its pass began
    done_ns: int = 0  # its pass ended


@dataclass
class Embedded:
    """One request's vectors (little-endian float32 bytes, in input order), how long its
    inputs waited for their pass and how long their passes took (ns)."""

    vectors: list[bytes]
    queue_ns: int
    forward_ns: int


class DynamicBatcher:
    """Runs `encode` over batches merged from every request waiting. Create, `start` in
    the event loop, `embed` from handlers, `stop` at the end."""

    def __init__(
        self,
        encode: Encode,
        *,
        max_batch_inputs: int = 64,
        max_batch_tokens: int = 8192,
        max_waiting_inputs: int = 4096,
    ) -> None:
        """`max_batch_tokens` bounds a pass's padded size and must hold the longest input
        the caller admits; `max_waiting_inputs` bounds the queue (beyond it: QueueFull)."""
        if max_batch_inputs < 1 or max_batch_tokens < 1 or max_waiting_inputs < 1:
            raise ValueError("the batch and queue bounds must be positive")
        self._encode = encode
        self.max_batch_inputs = max_batch_inputs
        self.max_batch_tokens = max_batch_tokens
        self.max_waiting_inputs = max_waiting_inputs
        self.stats = EmbedStats()
        self._waiting: deque[_Waiting] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")

    @property
    def is_running(self) -> bool:
        """Whether the worker task is alive (False before `start`, after `stop` or a crash)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start the worker task in the running event loop."""
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="embed-batcher")

    async def stop(self) -> None:
        """Stop the worker (waiting inputs are failed) and its thread."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for item in self._waiting:
            if not item.future.done():
                item.future.set_exception(RuntimeError("the embeddings replica stopped"))
        self._waiting.clear()
        self._thread.shutdown(wait=True)

    async def embed(self, inputs: Sequence[list[int]]) -> Embedded:
        """Queue a request's inputs (each no longer than `max_batch_tokens`) and wait for
        their vectors. Raises QueueFull at once when the queue cannot take them all."""
        if self._wakeup is None or not self.is_running:
            raise RuntimeError("the batcher is not running")
        if len(self._waiting) + len(inputs) > self.max_waiting_inputs:
            raise QueueFull(f"{len(self._waiting)} inputs are waiting; the queue holds "
                            f"{self.max_waiting_inputs}")
        loop = asyncio.get_running_loop()
        items = [_Waiting(list(ids), loop.create_future()) for ids in inputs]
        self._waiting.extend(items)
        self.stats.waiting_inputs = len(self._waiting)
        self._wakeup.set()
        # Cancelled (the client left): gather cancels the futures and the worker skips them.
        vectors = list(await asyncio.gather(*(item.future for item in items)))
        self.stats.requests += 1
        first = min(item.started_ns for item in items)
        return Embedded(vectors, first - min(item.queued_ns for item in items),
                        max(item.done_ns for item in items) - first)

    async def _run(self) -> None:
        assert self._wakeup is not None
        loop = asyncio.get_running_loop()
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._waiting:
                for batch in self._passes(self._take()):
                    await self._forward(loop, batch)

    def _take(self) -> list[_Waiting]:
        """The oldest waiting inputs one round holds (at least one), skipping cancelled ones."""
        taken: list[_Waiting] = []
        while self._waiting and len(taken) < self.max_batch_inputs:
            item = self._waiting.popleft()
            if not item.future.done():  # done already: its request was cancelled
                taken.append(item)
        self.stats.waiting_inputs = len(self._waiting)
        return taken

    def _passes(self, taken: list[_Waiting]) -> list[list[_Waiting]]:
        """`taken` sorted by length and cut into passes of at most `max_batch_tokens`
        padded tokens."""
        passes: list[list[_Waiting]] = []
        current: list[_Waiting] = []
        for item in sorted(taken, key=lambda w: len(w.ids)):
            # Sorted ascending: this input is the longest of the pass if it joins.
            if current and (len(current) + 1) * len(item.ids) > self.max_batch_tokens:
                passes.append(current)
                current = []
            current.append(item)
        if current:
            passes.append(current)
        return passes

    async def _forward(self, loop: asyncio.AbstractEventLoop, batch: list[_Waiting]) -> None:
        batch = [item for item in batch if not item.future.done()]
        if not batch:
            return
        started = time.perf_counter_ns()
        self.stats.running_inputs = len(batch)
        try:
            vectors = await loop.run_in_executor(
                self._thread, self._encode, [item.ids for item in batch]
            )
        except Exception as exc:
            for item in batch:
                if not item.future.done():
                    item.future.set_exception(exc)
            return
        finally:
            self.stats.running_inputs = 0
        done = time.perf_counter_ns()
        self.stats.forward_passes += 1
        self.stats.inputs += len(batch)
        self.stats.tokens += sum(len(item.ids) for item in batch)
        self.stats.padded_tokens += len(batch) * max(len(item.ids) for item in batch)
        for item, vector in zip(batch, vectors, strict=True):
            item.started_ns, item.done_ns = started, done
            if not item.future.done():
                item.future.set_result(vector)
