"""External OpenAI-compatible upstreams: vLLM, SGLang, llama.cpp's llama-server, another
tokenyard. Text in, text out.

`UpstreamClient` speaks the upstream's streamed ``/chat/completions`` and ``/completions``
over one pooled aiohttp session and maps its refusals to the replica errors of
`replica_client` (429/503 → overloaded, 401/403 → unauthorized, other 4xx → the request's
fault, 5xx and connection failures → unreachable, so a balancer may fail over; a 429
for a request with a fallback to go to → rate limited, which the balancer does not queue).
`upstream_generation.UpstreamGeneration` runs one API request on it.

An upstream is someone else's server: nothing it says that could name our network or
our account (its URL, its error texts, a connection's exception) goes into an error a
tenant sees — those say which deployment failed, and the details go to the log. A body's
`cache_salt` (the tenant's) is sent, as a digest, only to a server that keeps a prefix
cache per salt (`salts_cache`); any other server's cache is shared by all our tenants,
so the cached tokens it reports are zeroed before anyone counts them.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from typing import Any

import aiohttp

from tokenyard.balancer.http_client import PooledClient
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaError,
    ReplicaOverloaded,
    ReplicaRateLimited,
    ReplicaRequestError,
    ReplicaStreamError,
    ReplicaUnauthorized,
)

logger = logging.getLogger("tokenyard.balancer")

CHAT_PATH = "/chat/completions"
COMPLETIONS_PATH = "/completions"
MODELS_PATH = "/models"
#: The stream error code of an upstream stream that broke off or ended unfinished.
STREAM_BROKEN = "upstream_stream_broken"
#: The stream error code of an upstream that sent an error event mid-stream.
STREAM_FAILED = "upstream_error"
#: The body field of the tenant's prefix-cache salt (vLLM's and SGLang's name).
CACHE_SALT = "cache_salt"
#: A body field of ours, never sent: False when the request does not queue for an
#: upstream's 429 (it has a fallback to go to: `ReplicaRateLimited`).
QUEUES = "tokenyard_queues"

Chunk = dict[str, Any]


# ---------------------------------------------------------------------------- the client


class UpstreamClient(PooledClient):
    """One OpenAI-compatible server, `base_url` including its ``/v1``.

    The aiohttp session is created on first use, in the running event loop, and pools
    connections (each open stream holds one); `close` it when done.
    """

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str,
        deployment: str | None = None,
        salts_cache: bool = False,
        connect_timeout: float = 5.0,
        request_timeout: float = 60.0,
        max_connections: int = 0,
    ) -> None:
        """`model`: this server's own name of the model, put in every body (servers of
        one deployment may name it differently). `deployment`: our name of it, the one
        errors a tenant sees give. `salts_cache`: the server keeps a prefix cache per
        `cache_salt` (vLLM, SGLang); otherwise a body's salt is not sent and the cached
        tokens it reports for a salted request read 0. `request_timeout` bounds a health
        check, the wait for a stream's answer and any silence between two of its chunks;
        a stream has no total timeout. `api_key` is sent as a bearer token (none: no
        Authorization header). `max_connections` 0 means unbounded."""
        super().__init__(base_url, connect_timeout=connect_timeout,
                         request_timeout=request_timeout, read_timeout=request_timeout,
                         max_connections=max_connections)
        self.model = model
        self.deployment = deployment
        self.salts_cache = salts_cache
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._headers = {"Accept": "application/json", **auth}
        self._stream_headers = {"Content-Type": "application/json",
                                "Accept": "text/event-stream", **auth}

    def open_chat(self, body: Mapping[str, Any]) -> AsyncIterator[Chunk]:
        """``POST /chat/completions`` streamed: the upstream's chunks (usage included)
        until ``[DONE]``. See `_open` for the errors."""
        return self._open(CHAT_PATH, body)

    def open_completion(self, body: Mapping[str, Any]) -> AsyncIterator[Chunk]:
        """``POST /completions`` streamed (a text prompt), as `open_chat`."""
        return self._open(COMPLETIONS_PATH, body)

    async def _open(self, path: str, body: Mapping[str, Any]) -> AsyncGenerator[Chunk, None]:
        """The stream's chunks. The first `__anext__` sends the request and waits for the
        first chunk, so refusals surface before the caller writes anything: before it,
        ReplicaOverloaded (429, 503), ReplicaUnauthorized (401, 403), ReplicaRequestError
        (other 4xx), ReplicaConnectionError (5xx, unreachable, silent); after it,
        ReplicaStreamError (an error event, a broken or unfinished stream). Closing the
        iterator early closes the connection, which is how the upstream learns to abort."""
        url = self.base_url + path
        options = {**(body.get("stream_options") or {}), "include_usage": True}
        payload = {**body, "model": self.model, "stream": True, "stream_options": options}
        salt = payload.pop(CACHE_SALT, None)
        queues = payload.pop(QUEUES, True)
        if salt is not None and self.salts_cache:
            payload[CACHE_SALT] = upstream_salt(salt)
        # One cache shared by every tenant: its hits are some other tenant's prompt.
        hide_cached = salt is not None and not self.salts_cache
        try:
            response = await self._get_session().post(
                url, data=json.dumps(payload, ensure_ascii=False).encode(),
                headers=self._stream_headers,
            )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaConnectionError(f"{url}: {exc!r}") from exc
        started = ended = done = False
        self._streams.add(response)
        try:
            if response.status != 200:
                message, param, code, structured = _error_of(
                    await response.text(errors="replace"))
                raise _refusal(response.status, (message, param, code), response.headers,
                               url, self._name, structured=structured, queues=queues)
            async for data in _sse_data(response.content):
                if data == "[DONE]":
                    done = True
                    return
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    raise ValueError(f"an event is not a JSON object: {data[:200]}")
                error = chunk.get("error")
                if error is not None:
                    message, param, code = _error_fields(error)
                    if not started:
                        raise _refusal(_status_of(error), (message, param, code), {}, url,
                                       self._name, queues=queues)
                    logger.warning("upstream %s failed a stream: %s (%s)", url, message,
                                   code, extra={"event": "upstream_stream_error",
                                                "deployment": self.deployment})
                    raise ReplicaStreamError(f"{self._name} failed while answering",
                                             STREAM_FAILED)
                started = True
                usage = chunk.get("usage")
                if hide_cached and isinstance(usage, dict):
                    _hide_cached(usage)
                ended = ended or usage is not None or any(
                    isinstance(c, dict) and c.get("finish_reason")
                    for c in chunk.get("choices") or ())
                yield chunk
            if not ended:  # no [DONE] and no end seen: cut off
                raise ValueError("the stream ended before it finished")
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            if started:
                logger.warning("upstream %s broke off a stream: %r", url, exc, extra={
                    "event": "upstream_stream_broken", "deployment": self.deployment})
                raise ReplicaStreamError(f"{self._name} broke off its answer",
                                         STREAM_BROKEN) from exc
            raise ReplicaConnectionError(f"{url}: {exc!r}") from exc
        finally:
            self._streams.discard(response)
            if done:
                # Read the stream's end, so its connection goes back to the pool.
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    await response.read()
                response.release()
            else:
                # Closing (not releasing) the connection tells the upstream nobody reads.
                response.close()

    async def health(self) -> bool:
        """True if the upstream answers ``GET /models`` with 200."""
        return await self._probe(MODELS_PATH, self._headers)

    @property
    def _name(self) -> str:
        """How a tenant-visible error names this server: by our deployment's name."""
        return (f"the upstream deployment {self.deployment}" if self.deployment
                else "the upstream")


