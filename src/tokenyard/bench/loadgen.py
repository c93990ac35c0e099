"""The load generator: sends a workload's requests to an OpenAI- or Anthropic-compatible
server, open loop (Poisson arrivals) or closed loop (N requests in flight), and records what
each request saw as a `RequestRecord`.

Cheap on purpose, since it shares the machine with the server it measures: one aiohttp
session with no connection cap (an open loop must never queue in the client), stream bytes
fed as they arrive to the incremental `SSEParser`, and a JSON parse per event. A chunk's time
is when its bytes arrived, so events that arrive together have an inter-token gap of 0.

Server-Timing: a response's header holds the stages done before its first byte; tokenyard
(like llama.cpp's server) puts a ``timings`` object of stage durations in a stream's last
event, which completes the header's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from tokenyard.api.sse import SSEEvent, SSEParser
from tokenyard.bench.stats import RequestRecord
from tokenyard.bench.workloads import RequestSpec

APIS = ("openai-chat", "openai-completions", "anthropic")
_PATHS = {"openai-chat": "/chat/completions", "openai-completions": "/completions",
          "anthropic": "/messages"}
_ANTHROPIC_VERSION = "2023-06-01"


@dataclass(frozen=True)
class Target:
    """Where and how to send: `base_url` ends in ``/v1``; `api` is one of `APIS`."""

    base_url: str
    model: str
    api: str = "openai-chat"
    api_key: str | None = None
    stream: bool = True
    #: Sends ``ignore_eos: true`` (vLLM's extension; other servers ignore unknown fields).
    ignore_eos: bool = False
    #: Sent as ``temperature`` when set (0: greedy, what the offline engine's figures use).
    temperature: float | None = None
    #: Bound on one request, connect to last byte (seconds).
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")

    @property
    def url(self) -> str:
        """The route this target's requests go to."""
        return self.base_url.rstrip("/") + _PATHS[self.api]

    def headers(self) -> dict[str, str]:
        """Request headers: JSON, the API key as a bearer token (and Anthropic's own)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self.api == "anthropic":
            headers["anthropic-version"] = _ANTHROPIC_VERSION
            if self.api_key:
                headers["x-api-key"] = self.api_key
        return headers

    def body(self, spec: RequestSpec) -> bytes:
        """The JSON body asking for `spec` in this target's API."""
        body: dict[str, Any] = {"model": self.model, "max_tokens": spec.max_tokens,
                                "stream": self.stream}
        if self.api == "openai-completions":
            body["prompt"] = spec.prompt_text()
        else:
            body["messages"] = spec.messages
        if self.stream and self.api != "anthropic":
            body["stream_options"] = {"include_usage": True}
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return json.dumps(body, separators=(",", ":")).encode()


# ---------------------------------------------------------------------------- responses


@dataclass
class StreamEvent:
    """What one SSE event means to the benchmark."""

    #: Generated text the event carries ("" for none).
    content: str = ""
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    #: ``usage.prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache served.
    cached_tokens: int | None = None
    #: The error type, when the event reports an error.
    error: str | None = None
    error_detail: str | None = None
    #: The stream's terminator: OpenAI's ``[DONE]``, Anthropic's ``message_stop``.
    done: bool = False
    #: Stage durations (ms) from the event's ``timings`` object, if it has one.
    timings: dict[str, float] | None = None


def _error_words(error: Any) -> tuple[str, str]:
    """(type, detail) of an ``error`` object of either API."""
    if not isinstance(error, dict):
        return "error", str(error)[:200]
    kind = error.get("type") or error.get("code") or "error"
    return str(kind), str(error.get("message", ""))[:200]


