"""A replica's KV-cache events on the wire, in vLLM's format and transport.

The replica publishes, once per engine step that changed its prefix cache, a
`KVEventBatch` on a ZMQ PUB socket as the multipart message ``[topic, seq, payload]``:
`seq` an 8-byte big-endian counter from 0 (a restarted replica starts again at 0, and its
first batch is `AllBlocksCleared`), `payload` msgpack of ``[ts, events]`` where each event
is a tagged array as vLLM's msgspec structs encode them:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys]``: newly full blocks of one chain (16-byte hashes,
  `wire/block_hash.py`); `token_ids` is always empty (a subscriber must not learn one
  tenant's prompt; the hashes are what routing needs) and `extra_keys` holds, per block,
  ``[salt_hash]``: an 8-byte hash of the tenant's cache salt, or None unsalted.
- ``["BlockRemoved", block_hashes, medium]``: evicted or reused blocks.
- ``["AllBlocksCleared"]``.

A ROUTER replay socket answers a request holding a start `seq` (8 bytes, big-endian)
with every buffered ``[seq, payload]`` from it on, then ``[-1, b""]``; a subscriber that
joins late or sees a gap resyncs so. With a replica token both sockets are CURVE
servers and only a client holding the token's client key gets in (`curve_keys`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack
import zmq
from zmq.utils import z85

from tokenyard.wire.block_hash import salt_hash

#: The replay's end mark (vLLM's): seq -1.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: What the replica publishes under (subscribers subscribe to it, or to everything).
TOPIC = b"kv-events"
#: vLLM's name of a GPU's pool; a CPU replica says "CPU" (`medium` of `encode_batch`).
MEDIUM = "GPU"


@dataclass
class EventBatch:
    """One decoded batch: what a subscriber's index needs."""

    ts: float
    #: ("stored", hashes, parent, salt_hash) / ("removed", hashes) / ("cleared",)
    events: list[tuple[object, ...]] = field(default_factory=list)


def encode_batch(ts: float, events: Sequence[tuple[object, ...]], block_size: int,
                 medium: str = MEDIUM) -> bytes:
    """msgpack of a `KVEventBatch` from the engine's event tuples (`BlockPool.events`:
    ``("stored", hash, parent, salt, tokens)``, ``("removed", hash)``, ``("cleared",)``);
    consecutive stored blocks of one chain and one salt become one BlockStored, whose
    salt is hashed and whose tokens stay here. `medium`: where the pool lives ("CPU",
    "GPU")."""
    out: list[list[object]] = []
    for ev in events:
        kind = ev[0]
        if kind == "stored":
            h, parent, salt = ev[1], ev[2], salt_hash(ev[3])  # type: ignore[arg-type]
            last = out[-1] if out else None
            if (last is not None and last[0] == "BlockStored" and last[1][-1] == parent  # type: ignore[index]
                    and last[8][-1][0] == salt):  # type: ignore[index]
                last[1].append(h)  # type: ignore[attr-defined]
                last[8].append([salt])  # type: ignore[attr-defined]
                continue
            out.append(["BlockStored", [h], parent, [], block_size, None, medium, None,
                        [[salt]]])
        elif kind == "removed":
            last = out[-1] if out else None
            if last is not None and last[0] == "BlockRemoved":
                last[1].append(ev[1])  # type: ignore[attr-defined]
                continue
            out.append(["BlockRemoved", [ev[1]], medium])
        else:
            out.append(["AllBlocksCleared"])
    return msgpack.packb([ts, out], use_bin_type=True)


def decode_batch(payload: bytes) -> EventBatch:
    """Decode a batch (ours or vLLM's); ValueError for a malformed one. Unknown event
    kinds are skipped."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        ts, raw = float(obj[0]), obj[1]
        batch = EventBatch(ts)
        for ev in raw:
            kind = ev[0]
            if kind == "BlockStored":
                extra = ev[8] if len(ev) > 8 and ev[8] else None
                salt = extra[0][0] if extra and extra[0] else None
                batch.events.append(("stored", list(ev[1]), ev[2], salt))
            elif kind == "BlockRemoved":
                batch.events.append(("removed", list(ev[1])))
            elif kind == "AllBlocksCleared":
                batch.events.append(("cleared",))
        return batch
    except (ValueError, TypeError, IndexError, KeyError, msgpack.UnpackException) as exc:
        raise ValueError(f"malformed KV event batch: {exc}") from exc


def curve_keys(token: str, role: str) -> tuple[bytes, bytes]:
    """The CURVE key pair (public, secret; Z85) of `role` ("server" or "client"),
    derived from the replica token: whoever holds the token holds both."""
    seed = hashlib.blake2b(token.encode(), digest_size=32,
                           person=b"kv-" + role.encode()[:13]).digest()
    secret = z85.encode(seed)
    return zmq.curve_public(secret), secret


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_int(raw: bytes) -> int:
    return int.from_bytes(raw, "big", signed=True)
