"""The HTTP side's client of one engine replica (`tokenyard engine`).

Speaks the wire format of `tokenyard.wire.protocol` over one pooled aiohttp session.
Imports nothing that loads torch: the gateway process uses it.

The errors' texts hold the replica's URL and the exceptions met, for the log; a failure
after a stream began (`ReplicaStreamError`, whose message a tenant's error event carries)
says only that the request failed on its replica, and its cause goes to the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import aiohttp
import orjson

from tokenyard.balancer.http_client import PooledClient
from tokenyard.balancer.mux_client import MuxLink, MuxUnsupported
from tokenyard.balancer.replica_errors import (
    STREAM_FAILED_MESSAGE,
    ReplicaConnectionError,
    ReplicaError,
    ReplicaOverloaded,
    ReplicaRateLimited,
    ReplicaRequestError,
    ReplicaStreamError,
    ReplicaUnauthorized,
    refusal_error,
)
from tokenyard.telemetry.tracing import OUTGOING, TRACEPARENT
from tokenyard.wire.abort import AbortReport, abort_body, stop_body
from tokenyard.wire.mux import generate_op
from tokenyard.wire.protocol import (
    ABORT_PATH,
    GENERATE_PATH,
    HEALTH_PATH,
    INFO_PATH,
    LORAS_PATH,
    STATS_PATH,
    STOP_PATH,
    CoreDelta,
    GenerateRequest,
    Pin,
    ProtocolError,
    dumps,
)
from tokenyard.wire.replica_info import ReplicaInfo, ReplicaStats, stats_from_json
from tokenyard.wire.sampling_params import SamplingParams

# The errors live in `replica_errors`; callers import them from here too.
__all__ = ["STREAM_FAILED_MESSAGE", "ReplicaClient", "ReplicaConnectionError", "ReplicaError",
           "ReplicaOverloaded", "ReplicaRateLimited", "ReplicaRequestError", "ReplicaStreamError",
           "ReplicaUnauthorized"]

_JSON_HEADERS = {"Content-Type": "application/json"}

logger = logging.getLogger("tokenyard.balancer")


class ReplicaClient(PooledClient):
    """One replica's API: `generate` streams CoreDeltas; abort, stop, stats, info, health.

    The aiohttp session is created on first use, in the running event loop, and pools
    connections (each open stream holds one); `close` it when done.
    """

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 10.0,
        max_connections: int = 0,
    ) -> None:
        """`request_timeout` bounds the small calls; a generate stream has no total
        timeout (a long generation, or a wait in the replica's queue, is legitimate).
        `max_connections` 0 means unbounded: streams, not this pool, are the limit.
        `token`: the replica's shared secret, sent as a bearer token on every call."""
        super().__init__(base_url, connect_timeout=connect_timeout,
                         request_timeout=request_timeout, max_connections=max_connections)
        auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._headers = auth or None
        self._json_headers = {**_JSON_HEADERS, **auth}
        self._mux = MuxLink(self.base_url, self._get_session, self._headers)

    async def close(self) -> None:
        """Close the channel (its open requests fail) and the pooled connections."""
        await self._mux.close()
        await super().close()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        *,
        pins: Sequence[Pin] = (),
        lora: str | None = None,
    ) -> AsyncIterator[CoreDelta]:
        """Yield the request's per-step deltas until one carries a finish_reason
        (`lora`: the adapter it runs with; None: the base model).

        Raises before the first item: ReplicaRequestError (400: invalid, code
        "context_length_exceeded", ...), ReplicaOverloaded (503), ReplicaUnauthorized (401),
        ReplicaConnectionError.
        Afterwards: ReplicaStreamError, ReplicaConnectionError. `params.n` must be 1 and
        stop strings are not sent (the caller matches them and calls `stop`). Leaving
        the iteration early (break + aclose) makes the replica abort the request.

        The request travels on the replica's multiplexed channel (`balancer/mux_client.py`);
        a replica without one gets it as a ``POST`` of its own, streamed back.
        """
        wire = GenerateRequest(request_id, prompt_token_ids, params, cache_salt, priority,
                               list(pins), lora)
        traceparent = OUTGOING.get()  # the gateway's span of this request, when traced
        try:
            inbox = await self._mux.open(request_id, generate_op(wire, traceparent))
        except MuxUnsupported:
            async for delta in self._generate_http(wire, traceparent):
                yield delta
            return
        finished = False
        try:
            while not finished:
                delta = await inbox.get()
                finished = delta.finish_reason is not None
                yield delta
        finally:
            self._mux.leave(inbox, finished)

    async def _generate_http(self, wire: GenerateRequest,
                             traceparent: str | None) -> AsyncIterator[CoreDelta]:
        """`generate` over ``POST /v1/engine/generate``: one HTTP stream per request,
        closed (not released) to make the replica abort a request left early."""
        request_id = wire.request_id
        body = orjson.dumps(wire.to_json())
        headers = self._json_headers
        if traceparent is not None:
            headers = {**headers, TRACEPARENT: traceparent}
        try:
            response = await self._get_session().post(
                self.base_url + GENERATE_PATH, data=body, headers=headers
            )
        except aiohttp.ClientError as exc:
            raise ReplicaConnectionError(f"{self.base_url}: {exc}") from exc
        finished = False
        self._streams.add(response)
        try:
            if response.status != 200:
                await _raise_for(response)
            async for line in response.content:
                if not line.strip():
                    continue
                obj = _loads(line)
                if "error" in obj:
                    error = obj["error"]
                    # The engine's text names the exception that failed its step.
                    logger.error("replica %s failed %s after it began: %s", self.base_url,
                                 request_id, error.get("message"), extra={
                                     "event": "replica_stream_error",
                                     "replica": self.base_url, "request_id": request_id})
                    raise ReplicaStreamError(STREAM_FAILED_MESSAGE, error.get("code"))
                delta = CoreDelta.from_json(request_id, obj)
                if delta.finish_reason is not None:
                    finished = True
                    # Read the stream's end now, so the connection goes back to the pool
                    # even if the caller stops iterating after this delta.
                    await response.read()
                yield delta
                if finished:
                    return
            raise ReplicaConnectionError(
                f"{self.base_url}: the stream of {request_id} ended before it finished"
            )
        except (aiohttp.ClientError, ProtocolError, ValueError) as exc:
            if isinstance(exc, ReplicaError):
                raise
            raise ReplicaConnectionError(f"{self.base_url}: {exc}") from exc
        finally:
            self._streams.discard(response)
            if finished:
                response.release()
            else:
                # Closing (not releasing) the connection is what tells the replica that
                # nobody reads this stream any more.
                response.close()

    async def abort(self, request_id: str) -> AbortReport | None:
        """Abort a request (unknown or finished ids are ignored); what it had computed
        when the replica ended it (None: it no longer held it, or does not report)."""
        answer = await self._call("POST", ABORT_PATH, abort_body(request_id))
        try:
            return AbortReport.from_answer(answer)
        except ProtocolError as exc:
            raise ReplicaConnectionError(f"{self.base_url}{ABORT_PATH}: {exc}") from exc

    async def stop(self, request_id: str, stop: str) -> None:
        """The caller matched stop string `stop`: the replica finishes the request as
        stopped, and its stream ends with finish_reason "stop", stop_reason `stop`."""
        await self._call("POST", STOP_PATH, stop_body(request_id, stop))

    async def stats(self) -> ReplicaStats:
        """The replica's engine counters."""
        return stats_from_json(await self._call("GET", STATS_PATH))

    async def info(self) -> ReplicaInfo:
        """The replica's model: name, context window, vocabulary, EOS ids, KV geometry."""
        return ReplicaInfo.from_json(await self._call("GET", INFO_PATH))

    async def load_lora(self, name: str, path: str) -> list[str]:
        """Have the replica serve LoRA adapter `name` from `path` (a folder on its host);
        the adapters it serves now. ReplicaRequestError when it cannot."""
        answer = await self._call("POST", LORAS_PATH, {"name": name, "path": path})
        return list(answer.get("loras", []))

    async def unload_lora(self, name: str) -> list[str]:
        """Have the replica stop serving adapter `name`; the adapters it serves now."""
        answer = await self._call("DELETE", f"{LORAS_PATH}/{name}")
        return list(answer.get("loras", []))

    async def health(self) -> bool:
        """True if the replica answers and admits requests (False while it drains)."""
        return await self._probe(HEALTH_PATH)

    async def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            async with self._get_session().request(
                method,
                self.base_url + path,
                data=dumps(body) if body is not None else None,
                headers=self._json_headers if body is not None else self._headers,
                timeout=aiohttp.ClientTimeout(total=self._request_timeout),
            ) as response:
                if response.status != 200:
                    await _raise_for(response)
                return await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ReplicaConnectionError(f"{self.base_url}{path}: {exc!r}") from exc


def _loads(line: bytes) -> Any:
    """One stream line: by orjson, or by `json` where the line holds what only it reads
    (the engine writes a logprob of -inf as ``-Infinity``)."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


async def _raise_for(response: aiohttp.ClientResponse) -> None:
    """Raise the typed error of a non-200 answer."""
    text = await response.text()
    try:
        error = json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        error = text[:500]
    raw = response.headers.get("Retry-After")
    try:
        retry_after = float(raw) if raw is not None else None
    except ValueError:
        retry_after = None
    raise refusal_error(response.status, error, retry_after, str(response.url.origin()))
