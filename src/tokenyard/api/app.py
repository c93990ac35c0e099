"""The HTTP process: OpenAI- and Anthropic-compatible routes in front of one engine replica.

This process never imports torch (DESIGN §2): it parses bodies, applies the chat template,
tokenizes once, fans a request out into its n core requests, and sends token ids to the
replica through `ReplicaClient`. The replica's per-step token deltas come back and go
through `OutputProcessor` here (detokenization, stop strings), so text work stays off the
replica's step loop.

aiohttp.web rather than FastAPI: it was measured cheaper per request on this machine, and
every route here validates its own body with `parse_body` anyway.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

from aiohttp import web
from pydantic import BaseModel

from tokenyard.api import schemas_anthropic as sa
from tokenyard.api import schemas_openai as so
from tokenyard.api.admin import add_admin_routes
from tokenyard.api.convert import (
    AnthropicStream,
    ChatStream,
    CompletionStream,
    anthropic_messages,
    anthropic_request_to_engine,
    build_anthropic_message,
    build_chat_completion,
    build_model_list,
    build_text_completion,
    chat_request_to_engine,
    completion_request_to_engine,
    has_prefill,
    new_chat_id,
    new_completion_id,
    new_message_id,
    now,
)
from tokenyard.api.errors import parse_body, render_anthropic, render_openai
from tokenyard.api.ratelimit_headers import ratelimit_headers
from tokenyard.api.schemas_anthropic import MessageStopEvent
from tokenyard.api.sse import (
    SSE_DONE,
    SSE_HEADERS,
    anthropic_event,
    anthropic_stream_error,
    openai_stream_error,
    sse_data,
    sse_event,
)
from tokenyard.balancer.generation import Generation, finished_completions, merged
from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.errors import (
    APIError,
    body_too_large,
    context_length_exceeded,
    internal_error,
    model_not_found,
    not_found,
    overloaded,
)
from tokenyard.gateway import idempotency
from tokenyard.gateway.admin import Admin
from tokenyard.gateway.auth import require_admin
from tokenyard.gateway.billing import Usage
from tokenyard.gateway.pipeline import (
    ABORTED,
    COMPLETED,
    FAILED,
    STOPPED,
    Gateway,
    RateLimitExceeded,
    Ticket,
)
from tokenyard.store.records import KeyContext
from tokenyard.telemetry.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenyard.telemetry.metrics import TokenyardMetrics
from tokenyard.telemetry.timeline import Timeline
from tokenyard.text.chat_template import ChatTemplateError
from tokenyard.text.model_files import load_tokenizer
from tokenyard.text.prompts import Conversation, render_conversation
from tokenyard.text.tokenizer import Tokenizer
from tokenyard.wire.protocol import ReplicaInfo
from tokenyard.wire.sampling_params import SamplingParams

logger = logging.getLogger("tokenyard.api")

#: Request bodies above this are refused with 413 before any parsing.
MAX_BODY_BYTES = 4 * 2**20
#: The `system_fingerprint` of every OpenAI response.
SYSTEM_FINGERPRINT = "tokenyard"
REQUEST_ID_HEADER = "x-request-id"

_STATE: web.AppKey[AppState] = web.AppKey("tokenyard_state")


# ---------------------------------------------------------------------------- state


@dataclass
class AppState:
    """What every handler needs: the replica's client and model, and the tokenizer."""

    client: ReplicaClient
    tokenizer: Tokenizer
    info: ReplicaInfo
    created: int
    admitting: bool = True
    metrics: TokenyardMetrics = field(default_factory=TokenyardMetrics)
    #: Keys, limits, billing and the ledger; None serves without authentication.
    gateway: Gateway | None = None

    @property
    def model(self) -> str:
        return self.info.model

    def template(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        """The conversation through the model's chat template, as text."""
        try:
            return render_conversation(
                self.tokenizer, cast(Conversation, messages), add_generation_prompt
            )
        except ChatTemplateError as exc:
            raise APIError(400, f"The chat template rejected the messages: {exc}",
                           param="messages") from None

    def template_with_prefill(self, messages: list[dict[str, str]]) -> str:
        """Anthropic's rule: a final assistant message is the start of the reply.

        The template renders the turns before it with the generation prompt, and the
        prefill text follows raw — rendering it as a finished turn would close it with the
        end-of-turn token and the model would start a new turn instead of continuing.
        """
        if not has_prefill(messages):
            return self.template(messages, add_generation_prompt=True)
        return self.template(messages[:-1], True) + messages[-1]["content"]

    def encode_rendered(self, text: str) -> list[int]:
        """Tokens of templated text (the template already holds BOS if the model wants it)."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def fit(self, prompt_len: int, params: SamplingParams, param: str) -> SamplingParams:
        """Check prompt + max_tokens against the window; fill max_tokens when unset."""
        window = self.info.max_model_len
        if params.max_tokens is None:
            left = window - prompt_len
            if left < 1:
                raise context_length_exceeded(window, prompt_len, None, param=param)
            return replace(params, max_tokens=left)
        if prompt_len + params.max_tokens > window:
            raise context_length_exceeded(window, prompt_len, params.max_tokens, param=param)
        return params


# ---------------------------------------------------------------------------- middleware


_REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
_TIMELINE: web.RequestKey[Timeline] = web.RequestKey("timeline", Timeline)
_KEY: web.RequestKey[KeyContext] = web.RequestKey("api_key", KeyContext)
_TICKET: web.RequestKey[Ticket] = web.RequestKey("ticket", Ticket)
_RECORDING: web.RequestKey[bool] = web.RequestKey("recording", bool)

#: Routes anyone may call (probes, scrapes, the schema); everything else needs a key.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/metrics", "/openapi.json"})
#: Routes that take an Idempotency-Key.
IDEMPOTENT_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages"})


def _is_anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def _error_response(request: web.Request, err: APIError) -> web.Response:
    rendered = (
        render_anthropic(err, request.get(_REQUEST_ID))
        if _is_anthropic(request) else render_openai(err)
    )
    headers = dict(rendered.headers)
    headers.pop("content-type", None)
    if isinstance(err, RateLimitExceeded):
        headers.update(ratelimit_headers(err.state, _is_anthropic(request)))
    return web.Response(
        status=rendered.status, body=rendered.body, headers=headers,
        content_type="application/json",
    )


@web.middleware
async def _middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """x-request-id and Server-Timing on every response, and every failure in the route's
    own error shape."""
    timeline = request[_TIMELINE] = Timeline()
    request_id = request.headers.get(REQUEST_ID_HEADER) or f"req_{uuid.uuid4().hex}"
    request[_REQUEST_ID] = request_id
    try:
        gateway = request.app[_STATE].gateway
        if gateway is None or request.path in PUBLIC_PATHS:
            response = await handler(request)
        else:
            request[_KEY] = await gateway.authenticate(request.headers, timeline)
            idem_key = request.headers.get(idempotency.HEADER)
            if idem_key is not None and request.method == "POST" and (
                request.path in IDEMPOTENT_PATHS
            ):
                response = await _idempotent(request, gateway, idem_key, handler)
            else:
                response = await handler(request)
    except APIError as err:
        response = _error_response(request, err)
    except web.HTTPRequestEntityTooLarge:
        response = _error_response(request, body_too_large(MAX_BODY_BYTES))
    except web.HTTPException as exc:
        http_err = (
            not_found(f"Unknown route {request.method} {request.path}.")
            if exc.status == 404 else APIError(exc.status, exc.reason or "error")
        )
        response = _error_response(request, http_err)
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        # Never a traceback for the client: log it here, answer in the API's shape.
        logger.exception("unhandled error in %s %s (%s)", request.method, request.path,
                         request_id)
        response = _error_response(request, internal_error())
    if not response.prepared:
        _add_headers(request, response)
    return response


def _add_headers(request: web.Request, response: web.StreamResponse) -> None:
    """x-request-id, Server-Timing and (admitted requests) the rate-limit headers."""
    response.headers[REQUEST_ID_HEADER] = request[_REQUEST_ID]
    server_timing = request[_TIMELINE].server_timing()
    if server_timing:
        response.headers["Server-Timing"] = server_timing
    ticket = request.get(_TICKET)
    if ticket is not None:
        response.headers.update(
            ratelimit_headers(ticket.admission.state, _is_anthropic(request))
        )


class _RecordingStreamResponse(web.StreamResponse):
    """A stream that keeps a copy of what it sent, for Idempotency-Key replays."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.recorded = bytearray()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self.recorded += data
        await super().write(data)


async def _idempotent(
    request: web.Request,
    gateway: Gateway,
    idem_key: str,
    handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Run `handler` once per (org, Idempotency-Key); replay its stored 2xx response."""
    org_id = request[_KEY].org_id
    store = gateway.store
    stored = await idempotency.claim(store, org_id, idem_key, await request.read())
    if stored is not None:
        headers = {**stored.headers, idempotency.REPLAYED_HEADER: "true"}
        return web.Response(status=stored.status_code or 200, body=stored.body or b"",
                            headers=headers)
    request[_RECORDING] = True
    try:
        response = await handler(request)
    except BaseException:
        # A task of its own: a cancelled handler (client gone) must still free the key.
        asyncio.get_running_loop().create_task(store.idem_release(org_id, idem_key))
        raise
    if 200 <= response.status < 300:
        body = (
            bytes(response.recorded) if isinstance(response, _RecordingStreamResponse)
            else bytes(cast(bytes, getattr(response, "body", b"")) or b"")
        )
        content_type = response.headers.get("Content-Type", "application/json")
        await store.idem_complete(org_id, idem_key, response.status,
                                  {"Content-Type": content_type}, body)
    else:
        await store.idem_release(org_id, idem_key)
    return response


async def _body(request: web.Request) -> bytes:
    state = request.app[_STATE]
    if not state.admitting:
        raise overloaded(1.0, "The server is shutting down.")
    return await request.read()


def _check_model(state: AppState, model: str) -> None:
    if model != state.model:
        raise model_not_found(model)


def _with_timings(event: BaseModel, timeline: Timeline) -> dict[str, Any]:
    """A stream's last event with the request's stage durations (ms) as `timings` — the
    Server-Timing figures the header could not hold, since it went out before decoding.
    (llama.cpp's server puts a `timings` object in its last chunk too; SDKs ignore it.)"""
    body = event.model_dump(mode="json")
    body["timings"] = timeline.timings_ms()
    return body


def _stream_failure(request: web.Request, exc: Exception) -> APIError:
    """The error event for a failure after a stream began (logged unless the API's own)."""
    if isinstance(exc, APIError):
        return exc
    logger.exception("stream of %s failed", request.get(_REQUEST_ID), exc_info=exc)
    return internal_error()


async def _send(response: web.StreamResponse, pending: list[bytes]) -> None:
    """Write the events in `pending` in one write (one syscall, one HTTP chunk) and
    empty it; nothing when it is empty."""
    if pending:
        data = b"".join(pending)
        pending.clear()
        await response.write(data)


async def _sse_response(request: web.Request) -> web.StreamResponse:
    cls = _RecordingStreamResponse if request.get(_RECORDING) else web.StreamResponse
    response = cls(headers=SSE_HEADERS)
    # A stream's Server-Timing holds the stages before its first byte; the last event has all.
    _add_headers(request, response)
    await response.prepare(request)
    return response


async def _admit(
    request: web.Request, model: str, prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
) -> None:
    """The gateway's stages 4–6 for a request of `prompts`, each with its fitted `params`
    (no-op without a gateway): scopes (the longest sequence's context), limits (reserving
    every prompt token and every token the n completions may generate), billing
    pre-check. The ticket waits in the request for `_finish`."""
    gateway = request.app[_STATE].gateway
    if gateway is None:
        return
    request[_TICKET] = await gateway.admit(
        request[_KEY], model=model, endpoint=request.path,
        request_id=f"req_{uuid.uuid4().hex}",
        prompt_tokens=sum(len(p) for p in prompts),
        max_tokens=sum((p.max_tokens or 0) * p.n for p in params),
        context_tokens=max(len(p) + (fp.max_tokens or 0)
                           for p, fp in zip(prompts, params, strict=True)),
        timeline=request[_TIMELINE],
    )


def _finish(request: web.Request, gens: Sequence[Generation]) -> None:
    """Settle the request's ticket with what its generations really used, once.

    Streams call it before their last bytes go out (non-streamed bodies are sent after
    the handler's `finally` has called it), so a response the client saw complete always
    has its ledger row in the journal, even if the gateway is killed right after.
    """
    gateway, ticket = request.app[_STATE].gateway, request.get(_TICKET)
    if gateway is None or ticket is None:
        return
    ran = [gen for gen in gens if gen.last is not None]
    usage = Usage(
        prompt_tokens=sum(len(gen.prompt) for gen in ran),
        cached_tokens=sum(gen.num_cached_tokens for gen in ran),
        output_tokens=sum(gen.last.num_output_tokens for gen in ran if gen.last is not None),
    ) if ran else None
    reasons = [reason for gen in gens for reason in gen.finish_reasons]
    if any(gen.failed for gen in gens):
        status = FAILED
    elif "abort" in reasons or None in reasons:
        status = ABORTED
    elif any(isinstance(r, str) or r in gen.params.stop_token_ids
             for gen in gens for r in gen.stop_reasons if r is not None):
        status = STOPPED  # a stop sequence or stop token of the client's ended it
    else:
        status = COMPLETED
    gateway.finish(ticket, usage, status)


# ---------------------------------------------------------------------------- OpenAI routes


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions."""
    state, timeline = request.app[_STATE], request[_TIMELINE]
    req = parse_body(so.ChatCompletionRequest, await _body(request), MAX_BODY_BYTES)
    timeline.mark("parsed")
    _check_model(state, req.model)
    messages, params = chat_request_to_engine(req, state.info.vocab_size)
    prompt = _encode(request, state.template(messages, add_generation_prompt=True))
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "messages"
    params = state.fit(len(prompt), params, param)
    return await _generate(request, req.model, prompt, params,
                           lambda gen: _chat_response(request, req, gen))


def _encode(request: web.Request, text: str) -> list[int]:
    """Tokens of the templated prompt `text` (the template stage ends as this is called)."""
    timeline = request[_TIMELINE]
    timeline.mark("templated")
    prompt = request.app[_STATE].encode_rendered(text)
    timeline.mark("tokenized")
    return prompt


def _generation(
    request: web.Request, request_id: str, prompt: list[int], params: SamplingParams
) -> Generation:
    """A generation on the replica for an admitted request: the key's org salts its
    prefix-cache blocks and its priority class orders it in the scheduler."""
    state, key = request.app[_STATE], request.get(_KEY)
    return Generation(
        state.client, state.tokenizer, request_id, prompt, params,
        timeline=request[_TIMELINE], metrics=state.metrics,
        cache_salt=key.cache_salt if key is not None else None,
        priority=key.priority if key is not None else 0,
    )


async def _generate(
    request: web.Request, model: str, prompt: list[int], params: SamplingParams,
    respond: Callable[[Generation], Awaitable[web.StreamResponse]],
) -> web.StreamResponse:
    """Admit a one-prompt request, answer it with `respond`, then settle it whatever
    happened (client gone, engine failure, refusal)."""
    await _admit(request, model, [prompt], [params])
    gen = _generation(request, request[_REQUEST_ID], prompt, params)
    try:
        return await respond(gen)
    finally:
        await gen.close()
        _finish(request, [gen])


async def _chat_response(
    request: web.Request, req: so.ChatCompletionRequest, gen: Generation
) -> web.StreamResponse:
    state, timeline, params, prompt = request.app[_STATE], gen.timeline, gen.params, gen.prompt
    await gen.start()
    token_bytes = state.tokenizer.id_to_token_bytes
    if not req.stream:
        completions = await finished_completions(gen)
        return _json(build_chat_completion(
            id=new_chat_id(), model=state.model, created=now(), completions=completions,
            prompt_tokens=len(prompt), cached_tokens=gen.num_cached_tokens,
            token_bytes=token_bytes, system_fingerprint=SYSTEM_FINGERPRINT,
        ))
    stream = ChatStream(new_chat_id(), state.model, now(), SYSTEM_FINGERPRINT, token_bytes)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    response = await _sse_response(request)
    # The role chunks go out with the first step's (already received) output.
    pending = [sse_data(chunk) for chunk in stream.role_chunks(params.n)]
    try:
        async for out in gen:
            chunks: list[Any] = list(stream.output_chunks(out))
            if out.finished and not include_usage and chunks:
                chunks[-1] = _with_timings(chunks[-1], timeline)
            pending.extend(sse_data(chunk) for chunk in chunks)
            if not out.finished and not gen.backlog:
                await _send(response, pending)
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client is gone: nothing to tell it
    except Exception as exc:
        pending.append(openai_stream_error(_stream_failure(request, exc)))
        await _send(response, pending)
        return response
    if include_usage and gen.last is not None:
        usage = stream.usage_chunk(gen.last.num_prompt_tokens, gen.last.num_output_tokens,
                                   gen.last.num_cached_tokens)
        pending.append(sse_data(_with_timings(usage, timeline)))
    pending.append(SSE_DONE)
    _finish(request, [gen])  # metered before the last byte: see _finish
    await _send(response, pending)
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions (several prompts: choice i*n+j is completion j of prompt i)."""
    state, timeline = request.app[_STATE], request[_TIMELINE]
    req = parse_body(so.CompletionRequest, await _body(request), MAX_BODY_BYTES)
    timeline.mark("parsed")
    _check_model(state, req.model)
    prompts, params = completion_request_to_engine(req, state.info.vocab_size)
    tok = state.tokenizer
    ids = [tok.encode(p, add_special_tokens=True) if isinstance(p, str) else p for p in prompts]
    timeline.mark("tokenized")
    fitted = [state.fit(len(p), params, "max_tokens") for p in ids]
    echo = [p if isinstance(p, str) else tok.decode(p) for p in prompts] if req.echo else None
    base_id = request[_REQUEST_ID]
    await _admit(request, req.model, ids, fitted)
    gens = [
        _generation(request, f"{base_id}-{i}", p, fp)
        for i, (p, fp) in enumerate(zip(ids, fitted, strict=True))
    ]
    try:
        return await _completions_response(request, req, gens, echo)
    finally:
        for gen in gens:
            await gen.close()
        _finish(request, gens)


async def _completions_response(
    request: web.Request, req: so.CompletionRequest, gens: list[Generation],
    echo: list[str] | None,
) -> web.StreamResponse:
    state, timeline, tok = request.app[_STATE], request[_TIMELINE], request.app[_STATE].tokenizer
    params = gens[0].params
    # Sent together: the replica batches them; a refusal of any refuses the request.
    await asyncio.gather(*(gen.start() for gen in gens))
    token_bytes = tok.id_to_token_bytes
    prompt_tokens = sum(len(gen.prompt) for gen in gens)
    if not req.stream:
        results = await asyncio.gather(*(finished_completions(g) for g in gens))
        return _json(build_text_completion(
            id=new_completion_id(), model=state.model, created=now(),
            completions=list(results), n=params.n, prompt_tokens=prompt_tokens,
            cached_tokens=sum(g.num_cached_tokens for g in gens), token_bytes=token_bytes,
            echo_prompts=echo, system_fingerprint=SYSTEM_FINGERPRINT,
        ))
    stream = CompletionStream(new_completion_id(), state.model, now(), params.n,
                              SYSTEM_FINGERPRINT, token_bytes)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    response = await _sse_response(request)
    pending = [sse_data(chunk) for i, text in enumerate(echo or [])
               for chunk in stream.echo_chunks(i, text)]
    unfinished = len(gens)
    try:
        # Every prompt streams at once; choice indexes tell them apart.
        async for i, out in merged(gens):
            chunks: list[Any] = [c for d in out.deltas for c in stream.delta_chunks(d, i)]
            unfinished -= out.finished
            if not unfinished and not include_usage and chunks:
                chunks[-1] = _with_timings(chunks[-1], timeline)
            pending.extend(sse_data(chunk) for chunk in chunks)
            if unfinished and not any(gen.backlog for gen in gens):
                await _send(response, pending)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        pending.append(openai_stream_error(_stream_failure(request, exc)))
        await _send(response, pending)
        return response
    if include_usage:
        output_tokens = sum(g.last.num_output_tokens for g in gens if g.last is not None)
        usage = stream.usage_chunk(prompt_tokens, output_tokens,
                                   sum(g.num_cached_tokens for g in gens))
        pending.append(sse_data(_with_timings(usage, timeline)))
    pending.append(SSE_DONE)
    _finish(request, gens)  # metered before the last byte: see _finish
    await _send(response, pending)
    return response


async def models(request: web.Request) -> web.Response:
    """GET /v1/models: the replica's model."""
    state = request.app[_STATE]
    return _json(build_model_list([(state.model, state.created, "tokenyard")]))


# ---------------------------------------------------------------------------- Anthropic routes


async def messages(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    state, timeline = request.app[_STATE], request[_TIMELINE]
    req = parse_body(sa.MessagesRequest, await _body(request), MAX_BODY_BYTES)
    timeline.mark("parsed")
    _check_model(state, req.model)
    template_messages, params = anthropic_request_to_engine(req)
    prompt = _encode(request, state.template_with_prefill(template_messages))
    params = state.fit(len(prompt), params, "max_tokens")
    return await _generate(request, req.model, prompt, params,
                           lambda gen: _messages_response(request, req, gen))


async def _messages_response(
    request: web.Request, req: sa.MessagesRequest, gen: Generation
) -> web.StreamResponse:
    state, timeline, prompt = request.app[_STATE], gen.timeline, gen.prompt
    await gen.start()
    stops = req.stop_sequences or []
    if not req.stream:
        completions = await finished_completions(gen)
        return _json(build_anthropic_message(
            id=new_message_id(), model=state.model, completion=completions[0],
            prompt_tokens=len(prompt), cached_tokens=gen.num_cached_tokens,
            stop_sequences=stops,
        ))
    stream = AnthropicStream(new_message_id(), state.model, stops)
    response = await _sse_response(request)
    # The first delta is already in: the cached-token count is known for message_start.
    started = False
    pending: list[bytes] = []
    try:
        async for out in gen:
            if not started:
                started = True
                pending.extend(anthropic_event(event) for event in stream.start_events(
                    out.num_prompt_tokens, out.num_cached_tokens))
            for event in stream.output_events(out):
                if isinstance(event, MessageStopEvent):
                    pending.append(sse_event(event.type, _with_timings(event, timeline)))
                else:
                    pending.append(anthropic_event(event))
            if not out.finished and not gen.backlog:
                await _send(response, pending)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:
        pending.append(anthropic_stream_error(_stream_failure(request, exc),
                                              request[_REQUEST_ID]))
    _finish(request, [gen])  # metered before the last byte: see _finish
    await _send(response, pending)
    return response


async def count_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens: the templated prompt's length."""
    state, timeline = request.app[_STATE], request[_TIMELINE]
    req = parse_body(sa.CountTokensRequest, await _body(request), MAX_BODY_BYTES)
    timeline.mark("parsed")
    _check_model(state, req.model)
    prompt = _encode(request, state.template_with_prefill(anthropic_messages(req)))
    return _json(sa.CountTokensResponse(input_tokens=len(prompt)))


# ---------------------------------------------------------------------------- operations


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: this process is up."""
    return _json({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text; the engine's figures are read from the replica."""
    state = request.app[_STATE]
    state.metrics.update_from_stats(await state.client.stats())
    return web.Response(
        body=state.metrics.render().encode(), headers={"Content-Type": METRICS_CONTENT_TYPE}
    )


async def readyz(request: web.Request) -> web.Response:
    """GET /readyz: 200 only while admitting and the replica is healthy."""
    state = request.app[_STATE]
    ready = state.admitting and await state.client.health()
    return _json({"status": "ready" if ready else "unavailable"}, 200 if ready else 503)


_SCHEMA_MODELS: Sequence[type[BaseModel]] = (
    so.ChatCompletionRequest, so.ChatCompletion, so.ChatCompletionChunk,
    so.CompletionRequest, so.TextCompletion, so.ModelList,
    sa.MessagesRequest, sa.AnthropicMessage, sa.CountTokensRequest, sa.CountTokensResponse,
)

_ROUTES_DOC: Sequence[tuple[str, str, str | None, str]] = (
    ("/v1/chat/completions", "post", "ChatCompletionRequest", "ChatCompletion"),
    ("/v1/completions", "post", "CompletionRequest", "TextCompletion"),
    ("/v1/models", "get", None, "ModelList"),
    ("/v1/messages", "post", "MessagesRequest", "AnthropicMessage"),
    ("/v1/messages/count_tokens", "post", "CountTokensRequest", "CountTokensResponse"),
)


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 document, built from the pydantic models' JSON schemas."""
    schemas: dict[str, Any] = {}
    for model in _SCHEMA_MODELS:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        # Nested models move up to components, where the $refs point.
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    paths: dict[str, Any] = {}
    for path, method, request_name, response_name in _ROUTES_DOC:
        op: dict[str, Any] = {"responses": {"200": {
            "description": "OK",
            "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{response_name}"}
            }},
        }}}
        if request_name is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{request_name}"}
            }}}
        paths[path] = {method: op}
    return {
        "openapi": "3.1.0",
        "info": {"title": "tokenyard", "version": "0.1"},
        "paths": paths,
        "components": {"schemas": schemas},
    }


