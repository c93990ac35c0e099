"""A replica's KV-cache events as vLLM itself publishes them, for routers built for vLLM
(llm-d's KV-cache indexer, vLLM's own router, Dynamo).

tokenyard's own events (`wire/kv_events.py`) name blocks by tokenyard's hash chain and
never carry token ids: the gateway hashes prompts with the same function, and the
subscriber must not learn a tenant's prompt. An outside router cannot use them: it
needs the block hashes vLLM computes and, for llm-d, the tokens of each block (it maps
vLLM's "engine keys" to keys it computes from the tokens). This module produces exactly
what a vLLM replica sends:

- the block hash: vLLM's `sha256_cbor` scheme, SHA-256 of the canonical CBOR of
  ``(parent_hash, tuple(block_token_ids), extra_keys)``; the first block's parent is
  ``NONE_HASH = sha256_cbor(seed)`` (vLLM's default seed for SHA-256 is
  ``"vllm-none-hash"``, overridden by ``PYTHONHASHSEED``; here by the same setting); the
  cache salt is the first block's only extra key, ``(salt,)``, as vLLM's
  `generate_block_hash_extra_keys` puts it; on the wire a hash is its last 8 bytes read
  big-endian (vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`, its default);
- the batch: msgpack of vLLM's `KVEventBatch` msgspec structs (array-like and tagged,
  so every field is written, in order): ``[ts, [["BlockStored", hashes, parent,
  token_ids, block_size, lora_id, medium, lora_name, extra_keys], ["BlockRemoved",
  hashes, medium], ["AllBlocksCleared"]], data_parallel_rank]``, one BlockStored per run
  of consecutive blocks of one chain, its ``token_ids`` the run's tokens and its
  ``extra_keys`` one entry per block (None where a block has none, None for all).

`VllmEventEncoder` turns the engine's event tuples (`engine/kv_cache.py`: ``("stored",
hash, parent, salt, tokens)``, ``("removed", hash)``, ``("cleared",)``) into such batches,
keeping the map from tokenyard's hashes to vLLM's for the blocks the replica holds.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, cast

import cbor2
import msgpack

#: What vLLM's publisher stamps on a batch of a replica without data parallelism.
DATA_PARALLEL_RANK = 0
#: vLLM's seed of NONE_HASH for SHA-256 when PYTHONHASHSEED is unset.
DEFAULT_HASH_SEED = "vllm-none-hash"


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's `sha256_cbor`: SHA-256 of `obj`'s canonical CBOR encoding."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(seed: str = DEFAULT_HASH_SEED) -> bytes:
    """The parent hash of a chain's first block."""
    return sha256_cbor(seed)


def hash_block(parent: bytes, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
               ) -> bytes:
    """vLLM's `hash_block_tokens` under `sha256_cbor` (32 bytes)."""
    return sha256_cbor((parent, tuple(tokens), extra_keys))


def external(block_hash: bytes) -> int:
    """A hash as vLLM's events carry it: its last 8 bytes, big-endian (uint64)."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def hash_prompt(tokens: Sequence[int], block_size: int, salt: str | None = None,
                seed: str = DEFAULT_HASH_SEED) -> list[bytes]:
    """vLLM's hash of every full block of a prompt (what its prefix cache keys)."""
    parent = none_hash(seed)
    out: list[bytes] = []
    for i, start in enumerate(range(0, len(tokens) // block_size * block_size, block_size)):
        extra = (salt,) if i == 0 and salt else None
        parent = hash_block(parent, tokens[start:start + block_size], extra)
        out.append(parent)
    return out


class VllmEventEncoder:
    """The engine's event tuples -> vLLM `KVEventBatch` payloads (one instance per
    publisher: it remembers vLLM's hash of each block it announced)."""

    def __init__(self, block_size: int, medium: str, seed: str = DEFAULT_HASH_SEED) -> None:
        self.block_size = block_size
        self.medium = medium
        self._root = none_hash(seed)
        #: tokenyard's hash of a held block -> vLLM's.
        self._vllm: dict[bytes, bytes] = {}

    def encode(self, ts: float, events: Sequence[tuple[object, ...]]) -> bytes:
        out: list[list[object]] = []
        for ev in events:
            kind = ev[0]
            if kind == "stored":
                self._stored(out, ev)
            elif kind == "removed":
                gone = self._vllm.pop(cast(bytes, ev[1]), None)
                if gone is None:
                    continue  # never announced (its parent was unknown): nothing to remove
                last = out[-1] if out else None
                if last is not None and last[0] == "BlockRemoved":
                    last[1].append(external(gone))  # type: ignore[attr-defined]
                else:
                    out.append(["BlockRemoved", [external(gone)], self.medium])
            elif kind == "cleared":
                self._vllm.clear()
                out.append(["AllBlocksCleared"])
        return msgpack.packb([ts, out, DATA_PARALLEL_RANK], use_bin_type=True)

    def _stored(self, out: list[list[object]], ev: tuple[object, ...]) -> None:
        ours = cast(bytes, ev[1])
        parent = cast("bytes | None", ev[2])
        salt = cast("str | None", ev[3])
        block = tuple(cast("Sequence[int]", ev[4]))
        if parent is None:
            vparent, extra = self._root, ((salt,) if salt else None)
        else:
            found = self._vllm.get(parent)
            if found is None:
                return  # its chain was never announced: a router could not place it
            vparent, extra = found, None
        vhash = hash_block(vparent, block, extra)
        self._vllm[ours] = vhash
        last = out[-1] if out else None
        # One BlockStored per run of a chain's blocks, as vLLM caches a request's new
        # blocks in one call: this block continues the last event's chain.
        if (last is not None and last[0] == "BlockStored" and extra is None
                and last[1][-1] == external(vparent)):  # type: ignore[index]
            last[1].append(external(vhash))  # type: ignore[attr-defined]
            last[3].extend(block)  # type: ignore[attr-defined]
            if last[8] is not None:
                last[8].append(None)  # type: ignore[attr-defined]
            return
        out.append(["BlockStored", [external(vhash)],
                    None if parent is None else external(vparent), list(block),
                    self.block_size, None, self.medium, None,
                    None if extra is None else [list(extra)]])  # extra_keys: one per block
