"""What the HTTP side needs of a replica, whatever kind it is.

`ReplicaClient` (an engine replica over HTTP) is today's one implementation; a generation
(`balancer/generation.py`) is written against this protocol only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from tokenyard.wire.abort import AbortReport
from tokenyard.wire.protocol import CoreDelta, Pin
from tokenyard.wire.replica_info import ReplicaInfo, ReplicaStats
from tokenyard.wire.sampling_params import SamplingParams


class Replica(Protocol):
    """One replica: streams a core request's per-step deltas, and stops, aborts, reports."""

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        priority: int = 0,
        *,
        pins: Sequence[Pin] = (),
    ) -> AsyncIterator[CoreDelta]:
        """The request's deltas until one carries a finish_reason; closing the iterator
        aborts the request. `cache_salt`: prefix-cache blocks are shared only within one
        salt; `priority`: the scheduler's class, lower first; `pins`: prompt prefixes to
        keep cached, (tokens, TTL seconds) each (a replica without a prompt cache may
        ignore them)."""
        ...

    async def stop(self, request_id: str, stop: str) -> None:
        """End a request because a stop string matched on the caller's side."""
        ...

    async def abort(self, request_id: str) -> AbortReport | None:
        """End a request and free its KV blocks; what it had computed by then, if the
        replica reports it (None: unknown, finished, or a replica that does not say)."""
        ...

    async def stats(self) -> ReplicaStats:
        """The replica's engine figures (running, waiting, KV usage, totals)."""
        ...

    async def info(self) -> ReplicaInfo:
        """The model it serves: name, context window, vocabulary, block size."""
        ...

    async def health(self) -> bool:
        """Whether it answers its health check."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...
