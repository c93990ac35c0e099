"""The engine core behind an asyncio API: core requests in, per-step outputs out.

Token ids only — no text. `AsyncLLM` puts detokenization and stop strings on top of this
in the caller's event loop; the replica server puts HTTP on top of it.

The step loop runs on its own thread: a model step takes milliseconds to seconds and
would stall every other coroutine on the event loop, while torch releases the GIL inside
its kernels so the loop stays responsive. Only that thread touches the EngineCore:
adds, aborts and stops cross to it through a command queue and run between steps.
Outputs go back to each caller's event loop with one `call_soon_threadsafe` per loop per
step (not one per request), so a wide batch costs one wake-up of the loop. Steps shorter
than `stream_interval_ms` hand over at most that often (a step's outputs then go with a
later step's): a hand-off wakes the loop's thread, which takes the GIL while the step
thread runs, and on a 2-core VM one cost a null-model step's worth of the step thread's
CPU (289 against 150 µs a step, measured). A first token, a finish and an idle engine
hand over at once, so only tokens after the first of steps shorter than the interval
wait, and for less than the interval.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from tokenyard.config import EngineConfig
from tokenyard.engine.core import EngineCore, EngineCoreOutput, EngineStats
from tokenyard.engine.core_stream import CoreStream
from tokenyard.engine.frontend import build_core
from tokenyard.engine.models.config import ModelConfig
from tokenyard.engine.request import Request
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.abort import AbortReport

log = logging.getLogger(__name__)


class AsyncEngineCore:
    """An EngineCore stepped on its own thread, driven from asyncio.

    Built from an EngineConfig the same way the offline engine is (`build_core`).
    """

    def __init__(self, config: EngineConfig, *, show_progress: bool = False) -> None:
        """Build the core on the step thread (returns once it is built, or raises what
        building raised)."""
        self.config = config
        self._commands: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._owner: dict[str, Any] = {}  # step thread only: request id -> its stream
        # Step thread only: outputs held for the next hand-off, and when the last was.
        self._held: dict[Any, list[EngineCoreOutput]] = {}
        self._handed_at = 0.0
        self._interval_s = max(0.0, config.stream_interval_ms) / 1000
        self._closed = False
        #: Called on the step thread with each step's prefix-cache events (`publish_kv_events`).
        self.kv_events: Callable[[list[tuple[object, ...]]], None] | None = None
        failed: list[BaseException] = []
        built = threading.Event()
        self._thread = threading.Thread(target=self._build_and_run, name="tokenyard-engine",
                                        args=(show_progress, built, failed), daemon=True)
        self._thread.start()
        built.wait()
        if failed:
            self._thread.join()
            raise failed[0]

    def _build_and_run(self, show_progress: bool, built: threading.Event,
                       failed: list[BaseException]) -> None:
        # Every torch op runs on this one thread, the load included. With OpenMP each
        # thread that opens a parallel region gets its own pool of workers; a second
        # pool (the load's, on the caller's thread) makes libgomp count more threads
        # than cores and stop spinning between regions, and a decode step, ~150
        # regions, then wakes its workers from sleep in each: ~25 % of one stream's
        # rate, measured on 2 cores.
        try:
            made = build_core(self.config, show_progress)
        except BaseException as exc:
            failed.append(exc)
            built.set()
            return
        self.core: EngineCore = made.core
        self.tokenizer: Tokenizer = made.tokenizer
        self.model_config: ModelConfig = made.model_config
        self.eos_token_ids: frozenset[int] = made.eos_token_ids
        self.weights: str = made.weights  # the format served (`auto` resolved)
        built.set()
        self._run()

    # -- facts ---------------------------------------------------------------------------
    @property
    def model_name(self) -> str:
        return self.model_config.name

    @property
    def max_model_len(self) -> int:
        """The context window: a prompt must be shorter than this."""
        return self.core.max_model_len

    @property
    def is_running(self) -> bool:
        """False once shut down, or if the step thread died."""
        return not self._closed and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """A snapshot of the core's counters.

        Read without stopping the step thread, so a step in progress may show half-done;
        callers poll these numbers, and a lock here would make every step pay for it.
        """
        return self.core.stats()

    # -- requests ------------------------------------------------------------------------
    async def submit(self, requests: Sequence[Request], into: Any = None) -> Any:
        """Admit core requests together (all or none) and return their stream: a new
        CoreStream, or `into` (a `CoreChannel`, which many requests share).

        Raises what the core refuses with — ValueError (never fits: prompt at or over the
        context window, larger than the KV pool, duplicate id) or QueueFullError (waiting
        queue over its bound) — before anything is queued. The caller must close the
        stream (or consume it to the end).
        """
        if not requests:
            raise ValueError("no requests to submit")
        if not self.is_running:
            raise RuntimeError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream = CoreStream(self, requests, loop) if into is None else into
        admitted: asyncio.Future[None] = loop.create_future()

        def add() -> None:
            added: list[str] = []
            try:
                for request in requests:
                    self.core.add_request(request)
                    added.append(request.request_id)
            except Exception as exc:
                self.core.abort(added)
                _call_in(loop, _settle, admitted, exc)
                return
            if not _call_in(loop, _settle, admitted, None):
                self.core.abort(added)  # the caller's loop is gone: nobody would read
                return
            for request in requests:
                self._owner[request.request_id] = stream
                stream._pending[request.request_id] = request

        self._submit(add)
        try:
            await admitted
        except asyncio.CancelledError:
            for request in requests:  # cancelled while the add was queued: undo it after
                self.abort(request.request_id)
            raise
        return stream

    async def generate(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        """Admit one core request and yield its output step by step until it finishes.

        Admission errors (ValueError, QueueFullError) are raised before the first item.
        Leaving the iteration early (break + aclose, cancellation) aborts the request and
        frees its KV blocks before the next step.
        """
        stream = await self.submit([request])
        try:
            async for batch in stream:
                for out in batch:
                    yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; unknown or finished ids are ignored).

        Its stream gets a last output with finish_reason "abort".
        """
        self._submit(lambda: self._finish_from_outside(request_id, None))

    async def abort_report(self, request_id: str) -> AbortReport | None:
        """`abort`, then what the request had computed when the abort ran between two
        steps (None: unknown or already finished). A request still waiting reports
        nothing computed. If the step thread never gets to it (shut down), this waits
        forever: bound it."""
        loop = asyncio.get_running_loop()
        reported: asyncio.Future[AbortReport | None] = loop.create_future()

        def command() -> None:
            request = self._finish_from_outside(request_id, None)
            _call_in(loop, _resolve, reported, None if request is None else _report(request))

        self._submit(command)
        return await reported

    def finish_with_stop_string(self, request_id: str, stop: str) -> None:
        """The caller matched stop string `stop`: finish the request as stopped.

        Its stream gets a last output with finish_reason "stop" and stop_reason `stop`;
        any token the core produced in the meantime is delivered before it.
        """
        self._submit(lambda: self._finish_from_outside(request_id, stop))

    def publish_kv_events(self, sink: Callable[[list[tuple[object, ...]]], None]) -> None:
        """Record the prefix cache's events from now on and hand them to `sink` once a
        step (on the step thread)."""
        def start() -> None:
            self.core.kv.pool.events = []
            self.kv_events = sink
        self._submit(start)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop; open streams fail with RuntimeError."""
        self._closed = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeout)

    # -- the step thread -----------------------------------------------------------------
    def _submit(self, command: Callable[[], object]) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._closed:
                self._run_commands()
                if not self.core.has_work:
                    if self._held:  # nothing comes after them: they go now
                        self._deliver({})
                    # A command queued after _run_commands sets the event, so this wait
                    # returns at once and the next round runs it: no wake-up is lost.
                    self._wake.wait()
                    self._wake.clear()
                    continue
                try:
                    outputs = self.core.step()
                except Exception as exc:  # a failed step fails its requests, not the engine
                    self._fail_all(exc)
                    continue
                self._dispatch(outputs)
                if self.kv_events is not None:
                    events = self.core.kv.pool.take_events()
                    if events:
                        self.kv_events(events)
        finally:
            self._closed = True
            self._fail_all(RuntimeError("the engine shut down"))
            self.core.close()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:  # a broken command must not take the step loop down
                log.exception("engine command failed")

    def _dispatch(self, outputs: list[EngineCoreOutput]) -> None:
        batches: dict[Any, list[EngineCoreOutput]] = {}
        urgent = False  # a first token or a finish: it goes now
        for out in outputs:
            stream = self._owner.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream, []).append(out)
            if out.finish_reason is not None:
                urgent = True
                del self._owner[out.request_id]
                stream._pending.pop(out.request_id, None)
            elif out.queue_time is not None:
                urgent = True
        if not batches and not self._held:
            return
        now = time.perf_counter()
        if (not urgent and now - self._handed_at < self._interval_s
                and self.core.has_work):
            for stream, outs in batches.items():  # a later step's hand-off takes them
                self._held.setdefault(stream, []).extend(outs)
            return
        self._handed_at = now
        self._deliver(batches)

    def _finish_from_outside(self, request_id: str, stop: str | None) -> Request | None:
        """Abort (stop None) or finish as stopped, and end the request's output; the
        request so ended (None: unknown or already finished)."""
        if stop is None:
            self.core.abort([request_id])
        else:
            self.core.finish_with_stop_string(request_id, stop)
        stream = self._owner.pop(request_id, None)
        request = stream._pending.pop(request_id, None) if stream is not None else None
        if stream is None or request is None:
            return None
        reason = "abort" if stop is None else "stop"
        self._deliver({stream: [_final_output(request, reason, stop)]})
        return request

    def _abort_owned(self, stream: Any) -> None:
        """Abort what is left of a closed stream (only ids still owned by it)."""
        ids = [i for i in stream._pending if self._owner.get(i) is stream]
        self.core.abort(ids)
        for request_id in ids:
            del self._owner[request_id]
        stream._pending.clear()

    def _fail_all(self, exc: BaseException) -> None:
        streams = set(self._owner.values())
        self.core.abort(list(self._owner))
        self._owner.clear()
        for stream in streams:
            stream._pending.clear()
        self._deliver(dict.fromkeys(streams, exc))

    def _deliver(self, items: dict[Any, Any]) -> None:
        """Hand `items` (stream -> a list of outputs, or the exception that failed it) to
        their loops, after what was held for each stream."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, bool]]] = {}
        if self._held:
            held, self._held = self._held, {}
            for stream, outs in held.items():
                later = items.get(stream)
                if isinstance(later, list):
                    items[stream] = outs + later
                else:  # nothing more, or a failure: the held outputs go before it
                    by_loop.setdefault(stream._loop, []).append((stream, outs, False))
        for stream, item in items.items():
            ended = isinstance(item, BaseException) or not stream._pending
            by_loop.setdefault(stream._loop, []).append((stream, item, ended))
        for loop, batch in by_loop.items():
            if not _call_in(loop, _put_all, batch):
                for stream, _, _ in batch:  # that loop is closed: nobody will read these
                    self._abort_owned(stream)


def _final_output(request: Request, reason: str, stop: str | None) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_logprobs=None,
        finish_reason=reason,
        stop_reason=stop,
        num_prompt_tokens=request.num_prompt_tokens,
        num_cached_tokens=max(request.num_cached_tokens, 0),
    )


def _report(request: Request) -> AbortReport:
    """What an ended request had computed: its prompt tokens through the model (cached
    ones included; with async scheduling, the chunk of the step in flight, which runs),
    of them those read from the prefix cache, and the tokens it sampled."""
    prompt = min(request.num_computed_tokens, request.num_prompt_tokens)
    return AbortReport(prompt, min(max(request.num_cached_tokens, 0), prompt),
                       request.num_output_tokens)


def _resolve(future: asyncio.Future[AbortReport | None], value: AbortReport | None) -> None:
    if not future.done():  # its waiter may have given up (a timeout)
        future.set_result(value)


def _put_all(batch: list[tuple[Any, Any, bool]]) -> None:
    for stream, item, ended in batch:
        stream._put(item, ended)


def _call_in(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Schedule fn on `loop` from another thread; False if that loop is closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)
        return True
    return False


def _settle(future: asyncio.Future[None], exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
