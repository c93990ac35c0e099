"""The wire format between the HTTP process and an embeddings replica (`tokenyard embed`).

Torch-free, like `wire/protocol.py`: the replica's server and the client the balancer uses
both encode and decode through here. Vectors cross as base64 of little-endian float32
(the same bytes the OpenAI API's ``encoding_format: "base64"`` carries), not as JSON
numbers: decoding 384 floats per input from JSON costs more than the forward pass.

- ``POST /v1/embed`` an `EmbedRequest` (token-id lists, or texts the replica tokenizes);
  200 answers an `EmbedResult`. Errors are ``{"error": {"message", "param", "code"}}``:
  400 (``invalid_request``, ``context_length_exceeded``) or 503 (``overloaded``,
  ``draining``; ``retry-after`` header).
- ``GET /v1/embed/info`` (`EmbeddingsInfo`), ``GET /v1/embed/stats`` (`EmbedStats`),
  ``GET /v1/embed/tokenizer`` (the replica's tokenizer.json, so the HTTP process counts
  tokens with the very same tokenizer), ``GET /healthz``.
"""

from __future__ import annotations

import base64
import sys
from array import array
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any

from tokenyard.wire.protocol import Json, ProtocolError, _int, _int_list, _object, _str

EMBED_PATH = "/v1/embed"
EMBED_INFO_PATH = "/v1/embed/info"
EMBED_STATS_PATH = "/v1/embed/stats"
EMBED_TOKENIZER_PATH = "/v1/embed/tokenizer"


def pack_floats(raw_le: bytes) -> str:
    """A vector on the wire: base64 of its little-endian float32 bytes."""
    if len(raw_le) % 4:
        raise ValueError("not a whole number of float32 values")
    return base64.b64encode(raw_le).decode("ascii")


def unpack_floats(b64: str) -> list[float]:
    """The floats of `pack_floats`' text (ValueError if it is not whole float32s)."""
    raw = base64.b64decode(b64, validate=True)
    if len(raw) % 4:
        raise ValueError("not a whole number of float32 values")
    buf = array("f")
    buf.frombytes(raw)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tolist()


@dataclass
class EmbedRequest:
    """``POST /v1/embed``: one request of one or more inputs, each embedded on its own.

    `inputs` are token-id lists (the model's input as given, special tokens included) or
    texts (the replica tokenizes them, adding its special tokens)."""

    request_id: str
    inputs: list[list[int]] | list[str]

    def to_json(self) -> Json:
        key = "texts" if self.inputs and isinstance(self.inputs[0], str) else "input_ids"
        return {"request_id": self.request_id, key: self.inputs}

    @classmethod
    def from_json(cls, obj: Any) -> EmbedRequest:
        """Decode and check (ProtocolError naming the field): a non-empty list of non-empty
        texts, or of non-empty token-id lists."""
        obj = _object(obj, None)
        request_id = _str(obj.get("request_id"), "request_id")
        if ("texts" in obj) == ("input_ids" in obj):
            raise ProtocolError("input_ids", "exactly one of input_ids and texts is needed")
        if "texts" in obj:
            texts = obj["texts"]
            if not isinstance(texts, list) or not texts:
                raise ProtocolError("texts", "texts must be a non-empty list of strings")
            return cls(request_id, [_str(t, f"texts.{i}") for i, t in enumerate(texts)])
        lists = obj["input_ids"]
        if not isinstance(lists, list) or not lists:
            raise ProtocolError("input_ids", "input_ids must be a non-empty list of lists")
        inputs = [_int_list(ids, f"input_ids.{i}") for i, ids in enumerate(lists)]
        if any(not ids for ids in inputs):
            raise ProtocolError("input_ids", "every input must have at least one token")
        return cls(request_id, inputs)


@dataclass
class EmbedResult:
    """``POST /v1/embed``'s answer: one vector (base64 float32) and token count per input,
    in request order, and the time the request waited for its batch and the forward
    passes that embedded it took (ms)."""

    embeddings: list[str]
    num_tokens: list[int]
    queue_ms: float = 0.0
    forward_ms: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        """Every input's tokens, as usage reports them."""
        return sum(self.num_tokens)

    def vector(self, index: int) -> list[float]:
        """Input `index`'s embedding as floats."""
        return unpack_floats(self.embeddings[index])

    def to_json(self) -> Json:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, num_inputs: int) -> EmbedResult:
        """Decode an answer to a request of `num_inputs` inputs (ProtocolError if it does
        not hold one vector and one count per input)."""
        obj = _object(obj, None)
        vectors, counts = obj.get("embeddings"), obj.get("num_tokens")
        if not (isinstance(vectors, list) and all(isinstance(v, str) for v in vectors)
                and len(vectors) == num_inputs):
            raise ProtocolError("embeddings", f"embeddings must be {num_inputs} strings")
        tokens = _int_list(counts, "num_tokens")
        if len(tokens) != num_inputs:
            raise ProtocolError("num_tokens", f"num_tokens must hold {num_inputs} counts")
        return cls(list(vectors), tokens, float(obj.get("queue_ms", 0.0)),
                   float(obj.get("forward_ms", 0.0)))


@dataclass
class EmbeddingsInfo:
    """``GET /v1/embed/info``: the served model, its vector size, the most tokens one input
    may have, and its vocabulary (token ids must be below it)."""

    model: str
    dimensions: int
    max_tokens: int
    vocab_size: int
    #: The most inputs one forward pass holds (larger requests take several).
    max_batch_inputs: int = 0

    def to_json(self) -> Json:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> EmbeddingsInfo:
        obj = _object(obj, None)
        return cls(**{f.name: obj[f.name] for f in fields(cls)
                      if f.name in obj or f.default is MISSING})


@dataclass
class EmbedStats:
    """``GET /v1/embed/stats``: counters since the replica started."""

    requests: int = 0  # requests embedded
    inputs: int = 0  # inputs embedded (a request has one or more)
    tokens: int = 0  # real tokens embedded
    padded_tokens: int = 0  # tokens computed, padding included
    forward_passes: int = 0  # batched forward passes run
    waiting_inputs: int = 0  # inputs queued now, not yet in a pass
    running_inputs: int = 0  # inputs in the pass running now

    def to_json(self) -> Json:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> EmbedStats:
        """Decode; fields a newer replica adds are ignored."""
        obj = _object(obj, None)
        return cls(**{f.name: _int(obj[f.name], f.name) for f in fields(cls) if f.name in obj})
