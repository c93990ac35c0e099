"""The mock replica's OpenAI-compatible routes: ``/v1/chat/completions``,
``/v1/completions`` (streamed or not) and ``/v1/models``, on the mock's clock.

Like vLLM with prefix caching, it remembers the prompts it saw in blocks of
`PREFIX_BLOCK` words, one memory per `cache_salt` (and one shared by every request
without a salt), and reports the words of a prompt's leading blocks seen before as
``usage.prompt_tokens_details.cached_tokens``. It records what each request brought
(`received`: its path, Authorization header and body), so a test can check what a
gateway in front sent it.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from tokenyard.api.errors import render_openai
from tokenyard.api.sse import SSE_DONE, SSE_HEADERS, openai_stream_error, sse_data
from tokenyard.bench.mock_core import (
    MOCK_MODEL,
    MOCK_TOKENS,
    RATE_LIMITED,
    MockBase,
    MockConfig,
    _json,
    _Run,
)
from tokenyard.errors import APIError

#: Words per block of the mock's prefix cache (vLLM's default block is 16 tokens).
PREFIX_BLOCK = 16
#: Block hashes remembered per salt before that memory starts again empty.
_PREFIX_MEMORY = 100_000
#: Requests `received` keeps (the latest).
_RECEIVED = 10_000


@dataclass(frozen=True)
class Received:
    """One request as the mock got it."""

    path: str
    authorization: str | None
    body: dict[str, Any] | None


class OpenAIRoutes(MockBase):
    """The OpenAI dialect's handlers, over the mock's shared state."""

    def __init__(self, config: MockConfig, seed: int = 0) -> None:
        super().__init__(config, seed)
        #: The latest requests to the OpenAI routes, oldest first.
        self.received: deque[Received] = deque(maxlen=_RECEIVED)
        self._prefixes: dict[str | None, set[int]] = {}

    def _receive(self, http: web.Request, body: dict[str, Any] | None) -> None:
        self.received.append(Received(http.path, http.headers.get("Authorization"), body))

    def _cached_words(self, salt: str | None, words: list[str]) -> int:
        """Words of `words`' leading full blocks seen before under `salt` (never the
        last word: as in vLLM, at least one prompt token is computed); remembers them."""
        seen = self._prefixes.setdefault(salt, set())
        if len(seen) > _PREFIX_MEMORY:
            seen.clear()
        chain, hit, hitting = hash(salt), 0, True
        for end in range(PREFIX_BLOCK, len(words), PREFIX_BLOCK):
            chain = hash((chain, *words[end - PREFIX_BLOCK:end]))
            if hitting and chain in seen:
                hit = end
            else:
                hitting = False
                seen.add(chain)
        return hit

    # -- OpenAI-compatible -------------------------------------------------------------------
    async def models(self, http: web.Request) -> web.Response:
        """``GET /v1/models``: the one mock model."""
        self._receive(http, None)
        return _json({"object": "list", "data": [
            {"id": MOCK_MODEL, "object": "model", "created": 0, "owned_by": "tokenyard"}]})

    async def chat_completions(self, http: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions`` with the replica's timing; prompt tokens are
        counted as whitespace-separated words."""
        return await self._openai(http, chat=True)

    async def completions(self, http: web.Request) -> web.StreamResponse:
        """``POST /v1/completions`` (a text prompt), as the chat route."""
        return await self._openai(http, chat=False)

    async def _openai(self, http: web.Request, *, chat: bool) -> web.StreamResponse:
        """One OpenAI-compatible answer. A stream is tracked in `running` (the stats'
        num_running) until it ends or its client leaves. Injected 429/503 carry
        retry-after and retry-after-ms; a max_tokens below 1 is refused naming it."""
        try:
            body = json.loads(await http.read())
            self._receive(http, body if isinstance(body, dict) else None)
            if chat:
                words = [w for m in body["messages"] for w in str(m.get("content", "")).split()]
            else:
                words = str(body["prompt"]).split()
            prompt_tokens = len(words)
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
            salt = body.get("cache_salt")
            if salt is not None and (not isinstance(salt, str) or not salt):
                raise ValueError("cache_salt must be a non-empty string")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            return _openai_error(APIError(400, f"invalid request: {exc!r}",
                                          param="messages" if chat else "prompt"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return _openai_error(APIError(400, "max_tokens must be at least 1",
                                          param="max_tokens", code="invalid_value"))
        status = self._injected_status()
        if status is not None:
            retry = {"retry-after": "1", "retry-after-ms": "250"} if status != 500 else None
            return _openai_error(APIError(status, "injected failure", headers=retry,
                                          code=RATE_LIMITED if status == 429 else None))
        n, finish = self._length(max_tokens, bool(body.get("ignore_eos")))
        prefix, kind = ("chatcmpl", "chat.completion") if chat else ("cmpl", "text_completion")
        chat_id, created = f"{prefix}-{uuid.uuid4().hex[:24]}", int(time.time())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                 "total_tokens": prompt_tokens + n,
                 "prompt_tokens_details": {"cached_tokens": self._cached_words(salt, words)}}
        run = _Run()
        if not body.get("stream"):
            async for _ in self._ticks(n, run):
                pass
            text = "".join(MOCK_TOKENS[i % len(MOCK_TOKENS)][1] for i in range(n))
            answer = {"message": {"role": "assistant", "content": text}} if chat else {
                "text": text}
            return _json({
                "id": chat_id, "object": kind, "created": created,
                "model": MOCK_MODEL, "usage": usage,
                "choices": [{"index": 0, "finish_reason": finish, **answer}],
            })
        fail_after = max(1, n // 2) if self._fails_mid_stream() else None
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def chunk(text: str | None, finish_reason: str | None = None) -> bytes:
            if chat:
                delta = ({"role": "assistant", "content": ""} if text is None
                         else {"content": text} if text else {})
                choice: dict[str, Any] = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text or ""}
            return sse_data({
                "id": chat_id, "object": kind + ".chunk" if chat else kind,
                "created": created, "model": MOCK_MODEL,
                "choices": [{**choice, "finish_reason": finish_reason}],
            })

        response = web.StreamResponse(headers=SSE_HEADERS)
        self.running[chat_id] = run
        try:
            with contextlib.suppress(ConnectionResetError):
                await response.prepare(http)
                if chat:
                    await response.write(chunk(None))
                async for i in self._ticks(n, run):
                    if i == fail_after:
                        break
                    await response.write(chunk(MOCK_TOKENS[i % len(MOCK_TOKENS)][1]))
                if fail_after is not None:
                    await response.write(openai_stream_error(APIError(500, "injected failure")))
                    await response.write_eof()
                    return response
                await response.write(chunk("", finish))
                if include_usage:
                    await response.write(sse_data({
                        "id": chat_id, "object": kind + ".chunk" if chat else kind,
                        "created": created, "model": MOCK_MODEL, "choices": [],
                        "usage": usage}))
                await response.write(SSE_DONE)
                await response.write_eof()
        finally:
            self.running.pop(chat_id, None)
        return response


def _openai_error(err: APIError) -> web.Response:
    rendered = render_openai(err)
    headers = {k: v for k, v in rendered.headers.items() if k != "content-type"}
    return web.Response(body=rendered.body, status=rendered.status, headers=headers,
                        content_type="application/json")