def upstream_salt(salt: str) -> str:
    """The `cache_salt` an upstream is sent for a tenant's salt: a digest, one per
    tenant as the salt is, that does not tell the upstream our organisations' ids."""
    return hashlib.sha256(b"tokenyard cache salt\0" + salt.encode()).hexdigest()[:32]


def _hide_cached(usage: dict[str, Any]) -> None:
    """Zero the prompt's cached-token counts of a usage object (OpenAI's
    ``prompt_tokens_details.cached_tokens`` and the older top-level ``cached_tokens``)."""
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and "cached_tokens" in details:
        details["cached_tokens"] = 0
    if "cached_tokens" in usage:
        usage["cached_tokens"] = 0


async def _sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The `data` of each event of an event stream (several data lines joined with a line
    feed); event names, ids and comments are ignored, as OpenAI's streams need none."""
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def _error_fields(error: Any) -> tuple[str, str | None, str | None]:
    """(message, param, code) of an error object: OpenAI's ``{"message", "param",
    "code", "type"}``, or a bare message."""
    if not isinstance(error, dict):
        return str(error)[:500], None, None
    param, code = error.get("param"), error.get("code")
    return (str(error.get("message") or error.get("type") or "unknown error"),
            param if isinstance(param, str) else None, code if isinstance(code, str) else None)


