"""`tokenyard chat`: a terminal chat client over ``/v1/chat/completions`` (streamed).

`ChatSession` is the testable core: it keeps the conversation, sends it with ``stream=true``
over one pooled aiohttp session, calls `on_delta` with each piece of text as it arrives, and
retries what is worth retrying (connection errors, 408, 409, 429, 5xx) with exponential
backoff and full jitter, honouring ``retry-after`` and, as the official SDKs do, the
server's ``x-should-retry`` (``true``: retry whatever the status; ``false``: never, e.g. an
out-of-credit 429). Every attempt of one message carries the same ``Idempotency-Key``, so
a gateway that ran an attempt whose answer was lost replays it instead of running (and
billing) it again. `run_repl` is a thin terminal layer over it.

Input is naturally locked while a reply streams: the REPL reads the next line only after
`send` returns. Ctrl-C during a reply cancels the task that streams it (closing the
response); Ctrl-C or EOF at the prompt leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sys
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TextIO, TypeVar

import aiohttp

from tokenyard.api.sse import SSEParser

#: Statuses retried from 500 up (server-side failures a later attempt may not see), and
#: below it (timeout, conflict: an attempt still running, rate limited), as the SDKs do.
_RETRY_STATUS_MIN = 500
_RETRY_STATUSES = frozenset({408, 409, 429})
#: The server's word on retrying, which overrides the status (OpenAI's and Anthropic's).
SHOULD_RETRY = "x-should-retry"
IDEMPOTENCY_KEY = "Idempotency-Key"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt k waits uniform(0, min(cap, base·2^k)) s.

    `max_attempts` counts the first try. A ``retry-after`` header (seconds) replaces the
    computed delay, bounded by `max_retry_after` so a confused server cannot park the client.
    """

    base: float = 0.5
    cap: float = 8.0
    max_attempts: int = 5
    max_retry_after: float = 60.0

    def delay(self, retry: int, rand: float, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based); `rand` is uniform in [0, 1)."""
        if retry_after is not None:
            return min(max(0.0, retry_after), self.max_retry_after)
        return rand * min(self.cap, self.base * 2**retry)


class ChatError(Exception):
    """A reply that failed: the HTTP status (None for connection errors) and the message."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class _Retryable(Exception):
    """A failed attempt worth repeating, with the server's ``retry-after`` if it sent one."""

    def __init__(self, message: str, status: int | None, retry_after: float | None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.retry_after = retry_after


def _parse_retry_after(value: str | None) -> float | None:
    # Only the delta-seconds form; an HTTP-date falls back to computed backoff.
    if value is None:
        return None
    try:
        return float(value.strip())
    except ValueError:
        return None


def _error_message(body: bytes, status: int) -> str:
    """The API's own error message from an OpenAI- or Anthropic-shaped body, else the body."""
    text = body.decode("utf-8", errors="replace").strip()
    try:
        payload = json.loads(text)
    except ValueError:
        return text or f"HTTP {status}"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return text or f"HTTP {status}"


T = TypeVar("T")
OnDelta = Callable[[str], None]
Sleep = Callable[[float], Awaitable[Any]]


class ChatSession:
    """One conversation with an OpenAI-compatible server.

    `messages` is the conversation sent with each turn: the system message (if any) first,
    then user and assistant turns. One `aiohttp.ClientSession` (so one connection pool)
    serves every request; pass `http` to share one, else it is created on first use and
    closed by `close`. `sleep` and `rand` are injectable so backoff can be tested.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str | None = None,
        *,
        api_key: str | None = None,
        system: str | None = None,
        temperature: float | None = None,
        max_tokens: int | None = None,
        retry: RetryPolicy | None = None,
        http: aiohttp.ClientSession | None = None,
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.retry = retry or RetryPolicy()
        self.system: str | None = system
        self.turns: list[dict[str, str]] = []
        #: The finish reason of the last completed reply ("stop", "length", …).
        self.last_finish_reason: str | None = None
        self._http = http
        self._owns_http = http is None
        self._sleep = sleep
        self._rand = rand

    # ---------------------------------------------------------------- conversation

    @property
    def messages(self) -> list[dict[str, str]]:
        """The messages sent with the next turn (system first, if set)."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.turns]

    def reset(self) -> None:
        """Forget the user and assistant turns; keep the system message."""
        self.turns.clear()

    def set_system(self, text: str | None) -> None:
        """Set (or with None / empty text, remove) the system message."""
        self.system = text or None

    # ---------------------------------------------------------------- HTTP

    @property
    def http(self) -> aiohttp.ClientSession:
        """The pooled HTTP session (created on first use, inside the running loop)."""
        if self._http is None:
            # sock_read bounds a stalled stream; total is unbounded since replies stream long.
            timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=300)
            self._http = aiohttp.ClientSession(timeout=timeout)
        return self._http

    def _headers(self) -> dict[str, str]:
        headers = {"accept": "text/event-stream"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        return headers

    async def close(self) -> None:
        """Close the HTTP session if this object created it."""
        if self._owns_http and self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> ChatSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _with_retries(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """Run `attempt` until it succeeds, it fails for good, or the attempts run out."""
        retries = 0
        while True:
            try:
                return await attempt()
            except _Retryable as exc:
                if retries + 1 >= self.retry.max_attempts:
                    raise ChatError(
                        f"{exc.message} (gave up after {retries + 1} attempts)", exc.status
                    ) from exc
                await self._sleep(self.retry.delay(retries, self._rand(), exc.retry_after))
                retries += 1

    async def _check(self, response: aiohttp.ClientResponse) -> None:
        """Raise for a non-2xx response: `_Retryable` when the server's `x-should-retry`
        says "true" or, without it, for 408, 409, 429 and 5xx; else `ChatError`."""
        if response.status < 400:
            return
        message = _error_message(await response.read(), response.status)
        should = response.headers.get(SHOULD_RETRY, "").strip().lower()
        retry = should == "true" or (should != "false" and (
            response.status in _RETRY_STATUSES or response.status >= _RETRY_STATUS_MIN))
        if retry:
            retry_after = _parse_retry_after(response.headers.get("retry-after"))
            raise _Retryable(f"HTTP {response.status}: {message}", response.status, retry_after)
        raise ChatError(message, response.status)

    async def resolve_model(self) -> str:
        """The model to ask: the one given, else the first the server lists."""
        if self.model is not None:
            return self.model

        async def attempt() -> str:
            try:
                async with self.http.get(
                    f"{self.base_url}/models", headers=self._headers()
                ) as response:
                    await self._check(response)
                    payload = await response.json()
            except aiohttp.ClientError as exc:
                raise _Retryable(f"connection error: {exc}", None, None) from exc
            models = payload.get("data") or []
            if not models:
                raise ChatError("the server lists no models")
            return str(models[0]["id"])

        self.model = await self._with_retries(attempt)
        return self.model

    async def send(self, user_text: str, on_delta: OnDelta) -> str:
        """Send `user_text` as the next turn; stream the reply to `on_delta`; return it whole.

        On success both turns join the conversation. On an error nothing does (so the user
        can resend). If cancelled mid-reply, the part already shown joins the conversation.
        Raises `ChatError` (HTTP errors, exhausted retries) and `ValueError` (empty input).
        """
        if not user_text.strip():
            raise ValueError("empty message")
        model = await self.resolve_model()
        user = {"role": "user", "content": user_text}
        body: dict[str, Any] = {"model": model, "messages": [*self.messages, user],
                                "stream": True}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        parts: list[str] = []
        key = f"tokenyard-chat-{uuid.uuid4().hex}"  # one per message, sent on every attempt
        try:
            finish = await self._with_retries(
                lambda: self._stream_once(body, parts, on_delta, key))
        except asyncio.CancelledError:
            if parts:  # what the user saw stays in the conversation
                self.turns += [user, {"role": "assistant", "content": "".join(parts)}]
            raise
        reply = "".join(parts)
        self.turns += [user, {"role": "assistant", "content": reply}]
        self.last_finish_reason = finish
        return reply

    async def _stream_once(
        self, body: dict[str, Any], parts: list[str], on_delta: OnDelta, key: str
    ) -> str | None:
        """One attempt: POST (with the message's Idempotency-Key `key`), parse the SSE
        stream, feed deltas. Returns the finish reason."""
        finish: str | None = None
        try:
            async with self.http.post(
                f"{self.base_url}/chat/completions", json=body,
                headers={**self._headers(), IDEMPOTENCY_KEY: key},
            ) as response:
                await self._check(response)
                parser = SSEParser()
                async for chunk in response.content.iter_any():
                    for event in parser.feed(chunk):
                        if event.is_done:
                            return finish
                        try:
                            payload = event.json()
                        except ValueError:
                            continue  # not JSON: nothing a chat client can show
                        finish = self._handle_event(payload, parts, on_delta) or finish
        except aiohttp.ClientError as exc:
            if parts:  # text already shown: a retry would repeat it
                raise ChatError(f"connection lost mid-reply: {exc}") from exc
            raise _Retryable(f"connection error: {exc}", None, None) from exc
        if not parts and finish is None:
            raise _Retryable("the stream ended before any reply", None, None)
        return finish

    @staticmethod
    def _handle_event(payload: Any, parts: list[str], on_delta: OnDelta) -> str | None:
        """Feed one chunk's content to `on_delta`; return its finish reason, if any."""
        if not isinstance(payload, dict):
            return None
        if "error" in payload:  # an error after the stream began (OpenAI's SSE shape)
            error = payload["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise ChatError(str(message or "error in stream"))
        finish: str | None = None
        for choice in payload.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            content = (choice.get("delta") or {}).get("content")
            if content:
                parts.append(content)
                on_delta(content)
            finish = choice.get("finish_reason") or finish
        return finish


# -------------------------------------------------------------------- the terminal layer

HELP = "Commands: /reset (clear the conversation), /system TEXT (set the system message), " \
    "/exit. Ctrl-C stops a reply; Ctrl-C or Ctrl-D at the prompt leaves."


def _run_interruptible(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, str]
) -> str | None:
    """Run `coro` until done; Ctrl-C cancels it (closing its stream) and returns None."""
    task = loop.create_task(coro)
    handler_installed = False
    with contextlib.suppress(NotImplementedError, RuntimeError):
        loop.add_signal_handler(signal.SIGINT, task.cancel)
        handler_installed = True
    try:
        return loop.run_until_complete(task)
    except KeyboardInterrupt:  # no signal handler support (Windows): cancel by hand
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            loop.run_until_complete(task)
        return None
    except asyncio.CancelledError:
        return None
    finally:
        if handler_installed:
            loop.remove_signal_handler(signal.SIGINT)


def run_repl(
    session: ChatSession,
    read_line: Callable[[str], str] = input,
    out: TextIO = sys.stdout,
) -> int:
    """The interactive loop. Reads lines with `read_line` (blocking: nothing else runs at the
    prompt), so the next line is read only once the reply finished. Returns the exit status.
    """
    loop = asyncio.new_event_loop()
    try:
        print(HELP, file=out)
        try:  # say where the conversation goes; a server not up yet is retried at send
            model = _run_interruptible(loop, session.resolve_model())
            print(f"[{session.base_url}, model {model}]", file=out)
        except ChatError as exc:
            print(f"[{session.base_url}: {exc.message}]", file=out)
        while True:
            try:
                line = read_line("> ")
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            text = line.strip()
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.reset()
                print("[conversation cleared]", file=out)
                continue
            if text == "/system" or text.startswith("/system "):
                session.set_system(text[len("/system"):].strip())
                print(f"[system message {'set' if session.system else 'removed'}]", file=out)
                continue
            if not text:
                print("[empty message: type something, or Ctrl-D to leave]", file=out)
                continue

            def show(delta: str) -> None:
                out.write(delta)
                out.flush()

            try:
                reply = _run_interruptible(loop, session.send(line, show))
            except ChatError as exc:
                status = f" ({exc.status})" if exc.status else ""
                print(f"\n[error{status}: {exc.message}]", file=out)
                continue
            if reply is None:
                print("\n[stopped]", file=out)
            else:
                tail = " [cut at max tokens]" if session.last_finish_reason == "length" else ""
                print(tail, file=out)
    finally:
        loop.run_until_complete(session.close())
        loop.close()


def main(
    base_url: str,
    model: str | None = None,
    api_key: str | None = None,
    system: str | None = None,
    temperature: float | None = None,
    max_tokens: int | None = None,
) -> int:
    """Entry point of ``tokenyard chat``."""
    session = ChatSession(base_url, model, api_key=api_key, system=system,
                          temperature=temperature, max_tokens=max_tokens)
    return run_repl(session)
