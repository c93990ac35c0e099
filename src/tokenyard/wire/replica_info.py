"""A replica's self-description on the wire: its model (``GET /v1/engine/info``), its
counters (``GET /v1/engine/stats``).

The paths are in `wire/protocol.py`, whose field checks decode these bodies too; like it,
this module stays free of torch.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from tokenyard.wire.outputs import EngineStats
from tokenyard.wire.protocol import Json, _object

#: ``GET /v1/engine/stats`` carries the engine's own EngineStats, field for field.
ReplicaStats = EngineStats


def stats_from_json(obj: Any) -> EngineStats:
    """Decode a stats body; fields a newer replica adds beyond these are ignored, and
    fields with a default may be absent (an older replica)."""
    obj = _object(obj, None)
    return EngineStats(**{f.name: obj[f.name] for f in fields(EngineStats)
                          if f.name in obj or f.default is MISSING})


@dataclass
class ReplicaInfo:
    """``GET /v1/engine/info``: what the HTTP side needs to know of the replica's model."""

    model: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    block_size: int
    num_kv_blocks: int
    #: The weight format served ("float32", "q4_1", ...: `--weights auto` resolved);
    #: None from a replica older than the field.
    weights: str | None = None
    #: Its KV-cache events (`wire/kv_events.py`): the PUB and the replay ROUTER
    #: endpoints; None from a replica that publishes none (or older than the fields).
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    #: Its KV events in vLLM's own format (`wire/vllm_kv_events.py`), where configured.
    vllm_kv_events_endpoint: str | None = None
    #: The LoRA adapters it serves (`--lora-modules` and those registered since); None
    #: from a replica older than the field.
    loras: list[str] | None = None

    def to_json(self) -> Json:
        """The wire body."""
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> ReplicaInfo:
        """Decode; unknown extra fields are ignored, fields with a default may be absent."""
        obj = _object(obj, None)
        return cls(**{f.name: obj[f.name] for f in fields(cls)
                      if f.name in obj or f.default is MISSING})

