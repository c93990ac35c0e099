"""One API request on an external OpenAI-compatible upstream, as a `generation.Generation`.

`UpstreamGeneration` has the public surface of `generation.Generation` (start, iterate
`RequestOutput`s, close, finish and stop reasons, the last output's counts), so the
dialects' formats and the gateway's settlement work on it unchanged. Its deltas carry text
and no token ids: the upstream tokenizes, applies stop strings and counts; its `usage`,
which arrives at the end, replaces our own tokenizer's estimate of the prompt. Its body is
`request_body`; its logprob tokens are interned in a `TokenTable`. The tenant's
prefix-cache salt travels in the body as `cache_salt`; the `UpstreamClient` sends it to a
server that keeps a cache per salt, and otherwise hides that server's cached tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol, cast

from tokenyard.balancer.generation import cut_error, replica_error
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaError,
    ReplicaStreamError,
)
from tokenyard.balancer.upstream import CACHE_SALT, QUEUES, STREAM_BROKEN, Chunk
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.content import TemplateMessage, openai_content
from tokenyard.text.tools import CallsAsText, ToolUse, openai_tools
from tokenyard.wire.abort import AbortReport
from tokenyard.wire.outputs import CompletionDelta, Logprob, RequestOutput
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

logger = logging.getLogger("tokenyard.balancer")

#: Finish reasons that pass through as they are; any other non-null one becomes "stop".
_FINISH_REASONS = frozenset({"stop", "length", "content_filter", "tool_calls"})
#: How long `close` lets a finished stream read its ``[DONE]``, so its connection goes
#: back to the pool instead of being closed.
_DONE_GRACE_S = 0.1


# ---------------------------------------------------------------------------- the body


def request_body(
    params: SamplingParams,
    model: str,
    *,
    messages: Sequence[TemplateMessage] | None = None,
    prompt: str | None = None,
    user: str | None = None,
    tools: ToolUse | None = None,
    cache_salt: str | None = None,
    queues: bool = True,
) -> dict[str, Any]:
    """The OpenAI body (without `stream`) of a chat (`messages`) or a completion
    (`prompt`); a message with images sends them as our re-encodings (`openai_content`);
    active `tools` are passed on as they are (`openai_tools`); `cache_salt`, the
    tenant's, for the client to send on or withhold (`UpstreamClient`); `queues=False`
    as our `QUEUES` field, which the client pops.
    Temperature and top_p are always sent (vLLM otherwise applies the model's
    own defaults); vLLM's extensions (top_k, min_p, repetition_penalty, min_tokens,
    ignore_eos, ...) only when set, so a plain OpenAI-compatible server is not sent
    fields it may refuse."""
    body: dict[str, Any] = {"model": model}
    if messages is not None:
        body["messages"] = [{"role": m["role"], "content": openai_content(m)}
                            for m in messages]
    else:
        body["prompt"] = prompt
    p = params
    body["temperature"] = p.temperature
    body["top_p"] = p.top_p
    optional: dict[str, Any] = {
        "max_tokens": p.max_tokens,
        "n": p.n if p.n != 1 else None,
        "stop": list(p.stop) or None,
        "seed": p.seed,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "logit_bias": {str(t): b for t, b in p.logit_bias.items()} if p.logit_bias else None,
        "user": user,
        "top_k": p.top_k if p.top_k > 0 else None,
        "min_p": p.min_p or None,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        "min_tokens": p.min_tokens or None,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "ignore_eos": p.ignore_eos or None,
        "skip_special_tokens": False if not p.skip_special_tokens else None,
        "include_stop_str_in_output": p.include_stop_str_in_output or None,
        CACHE_SALT: cache_salt,
        QUEUES: None if queues else False,
    }
    if p.logprobs is not None:
        if messages is not None:
            optional["logprobs"], optional["top_logprobs"] = True, p.logprobs
        else:
            optional["logprobs"] = p.logprobs
    body.update((k, v) for k, v in optional.items() if v is not None)
    if tools is not None and tools.active:
        body.update(openai_tools(tools))
    elif p.guided is not None:
        body.update(guided_body(p.guided))
    return body


def guided_body(guided: GuidedDecoding) -> dict[str, Any]:
    """A grammar as the upstream's fields: JSON output as OpenAI's `response_format`
    (what every OpenAI-compatible server takes); a regex or an EBNF grammar as
    `guided_regex` / `guided_grammar`, the spelling tokenyard's own routes and vLLM's
    take (a server without them refuses the request, which comes back as its 400, never
    an answer that ignored the grammar). A structural tag only comes from tools, which an
    upstream gets as tools."""
    if guided.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if guided.kind == "json_schema":
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": "output", "schema": json.loads(guided.spec), "strict": True}}}
    if guided.kind == "regex":
        return {"guided_regex": guided.spec}
    if guided.kind == "ebnf":
        return {"guided_grammar": guided.spec}
    return {"structured_outputs": {guided.kind: guided.spec}}


# ---------------------------------------------------------------------------- logprobs


class TokenTable:
    """Upstream tokens (their bytes) as small ids, for `Logprob.token_id`: the formats
    spell a logprob's token with a `token_bytes(id)` function, and this table is the one
    for an upstream's tokens (pass it, or a generation's `token_bytes`, to the format)."""

    def __init__(self) -> None:
        self._ids: dict[bytes, int] = {}
        self._bytes: list[bytes] = []

    def intern(self, raw: bytes) -> int:
        """The id of the token `raw` (a new one the first time)."""
        found = self._ids.get(raw)
        if found is None:
            found = self._ids[raw] = len(self._bytes)
            self._bytes.append(raw)
        return found

    def __call__(self, token_id: int) -> bytes:
        return self._bytes[token_id]


def _token_bytes(entry: Mapping[str, Any]) -> bytes:
    raw = entry.get("bytes")
    if isinstance(raw, list):
        return bytes(raw)
    return str(entry.get("token", "")).encode("utf-8")


def _chat_logprobs(raw: Any, table: TokenTable) -> list[Logprob] | None:
    """A chat chunk's ``logprobs.content`` entries as Logprobs (None: none given)."""
    content = raw.get("content") if isinstance(raw, dict) else None
    if not content:
        return None
    return [
        Logprob(table.intern(_token_bytes(e)), float(e.get("logprob", 0.0)),
                [(table.intern(_token_bytes(t)), float(t.get("logprob", 0.0)))
                 for t in e.get("top_logprobs") or ()])
        for e in content
    ]


