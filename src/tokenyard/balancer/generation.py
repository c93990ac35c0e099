"""One API request's generation on a replica: its n completions sent as n core requests,
merged back into `RequestOutput`s with detokenization and stop strings applied here.

The replica never sees stop strings or `n`: it gets single completions by token ids, and
a stop string matched here is sent back to it as a stop. Closing a generation closes its
replica streams, which is what makes the replica abort them and free their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any, cast

from tokenyard.balancer.replica import Replica
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaError,
    ReplicaOverloaded,
    ReplicaRateLimited,
    ReplicaRequestError,
    ReplicaStreamError,
)
from tokenyard.errors import APIError, internal_error, overloaded, replica_failed
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.output_processor import OutputProcessor, child_params
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.outputs import EngineCoreOutput, RequestOutput, merge_steps
from tokenyard.wire.protocol import CoreDelta, Pin, cache_writes
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.balancer")
#: How long a generation cut before its first output waits for the replica's account of
#: what it computed (the replica itself waits up to 5 s for its step to end).
ABORT_REPORT_TIMEOUT_S = 6.0


def replica_error(exc: ReplicaError) -> APIError:
    """A replica failure as the API error the client sees; its `cause` says whether the
    deployment was full ("rate_limit") or failed ("server_error"), None where the request
    itself was refused."""
    if isinstance(exc, ReplicaRequestError) and 400 <= exc.status < 500:
        # The replica's own refusal of the request (its context, its parameters).
        return APIError(exc.status, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, ReplicaOverloaded | ReplicaRateLimited):
        err = overloaded(exc.retry_after if exc.retry_after is not None else 1.0,
                         exc.message or None)
        err.cause = "rate_limit"
        return err
    if isinstance(exc, ReplicaRequestError):
        # Whatever failed inside the replica is the operator's to read, not the tenant's:
        # its text can name files, addresses and other requests' state.
        logger.warning("replica failed a request: %s", exc.message)
        err = APIError(500, "The engine failed while serving this request.", code=exc.code)
    elif isinstance(exc, ReplicaStreamError):  # its message is the client's own, curated
        err = APIError(500, f"The engine failed: {exc.message}", code=exc.code)
    elif isinstance(exc, ReplicaConnectionError):
        logger.warning("replica unreachable: %s", exc)
        err = overloaded(1.0, "The engine is unavailable; retry after a short wait.")
    else:
        err = internal_error()
    err.cause = "server_error"
    return err


def cut_error(exc: ReplicaError) -> APIError:
    """A replica failure after the request's first output: a stream that broke off (the
    replica died, its connection dropped) is a 502 replica failure, not overload."""
    if isinstance(exc, ReplicaConnectionError):
        logger.warning("replica failed mid-stream: %s", exc)
        return replica_failed()
    return replica_error(exc)


# ---------------------------------------------------------------------------- generation


class Generation:
    """One API request's n core requests on the replica, merged into RequestOutputs.

    `start` sends every core request and waits for each one's first delta, so refusals
    (400, 503) surface before any response byte is written. Iterating yields the
    OutputProcessor's per-step outputs. `close` ends every replica stream still open —
    closing a stream is what makes the replica abort that request and free its blocks.
    """

    def __init__(
        self,
        replica: Replica,
        tokenizer: Tokenizer,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        timeline: Timeline | None = None,
        metrics: TokenyardMetrics | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pins: Sequence[Pin] = (),
        lora: str | None = None,
    ) -> None:
        """`cache_salt`: the tenant's prefix-cache salt (blocks are shared only within
        one salt); `priority`: the scheduler's class, lower first; `pins`: prompt
        prefixes the replica keeps cached, (tokens, TTL seconds) each; `lora`: the
        LoRA adapter it runs with (None: the base model)."""
        self.replica = replica
        self.metrics = metrics
        self.cache_salt = cache_salt
        self.priority = priority
        self.pins = list(pins)
        self.lora = lora
        self.timeline = timeline if timeline is not None else Timeline()
        # The request's own id (api/middleware.py makes it unique, whatever the client
        # sent), so the replica's logs and spans carry the id the client sees.
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.processor = OutputProcessor(tokenizer)
        self._queue: asyncio.Queue[CoreDelta | BaseException | None] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        #: Each completion's finish reason once it has one ("abort" is set by close()).
        self.finish_reasons: list[str | None] = [None] * params.n
        #: The stop string (str) or stop token (int) that ended each completion, if any.
        self.stop_reasons: list[int | str | None] = [None] * params.n
        #: The last RequestOutput: prompt, cached and output token counts.
        self.last: RequestOutput | None = None
        #: What the replica had computed for a generation cut before its first output
        #: (None: not cut so, or no replica said): the prefill is billed from it.
        self.abort_report: AbortReport | None = None
        self.failed = False
        self._observed = False

    async def start(self) -> None:
        ids = self.processor.add_request(self.request_id, self.prompt, self.params)
        # The replica gets single completions without stop strings: fan-out and stop
        # matching happen here, on text the replica never sees.
        wire = replace(self.params, n=1, stop=[])
        # generate() is an async generator; its annotation is the narrower AsyncIterator.
        # A pool reports its decision's time as the timeline's `balance` stage.
        extra: dict[str, Any] = {"timeline": self.timeline} if getattr(
            self.replica, "takes_timeline", False) else {}
        if self.lora is not None:
            extra["lora"] = self.lora
        streams = [
            cast(AsyncGenerator[CoreDelta, None],
                 self.replica.generate(cid, self.prompt, child_params(wire, i),
                                     cache_salt=self.cache_salt, priority=self.priority,
                                     pins=self.pins, **extra))
            for i, cid in enumerate(ids)
        ]
        self.timeline.mark("queued")
        # Tasks that a cancelled start leaves running (a gather would cancel them, and the
        # streams with them): `_cut_before_first` first asks the replica what they used.
        waits = [asyncio.ensure_future(s.__anext__()) for s in streams]
        try:
            await asyncio.wait(waits)
        except asyncio.CancelledError:
            await self._cut_before_first(ids, streams, waits)
            raise
        firsts = [_result(w) for w in waits]
        failed = [r for r in firsts if isinstance(r, BaseException)]
        if failed:
            self.failed = True
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()
            error = failed[0]
            if isinstance(error, ReplicaError):
                raise replica_error(error) from None
            raise error
        self._stamp_first_token(cast(list[CoreDelta], firsts))
        for stream, first in zip(streams, firsts, strict=True):
            self._tasks.append(asyncio.create_task(self._pump(stream, cast(CoreDelta, first))))

    async def _cut_before_first(
        self, ids: Sequence[str], streams: Sequence[AsyncGenerator[CoreDelta, None]],
        waits: Sequence[asyncio.Future[CoreDelta]],
    ) -> None:
        """The caller left before every completion's first delta (a client that
        disconnected during the queue or the prefill). The prefill that ran is usage:
        abort each core request with a call that answers what it had computed
        (`abort_report`, which `gateway.outcome` bills), then close the streams — which
        aborts them on the replica whatever the calls did."""
        try:
            async with asyncio.timeout(ABORT_REPORT_TIMEOUT_S):
                reports = await asyncio.gather(*(
                    self._abort_for_report(cid, wait) for cid, wait in zip(ids, waits,
                                                                            strict=True)))
            self.abort_report = _merged(reports)
        except Exception as exc:  # nothing is billed for it then; the blocks are freed
            logger.warning("abort of %s before its first token: no report (%r)",
                           self.request_id, exc)
        finally:
            for wait in waits:
                wait.cancel()
            for wait in waits:
                with contextlib.suppress(BaseException):
                    await wait
            for stream in streams:
                with contextlib.suppress(Exception):
                    await stream.aclose()

    async def _abort_for_report(
        self, core_id: str, wait: asyncio.Future[CoreDelta],
    ) -> AbortReport | None:
        """What core request `core_id` used: the replica's answer to its abort, else (it
        ended meanwhile) the first delta it sent."""
        first = _result(wait) if wait.done() else None
        if isinstance(first, BaseException):
            first = None
        report = None
        if first is None or first.finish_reason is None:
            try:
                report = await self.replica.abort(core_id)
            except ReplicaError as exc:
                logger.info("abort of %s failed (%s)", core_id, exc)
        if report is None and first is not None:
            report = AbortReport(first.num_prompt_tokens, first.num_cached_tokens,
                                 len(first.new_token_ids))
        return report

    def _stamp_first_token(self, firsts: list[CoreDelta]) -> None:
        """first_token now; "admitted" (end of the queue stage) from the replica's own
        prefill time, so Server-Timing can tell queueing from prefill."""
        timeline = self.timeline
        first = timeline.mark("first_token")
        prefill = max((d.prefill_time or 0.0 for d in firsts), default=0.0)
        queued = timeline.events["queued"]
        timeline.mark("admitted", max(queued, first - int(prefill * 1e9)))

    async def _pump(self, stream: AsyncGenerator[CoreDelta, None], first: CoreDelta) -> None:
        try:
            await self._queue.put(first)
            if first.finish_reason is None:
                async for delta in stream:
                    await self._queue.put(delta)
        except Exception as exc:  # delivered to the consumer, which turns it into an error
            await self._queue.put(exc)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        """The processed outputs. A consumer behind the replica (a slow client, a busy
        loop) takes every delta that arrived meanwhile in one go, joined per completion
        (`merge_steps`): one detokenizer push and one event for them, so the further it
        falls behind the less each token costs and the sooner it catches up."""
        timeline, metrics, queue = self.timeline, self.metrics, self._queue
        while True:
            deltas: list[CoreDelta] = []
            failure: BaseException | None = None
            item = await queue.get()
            while True:
                if isinstance(item, BaseException):
                    failure = item  # the deltas before it still go out
                    break
                if item is not None:
                    deltas.append(item)
                if queue.empty():
                    break
                item = queue.get_nowait()
            if deltas:
                began = time.perf_counter_ns()
                outputs, stopped = self.processor.process(
                    cast(list[EngineCoreOutput], merge_steps(deltas)))
                timeline.add("detokenize", time.perf_counter_ns() - began)
                count = sum(len(d.new_token_ids) for d in deltas)
                if count and metrics is not None:
                    metrics.observe_inter_token(timeline.mark_token(count, began),
                                                timeline.lane)
                for core_id, stop in stopped:
                    # The replica ends that completion; its stream then finishes on its own.
                    task = asyncio.create_task(self._stop(core_id, stop))
                    self._side_tasks.add(task)
                    task.add_done_callback(self._side_tasks.discard)
                for out in outputs:
                    self.last = out
                    for delta in out.deltas:
                        if delta.finish_reason is not None:
                            self.finish_reasons[delta.index] = delta.finish_reason
                            self.stop_reasons[delta.index] = delta.stop_reason
                    if out.finished:
                        timeline.mark("done")
                    yield out
                    if out.finished:
                        return
            if failure is not None:
                self.failed = True
                raise cut_error(failure) if isinstance(failure, ReplicaError) else failure

    async def _stop(self, core_id: str, stop: str) -> None:
        try:
            await self.replica.stop(core_id, stop)
        except ReplicaError as exc:
            logger.info("stop %s failed (%s); aborting it", core_id, exc)
            with contextlib.suppress(ReplicaError):
                await self.replica.abort(core_id)

    async def close(self) -> None:
        """Cancel the pumps (each open replica stream is closed, so the replica aborts it),
        then record the request in the metrics once."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._observed:
            return
        self._observed = True
        reasons = [reason or "abort" for reason in self.finish_reasons]
        self.finish_reasons = list(reasons)
        if self.failed or self.last is None or self.metrics is None:
            return
        self.metrics.observe_request(
            self.timeline, self.last.num_prompt_tokens, self.last.num_output_tokens, reasons
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_cached_tokens(self) -> int:
        return self.last.num_cached_tokens if self.last is not None else 0

    @property
    def cache_writes(self) -> tuple[int, int]:
        """Prompt tokens its pins wrote to the cache: (kept 5 minutes, kept 1 hour)."""
        return cache_writes(self.pins, self.num_cached_tokens) if self.last else (0, 0)

    @property
    def backlog(self) -> bool:
        """Whether more replica deltas have already arrived, so the next output is ready
        without waiting (a stream holds its write and sends both steps in one)."""
        return not self._queue.empty()


def _result(wait: asyncio.Future[CoreDelta]) -> CoreDelta | BaseException:
    """A finished first-delta wait's delta, or what it raised (a cancellation too)."""
    if wait.cancelled():
        return asyncio.CancelledError()
    return wait.exception() or wait.result()


def _merged(reports: Sequence[AbortReport | None]) -> AbortReport | None:
    """One generation's report from its completions': the prompt as the completion that
    got furthest into it computed it (a prompt is billed once per generation, as for a
    finished one), and every completion's sampled tokens."""
    found = [r for r in reports if r is not None]
    if not found:
        return None
    furthest = max(found, key=lambda r: r.num_prompt_tokens)
    return replace(furthest, num_output_tokens=sum(r.num_output_tokens for r in found))
