"""The mock replica's OpenAI-compatible routes: ``/v1/chat/completions``,
``/v1/completions`` (streamed or not) and ``/v1/models``, on the mock's clock.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Any

from aiohttp import web

from tokenyard.api.errors import render_openai
from tokenyard.api.sse import SSE_DONE, SSE_HEADERS, openai_stream_error, sse_data
from tokenyard.bench.mock_core import (
    MOCK_MODEL,
    MOCK_TOKENS,
    RATE_LIMITED,
    MockBase,
    _json,
    _Run,
)
from tokenyard.errors import APIError


class OpenAIRoutes(MockBase):
    """The OpenAI dialect's handlers, over the mock's shared state."""

    # -- OpenAI-compatible -------------------------------------------------------------------
    async def models(self, http: web.Request) -> web.Response:
        """``GET /v1/models``: the one mock model."""
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
            if chat:
                prompt_tokens = sum(len(str(m.get("content", "")).split())
                                    for m in body["messages"])
            else:
                prompt_tokens = len(str(body["prompt"]).split())
            max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
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
                 "total_tokens": prompt_tokens + n}
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
