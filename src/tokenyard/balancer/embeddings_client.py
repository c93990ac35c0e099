"""The HTTP side's client of one embeddings replica (`tokenyard embed`).

Speaks `tokenyard.wire.embeddings` over the engine replica client's pooled session, and so
raises the same typed errors (`ReplicaOverloaded`, `ReplicaConnectionError`,
`ReplicaRequestError`, `ReplicaUnauthorized`). Torch-free: the gateway process uses it.
The replica's model facts and tokenizer are asked once and kept: the route counts tokens
here, with the replica's own tokenizer, before admission (tokens are counted once, in
the HTTP process, and token ids travel to the replica).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.wire.embeddings import (
    EMBED_INFO_PATH,
    EMBED_PATH,
    EMBED_STATS_PATH,
    EMBED_TOKENIZER_PATH,
    EmbeddingsInfo,
    EmbedRequest,
    EmbedResult,
    EmbedStats,
)


@dataclass(eq=False)
class EmbeddingsModel:
    """What the HTTP side knows of a replica's model: the wire facts (name, dimensions,
    max tokens per input, vocabulary) and its tokenizer."""

    info: EmbeddingsInfo
    tokenizer: Tokenizer

    @property
    def name(self) -> str:
        return self.info.model

    @property
    def dimensions(self) -> int:
        return self.info.dimensions

    @property
    def max_tokens(self) -> int:
        return self.info.max_tokens

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, special tokens included, never truncated."""
        return [enc.ids for enc in self.tokenizer.encode_batch(list(texts))]


class EmbeddingsClient:
    """One embeddings replica's API: `embed`, `info`, `stats`, `health`, `close` (what a
    deployment's `Pool` needs of its members)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        connect_timeout: float = 5.0,
        request_timeout: float = 120.0,
    ) -> None:
        """`request_timeout` bounds every call, an embed included (a large batch behind a
        busy queue on a CPU takes seconds). `token`: the replica's shared secret."""
        self.base_url = base_url.rstrip("/")
        self._http = ReplicaClient(base_url, token=token, connect_timeout=connect_timeout,
                                   request_timeout=request_timeout)
        self._model: EmbeddingsModel | None = None

    async def embed(self, request_id: str, inputs: list[list[int]] | list[str]) -> EmbedResult:
        """Embed `inputs` (token-id lists as the model's input, or texts the replica
        tokenizes): one vector and token count per input, in order.

        Raises ReplicaRequestError (400: invalid, code "context_length_exceeded"),
        ReplicaOverloaded (503: queue full or draining), ReplicaUnauthorized,
        ReplicaConnectionError; ProtocolError for an answer that does not fit."""
        body = EmbedRequest(request_id, inputs).to_json()
        answer = await self._http._call("POST", EMBED_PATH, body)
        return EmbedResult.from_json(answer, len(inputs))

    async def info(self) -> EmbeddingsModel:
        """The replica's model and tokenizer (asked once, then kept)."""
        if self._model is None:
            info = EmbeddingsInfo.from_json(await self._http._call("GET", EMBED_INFO_PATH))
            raw = await self._http._call("GET", EMBED_TOKENIZER_PATH)
            self._model = EmbeddingsModel(info, Tokenizer.from_str(json.dumps(raw)))
        return self._model

    async def stats(self) -> EmbedStats:
        """The replica's batcher counters (forward passes, inputs, tokens, queue)."""
        return EmbedStats.from_json(await self._http._call("GET", EMBED_STATS_PATH))

    async def health(self) -> bool:
        """True if the replica answers and admits requests (False while it drains)."""
        return await self._http.health()

    async def close(self) -> None:
        """Close the pooled connections."""
        await self._http.close()