def stages_from_timings(timings: Any) -> dict[str, float] | None:
    """Stage → ms from a stream event's ``timings`` object: tokenyard's stage durations,
    or llama.cpp's ``prompt_ms`` and ``predicted_ms`` (its other entries are counts and
    rates). None when there is no such object."""
    if not isinstance(timings, dict):
        return None
    if "predicted_ms" in timings or "prompt_ms" in timings:
        timings = {k[:-3]: timings.get(k) for k in ("prompt_ms", "predicted_ms")}
    return {k: float(v) for k, v in timings.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def interpret_openai(event: SSEEvent) -> StreamEvent:
    """An OpenAI chat or completions stream event: content, usage, error or ``[DONE]``."""
    if event.is_done:
        return StreamEvent(done=True)
    obj = event.json()
    if "error" in obj:
        kind, detail = _error_words(obj["error"])
        return StreamEvent(error=kind, error_detail=detail)
    out = StreamEvent(timings=stages_from_timings(obj.get("timings")))
    for choice in obj.get("choices") or ():
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if text:
            out.content += text
    usage = obj.get("usage")
    if isinstance(usage, dict):
        out.prompt_tokens = usage.get("prompt_tokens")
        out.output_tokens = usage.get("completion_tokens")
        out.cached_tokens = _cached_tokens(usage)
    return out


def _cached_tokens(usage: dict[str, Any]) -> int | None:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else None


def interpret_anthropic(event: SSEEvent) -> StreamEvent:
    """An Anthropic Messages stream event: text deltas, usage, ``error``, ``message_stop``."""
    obj = event.json()
    kind = event.event or obj.get("type")
    if kind == "error":
        error_type, detail = _error_words(obj.get("error"))
        return StreamEvent(error=error_type, error_detail=detail)
    if kind == "message_stop":
        return StreamEvent(done=True, timings=stages_from_timings(obj.get("timings")))
    if kind == "content_block_delta":
        delta = obj.get("delta") or {}
        return StreamEvent(content=delta.get("text") or "")
    if kind == "message_start":
        usage = (obj.get("message") or {}).get("usage") or {}
        return StreamEvent(prompt_tokens=usage.get("input_tokens"))
    if kind == "message_delta":
        usage = obj.get("usage") or {}
        return StreamEvent(output_tokens=usage.get("output_tokens"))
    return StreamEvent()  # ping, content_block_start/stop


def parse_server_timing(value: str) -> dict[str, float]:
    """Stage → duration (ms) from a ``Server-Timing`` value (W3C syntax:
    ``name;dur=1.5;desc="x", name2;dur=3``). Metrics without a numeric ``dur`` are skipped."""
    stages: dict[str, float] = {}
    for metric in _split_outside_quotes(value, ","):
        name, *params = (p.strip() for p in _split_outside_quotes(metric, ";"))
        for param in params:
            key, _, raw = param.partition("=")
            if key.strip().lower() != "dur":
                continue
            with contextlib.suppress(ValueError):
                stages[name] = float(raw.strip().strip('"'))
    return stages


def _split_outside_quotes(text: str, sep: str) -> list[str]:
    parts, start, quoted = [], 0, False
    for i, ch in enumerate(text):
        if ch == '"':
            quoted = not quoted
        elif ch == sep and not quoted:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p.strip()]


def _failure_detail(text: str) -> str:
    """The words of an error body in either API's shape (or its start, if not JSON)."""
    try:
        obj = json.loads(text)
        kind, detail = _error_words(obj.get("error") if isinstance(obj, dict) else obj)
        return f"{kind}: {detail}"
    except ValueError:
        return text[:200]


# ---------------------------------------------------------------------------- one request


#: How a request fails when the pooled connection it went out on was already closed by
#: the server, before any byte of an answer: llama.cpp's server closes its connection after
#: each streamed response without saying so, and the pool hands out the dead one.
STALE_CONNECTION = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                    aiohttp.ClientConnectionResetError)


async def _post(
    stack: contextlib.AsyncExitStack, session: aiohttp.ClientSession, target: Target,
    spec: RequestSpec,
) -> tuple[aiohttp.ClientResponse, bool]:
    """POST `spec` and wait for the response's head; (response, whether it was retried).

    A request that failed before any byte came back is sent once more, on a connection of
    its own (a one-off session that closes it after use): the server answered nothing on
    the first, so nothing is counted twice."""
    body, headers = target.body(spec), target.headers()
    try:
        return await stack.enter_async_context(
            session.post(target.url, data=body, headers=headers)), False
    except STALE_CONNECTION:
        fresh = await stack.enter_async_context(aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=session.timeout))
        return await stack.enter_async_context(
            fresh.post(target.url, data=body, headers=headers)), True


async def send_one(
    session: aiohttp.ClientSession, target: Target, spec: RequestSpec, record: RequestRecord,
    t0: float,
) -> bool:
    """Send `spec` and fill `record` (`t0` is the run's perf_counter start); whether it
    had to be sent again on a fresh connection (see `_post`)."""
    start = time.perf_counter()
    record.start_s = start - t0
    retried = False
    try:
        async with contextlib.AsyncExitStack() as stack:
            response, retried = await _post(stack, session, target, spec)
            record.server_timing_ms = parse_server_timing(
                response.headers.get("Server-Timing", ""))
            if response.status != 200:
                record.error = f"http_{response.status}"
                record.error_detail = _failure_detail(await response.text())
            elif target.stream:
                await read_stream(response, target.api, record, start)
            else:
                _read_whole(await response.json(content_type=None), target, record, start)
    except Exception as exc:  # a benchmark records a failure and goes on
        record.error = type(exc).__name__
        record.error_detail = str(exc)[:200]
    record.e2e_s = time.perf_counter() - start
    record.ok = record.error is None
    return retried