def _error_of(text: str) -> tuple[str, str | None, str | None, bool]:
    """(message, param, code, structured) of an error body: ``{"error": {...}}`` (OpenAI,
    llama-server, vLLM), the fields at the top (older vLLM), or plain text (a proxy's
    page: not structured)."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:500] or "no message", None, None, False
    if isinstance(body, dict) and "error" in body:
        return (*_error_fields(body["error"]), True)
    return (*_error_fields(body), isinstance(body, dict))


def _status_of(error: Any) -> int:
    """The HTTP status an in-stream error stands for (its numeric `code`, else 500)."""
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, int) and 400 <= code <= 599 else 500


def _refusal(
    status: int, fields: tuple[str, str | None, str | None], headers: Mapping[str, str],
    url: str, name: str, *, structured: bool = True, queues: bool = True,
) -> ReplicaError:
    """The replica error an upstream's refusal maps to. Only an API error (`structured`)
    about the request itself keeps the upstream's message, which says what to fix; an
    overloaded upstream's text (it may name its account or its limits) and a 4xx page
    that is not an API error (a proxy's) are logged and replaced by `name`'s; a 404 is
    the deployment's fault (its URL or model), never the request's; the others never
    reach a tenant as they are (`generation.replica_error`). A 429 for a request that
    does not `queues` (it has a fallback) is `ReplicaRateLimited`: not waited on."""
    message, param, code = fields
    if status in (429, 503):
        logger.info("upstream %s is overloaded (%d): %s", url, status, message)
        kind = ReplicaRateLimited if status == 429 and not queues else ReplicaOverloaded
        return kind(_retry_after(headers),
                    f"{name} is overloaded; retry after a short wait.", code)
    if status in (401, 403):
        refused = ReplicaUnauthorized(f"{url}: the upstream refused this deployment's key "
                                      f"({status}: {message})")
        logger.error("%s", refused, extra={"event": "upstream_unauthorized"})
        return refused
    if status == 404:
        return ReplicaConnectionError(f"{url} answered 404 (its URL or model name is "
                                      f"wrong): {message}")
    if 400 <= status < 500 and not structured:
        logger.warning("upstream %s answered %d: %s", url, status, message)
        return ReplicaRequestError(status, f"{name} refused the request ({status}).",
                                   None, None)
    if 400 <= status < 500:
        return ReplicaRequestError(status, message, param, code)
    return ReplicaConnectionError(f"{url} answered {status}: {message}")


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds to wait, from ``retry-after-ms`` or ``Retry-After`` (seconds or a date)."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            return max(0.0, float(raw) * scale)
        except ValueError:
            pass
        with contextlib.suppress(TypeError, ValueError):
            return max(0.0, email.utils.parsedate_to_datetime(raw).timestamp() - time.time())
    return None
