"""What a pool needs of its members' clients, one structural protocol per kind.

Every member is probed and closed (`Probed`); beyond that a pool of engine replicas
streams core requests (`EngineMember`: `balancer/replica.Replica`), a pool of upstreams
opens OpenAI-compatible streams (`UpstreamMember`), and a pool of embeddings replicas
makes one call per request (`EmbeddingsMember`). A pool holds clients of one kind; the
kind's entry points (`Pool.generate`, `Pool.open_chat`, `Pool.call`) reach its members
through `engine_of`, `upstream_of` and `embeddings_of`, which check the member has its
kind's one defining method and say which pool got the wrong kind of client otherwise.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol, TypeGuard

from tokenyard.balancer.embeddings_client import EmbeddingsModel
from tokenyard.balancer.replica import Replica
from tokenyard.wire.embeddings import EmbedResult, EmbedStats


class Probed(Protocol):
    """What a pool needs of every member: its health check and its connections closed."""

    async def health(self) -> bool:
        """Whether it answers its health check and admits requests."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...


#: An engine replica's client (`ReplicaClient`, a `RayReplica`): the `Replica` protocol.
EngineMember = Replica


class UpstreamMember(Probed, Protocol):
    """An OpenAI-compatible server's client (`UpstreamClient`): streams of JSON chunks."""

    def open_chat(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A chat completion's chunks; the first is read before the member is kept."""
        ...

    def open_completion(self, body: Mapping[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A text completion's chunks."""
        ...


class EmbeddingsMember(Probed, Protocol):
    """An embeddings replica's client (`EmbeddingsClient`)."""

    async def embed(self, request_id: str, inputs: list[list[int]] | list[str],
                    ) -> EmbedResult:
        ...

    async def info(self) -> EmbeddingsModel:
        ...

    async def stats(self) -> EmbedStats:
        ...


#: A member's client, of whichever kind its pool serves.
MemberClient = EngineMember | UpstreamMember | EmbeddingsMember


def _is_engine(client: MemberClient) -> TypeGuard[EngineMember]:
    return hasattr(client, "generate")


def _is_upstream(client: MemberClient) -> TypeGuard[UpstreamMember]:
    return hasattr(client, "open_chat")


def _is_embeddings(client: MemberClient) -> TypeGuard[EmbeddingsMember]:
    return hasattr(client, "embed")


def _wrong(client: MemberClient, kind: str) -> TypeError:
    return TypeError(f"{type(client).__name__} is not the client of {kind}")


def engine_of(client: MemberClient) -> EngineMember:
    """`client` as an engine replica's (TypeError: a pool of another kind)."""
    if not _is_engine(client):
        raise _wrong(client, "an engine replica")
    return client


def upstream_of(client: MemberClient) -> UpstreamMember:
    """`client` as an upstream's (TypeError: a pool of another kind)."""
    if not _is_upstream(client):
        raise _wrong(client, "an upstream")
    return client


def embeddings_of(client: MemberClient) -> EmbeddingsMember:
    """`client` as an embeddings replica's (TypeError: a pool of another kind)."""
    if not _is_embeddings(client):
        raise _wrong(client, "an embeddings replica")
    return client


def has_engine_stats(client: MemberClient) -> bool:
    """Whether a health probe can read `client`'s engine figures too."""
    return _is_engine(client) and hasattr(client, "stats")