async def read_stream(
    response: aiohttp.ClientResponse, api: str, record: RequestRecord, start: float
) -> None:
    """Read an SSE response body of `api` into `record`: TTFT and gaps between content
    chunks (from `start`, a perf_counter time), token counts, Server-Timing stages from a
    ``timings`` object, and the error of an error event or of a stream that ends without
    its terminator."""
    interpret = interpret_anthropic if api == "anthropic" else interpret_openai
    parser = SSEParser()
    last: float | None = None
    chunks = 0
    done = False
    async for piece in response.content.iter_any():
        now = time.perf_counter()
        for event in parser.feed(piece):
            info = interpret(event)
            if info.error is not None:
                record.error = f"stream_{info.error}"
                record.error_detail = info.error_detail
                return
            if info.content:
                chunks += 1
                if last is None:
                    record.ttft_s = now - start
                else:
                    record.itls_s.append(now - last)
                last = now
            if info.prompt_tokens is not None:
                record.prompt_tokens = info.prompt_tokens
            if info.cached_tokens is not None:
                record.cached_tokens = info.cached_tokens
            if info.output_tokens is not None:
                record.output_tokens = info.output_tokens
            if info.timings:
                record.server_timing_ms.update(info.timings)
            done = done or info.done
    if not done:
        record.error = "incomplete_stream"
        record.error_detail = "the stream ended without its terminator"
    elif not record.output_tokens:
        record.output_tokens = chunks  # no usage: one token per content chunk


def _read_whole(obj: Any, target: Target, record: RequestRecord, start: float) -> None:
    record.ttft_s = time.perf_counter() - start  # the whole answer is its first token
    usage = obj.get("usage") or {}
    if target.api == "anthropic":
        record.prompt_tokens = usage.get("input_tokens")
        record.output_tokens = usage.get("output_tokens") or 0
    else:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.output_tokens = usage.get("completion_tokens") or 0
        record.cached_tokens = _cached_tokens(usage)


# ---------------------------------------------------------------------------- a run


@dataclass
class LoadResult:
    """One run: its records, how long it lasted (first send to last response, s) and this
    process's CPU time meanwhile (s)."""

    records: list[RequestRecord]
    duration_s: float
    client_cpu_s: float
    rate: float | None = None
    concurrency: int | None = None
    #: Requests sent a second time on a fresh connection (their first found it closed).
    retried: int = 0


def make_session(limit: int = 0, timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """A pooled session; `limit` 0 puts no cap on open connections."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=10.0),
    )


async def run_load(
    target: Target,
    workload: Iterator[RequestSpec],
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    max_requests: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    progress: bool = False,
) -> LoadResult:
    """Send requests from `workload` until `max_requests` were sent or `duration_s` passed
    (at least one bound is required), then wait for those in flight.

    Open loop with `rate` (requests/s, Poisson arrivals drawn from `seed`; a late generator
    sends at once and catches up), closed loop with `concurrency` requests in flight.
    """
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    if max_requests is None and duration_s is None:
        raise ValueError("give max_requests or duration_s (or both)")
    if (rate is not None and rate <= 0) or (concurrency is not None and concurrency < 1):
        raise ValueError("rate must be > 0 and concurrency >= 1")
    records: list[RequestRecord] = []
    retried = 0
    bar = tqdm(total=max_requests, unit="req", file=sys.stderr, disable=not progress,
               leave=False, dynamic_ncols=True)
    cpu0 = time.process_time()
    async with make_session(timeout_s=target.timeout_s) as session:
        t0 = time.perf_counter()

        async def one(index: int, spec: RequestSpec, scheduled: float) -> None:
            record = RequestRecord(index=index, scheduled_s=scheduled, start_s=scheduled)
            nonlocal retried
            records.append(record)
            again = await send_one(session, target, spec, record, t0)
            retried += again  # after the await: `retried += await …` would lose counts
            bar.update(1)

        def more(sent: int, at: float) -> bool:
            return (max_requests is None or sent < max_requests) and (
                duration_s is None or at < duration_s)

        if rate is not None:
            rng = random.Random(seed)
            tasks: list[asyncio.Task[None]] = []
            due = 0.0
            for index in itertools.count():
                if not more(index, due):
                    break
                delay = t0 + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(index, next(workload), due)))
                due += rng.expovariate(rate)
            await asyncio.gather(*tasks)
        else:
            counter = itertools.count()

            async def worker() -> None:
                while True:
                    index = next(counter)
                    now = time.perf_counter() - t0
                    if not more(index, now):
                        return
                    await one(index, next(workload), now)

            assert concurrency is not None
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    bar.close()
    records.sort(key=lambda r: r.index)
    return LoadResult(records, duration, time.process_time() - cpu0, rate, concurrency,
                      retried)


async def list_models(base_url: str, api_key: str | None = None) -> list[str]:
    """The model ids a server lists at ``GET {base_url}/models``."""
    headers = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    async with make_session(timeout_s=30.0) as session, session.get(
        base_url.rstrip("/") + "/models", headers=headers
    ) as response:
        if response.status != 200:
            raise ValueError(f"GET {base_url}/models answered {response.status}: "
                             f"{_failure_detail(await response.text())}")
        obj = await response.json(content_type=None)
    return [str(m["id"]) for m in obj.get("data", [])]