async def openapi(request: web.Request) -> web.Response:
    """GET /openapi.json."""
    return _json(openapi_document())


def _json(obj: Any, status: int = 200) -> web.Response:
    body = (
        obj.__pydantic_serializer__.to_json(obj) if isinstance(obj, BaseModel)
        else json.dumps(obj, separators=(",", ":")).encode("utf-8")
    )
    return web.Response(body=body, status=status, content_type="application/json")


# ---------------------------------------------------------------------------- app


async def build_state(
    replica_url: str, model: str | None, cache_dir: Path, *, replica_token: str | None = None
) -> AppState:
    """Ask the replica for its model, and load the matching tokenizer (in a thread: a
    GGUF read takes seconds and the loop may already serve other things).
    `replica_token`: the replica's shared secret (TOKENYARD_REPLICA_TOKEN)."""
    client = ReplicaClient(replica_url, token=replica_token)
    try:
        info = await client.info()
    except BaseException:
        await client.close()
        raise
    tokenizer = await asyncio.to_thread(load_tokenizer, model, cache_dir)
    if tokenizer.vocab_size > info.vocab_size:
        # A replica serving another model than `model` would get ids it cannot embed.
        await client.close()
        raise ValueError(
            f"the tokenizer of {model or 'the embedded model'} has {tokenizer.vocab_size} "
            f"tokens but the replica's model {info.model} only {info.vocab_size}: pass the "
            "replica's --model"
        )
    return AppState(client, tokenizer, info, now())


def _admin_of(request: web.Request) -> Admin:
    """The administrative operations, for an authenticated key with the admin scope."""
    gateway = request.app[_STATE].gateway
    if gateway is None:
        raise not_found("Administration needs the gateway: this server runs with --no-auth.")
    require_admin(request[_KEY])
    return Admin(gateway.store)


def make_app(state: AppState) -> web.Application:
    """The aiohttp application over `state`."""
    # aiohttp's own cap sits just above ours, so an oversized body is refused while
    # reading it, and parse_body's check gives the same 413 for the rest.
    app = web.Application(middlewares=[_middleware], client_max_size=MAX_BODY_BYTES)
    app[_STATE] = state
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/metrics", metrics)
    add_admin_routes(app, _admin_of)

    async def close_client(app: web.Application) -> None:
        await app[_STATE].client.close()

    app.on_cleanup.append(close_client)
    return app