def _completion_logprobs(raw: Any, table: TokenTable) -> list[Logprob] | None:
    """A completion chunk's ``logprobs`` (tokens, token_logprobs, top_logprobs)."""
    if not isinstance(raw, dict) or not raw.get("tokens"):
        return None
    tokens, lps = raw["tokens"], raw.get("token_logprobs") or []
    tops = raw.get("top_logprobs") or []
    out = []
    for i, token in enumerate(tokens):
        top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else {}
        lp = lps[i] if i < len(lps) and lps[i] is not None else 0.0
        out.append(Logprob(table.intern(str(token).encode("utf-8")), float(lp),
                           [(table.intern(str(t).encode("utf-8")), float(v))
                            for t, v in top.items()]))
    return out


# ---------------------------------------------------------------------------- generation


class UpstreamTarget(Protocol):
    """Where an upstream generation goes: an `UpstreamClient`, or a pool of them that
    fails over between its members before their first chunk."""

    def open_chat(self, body: Mapping[str, Any]) -> AsyncIterator[Chunk]:
        ...

    def open_completion(self, body: Mapping[str, Any]) -> AsyncIterator[Chunk]:
        ...


class UpstreamGeneration:
    """One API request on an upstream, with `generation.Generation`'s public surface.

    `start` sends it and waits for the first chunk (refusals raise the API error before
    any byte is written); iterating yields `RequestOutput`s of text deltas; the finishing
    output is held until the upstream's usage arrives, so `last` carries its prompt,
    cached and output token counts; `close` closes the upstream stream if still open.
    """

    def __init__(
        self,
        target: UpstreamTarget,
        request_id: str,
        *,
        messages: Sequence[TemplateMessage] | None = None,
        prompt: str | None = None,
        params: SamplingParams,
        model: str,
        timeline: Timeline | None = None,
        metrics: TokenyardMetrics | None = None,
        prompt_tokens_estimate: int,
        user: str | None = None,
        tokens: TokenTable | None = None,
        tools: ToolUse | None = None,
        cache_salt: str | None = None,
        queues: bool = True,
    ) -> None:
        """A chat (`messages`, the templates' messages) or a completion (`prompt`, text),
        exactly one. `model`: the upstream's name of the model. `prompt_tokens_estimate`:
        our tokenizer's count, reported until the upstream's usage arrives. `tokens`: the
        table logprob tokens are interned in (default: one of its own, `token_bytes`).
        `tools`: passed on to the upstream, whose calls come back as tagged text.
        `cache_salt`: the tenant's prefix-cache salt (None: one tenant, no gateway); an
        upstream that cannot keep tenants' caches apart then reports no cached tokens.
        `queues=False`: a 429 is the answer at once, not queued for (it has a fallback)."""
        if (messages is None) == (prompt is None):
            raise ValueError("an upstream generation needs messages or a prompt, not both")
        self.target = target
        self.request_id = request_id
        self.messages = messages
        self.prompt_text = prompt
        self.params = params
        self.model = model
        self.user = user
        self.timeline = timeline if timeline is not None else Timeline()
        self.metrics = metrics
        self.prompt_tokens_estimate = prompt_tokens_estimate
        self.tools = tools
        self.cache_salt = cache_salt
        self.queues = queues
        self._calls = [CallsAsText() for _ in range(params.n)]
        #: Spells the ids of the deltas' logprobs (the formats' `token_bytes`).
        self.token_bytes = tokens if tokens is not None else TokenTable()
        #: Each choice's finish reason once it has one ("abort" is set by close()).
        self.finish_reasons: list[str | None] = [None] * params.n
        #: The stop string (or stop token id) that ended each choice, when the upstream
        #: says (vLLM's `stop_reason`, SGLang's `matched_stop`).
        self.stop_reasons: list[int | str | None] = [None] * params.n
        #: The last RequestOutput yielded.
        self.last: RequestOutput | None = None
        #: An upstream does not say what a request cut before its first chunk computed.
        self.abort_report: AbortReport | None = None
        self.failed = False
        self._usage: dict[str, Any] | None = None
        self._counted_tokens = 0  # tokens seen before usage arrives (an estimate)
        self._queue: asyncio.Queue[Chunk | BaseException | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._observed = False

    def body(self) -> dict[str, Any]:
        """The OpenAI body sent upstream."""
        return request_body(self.params, self.model, messages=self.messages,
                            prompt=self.prompt_text, user=self.user, tools=self.tools,
                            cache_salt=self.cache_salt, queues=self.queues)

    async def start(self) -> None:
        target = self.target
        opened = target.open_chat if self.messages is not None else target.open_completion
        stream = cast(AsyncGenerator[Chunk, None], opened(self.body()))
        self.timeline.mark("queued")
        try:
            first = await stream.__anext__()
        except BaseException as exc:
            self.failed = True
            with contextlib.suppress(Exception):
                await stream.aclose()
            if isinstance(exc, StopAsyncIteration):
                exc = ReplicaConnectionError("the upstream's stream ended before its first chunk")
            if isinstance(exc, ReplicaError):
                raise replica_error(exc) from None
            raise
        # An upstream does not say how long it queued: its first chunk ends both stages.
        stamp = self.timeline.mark("first_token")
        self.timeline.mark("admitted", stamp)
        self._task = asyncio.create_task(self._pump(stream, first))

    async def _pump(self, stream: AsyncGenerator[Chunk, None], first: Chunk) -> None:
        try:
            await self._queue.put(first)
            async for chunk in stream:
                await self._queue.put(chunk)
            await self._queue.put(None)
        except Exception as exc:  # delivered to the consumer, which turns it into an error
            await self._queue.put(exc)
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        held: RequestOutput | None = None  # the finishing output, waiting for usage
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.failed = True
                raise cut_error(item) if isinstance(item, ReplicaError) else item
            if item is None and held is None:
                self.failed = True
                raise replica_error(ReplicaStreamError(
                    "the upstream's stream ended before every choice finished", STREAM_BROKEN))
            out = self._output(item) if item is not None else None
            if out is not None and out.finished:
                held = out
            elif out is not None:
                self.last = out
                yield out
            if held is not None and (item is None or self._usage is not None):
                self.last = final = replace(
                    held, num_prompt_tokens=self.num_prompt_tokens,
                    num_cached_tokens=self.num_cached_tokens,
                    num_output_tokens=self.num_output_tokens)
                self.timeline.mark("done")
                yield final
                return

    def _output(self, chunk: Chunk) -> RequestOutput | None:
        """The deltas of one chunk (None: nothing moved); records usage and finishes."""
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage = usage
        chat = self.messages is not None
        deltas: list[CompletionDelta] = []
        arrived = 0
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            if not isinstance(index, int) or not 0 <= index < self.params.n:
                logger.warning("the upstream of %s sent choice %.80r of %d", self.request_id,
                               index, self.params.n)
                raise ReplicaStreamError("the upstream sent a choice nobody asked for",
                                         STREAM_BROKEN)
            if self.finish_reasons[index] is not None:
                continue
            finish = _finish_reason(choice.get("finish_reason"))
            if chat:
                delta = choice.get("delta") or {}
                text = (delta.get("content") or "") + self._calls[index].delta(
                    delta.get("tool_calls"))
                if finish is not None:
                    text += self._calls[index].close()
                logprobs = _chat_logprobs(choice.get("logprobs"), self.token_bytes)
            else:
                text = choice.get("text") or ""
                logprobs = _completion_logprobs(choice.get("logprobs"), self.token_bytes)
            if not text and logprobs is None and finish is None:
                continue
            stop: int | str | None = None
            if finish == "stop":
                matched = choice.get("stop_reason", choice.get("matched_stop"))
                stop = matched if isinstance(matched, int | str) else None
                self.stop_reasons[index] = stop
            self.finish_reasons[index] = finish
            arrived += len(logprobs) if logprobs is not None else bool(text)
            deltas.append(CompletionDelta(index, text, [], logprobs, finish, stop))
        if arrived:
            self._counted_tokens += arrived
            interval = self.timeline.mark_token(arrived)
            if self.metrics is not None:
                self.metrics.observe_inter_token(interval, self.timeline.lane)
        if not deltas:
            return None
        return RequestOutput(
            self.request_id, deltas, all(r is not None for r in self.finish_reasons),
            self.num_prompt_tokens, self.num_cached_tokens, self.num_output_tokens,
        )

    async def close(self) -> None:
        """Close the upstream stream if still open (the upstream aborts the request), then
        record the request in the metrics once."""
        task = self._task
        if task is not None:
            if self.last is not None and self.last.finished and not task.done():
                await asyncio.wait([task], timeout=_DONE_GRACE_S)
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._observed:
            return
        self._observed = True
        reasons = [reason or "abort" for reason in self.finish_reasons]
        self.finish_reasons = list(reasons)
        if self.failed or self.last is None or self.metrics is None:
            return
        self.metrics.observe_request(self.timeline, self.num_prompt_tokens,
                                     self.num_output_tokens, reasons)

    def _usage_count(self, *path: str) -> int | None:
        value: Any = self._usage
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, int) else None

    @property
    def num_prompt_tokens(self) -> int:
        """The upstream's prompt count once its usage arrived; our estimate until then."""
        count = self._usage_count("prompt_tokens")
        return count if count is not None else self.prompt_tokens_estimate

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens the upstream served from its cache (its usage's
        prompt_tokens_details.cached_tokens; 0 until usage arrives or if it has none)."""
        return self._usage_count("prompt_tokens_details", "cached_tokens") or 0

    #: Prompt-cache writes (5 min, 1 h): an upstream pins nothing for us.
    cache_writes = (0, 0)

    @property
    def num_output_tokens(self) -> int:
        """The upstream's completion count once its usage arrived; until then the tokens
        seen (logprob entries, else one per chunk with text)."""
        count = self._usage_count("completion_tokens")
        return count if count is not None else self._counted_tokens

    @property
    def backlog(self) -> bool:
        """Whether more chunks have already arrived (the stream writes them together)."""
        return not self._queue.empty()


def _finish_reason(raw: Any) -> str | None:
    """An upstream's finish reason as ours: stop, length, content_filter and tool_calls
    pass; the legacy function_call is tool_calls; anything else non-null is stop."""
    if not raw:
        return None
    if raw == "function_call":
        return "tool_calls"
    return raw if raw in _FINISH_REASONS else "stop"
