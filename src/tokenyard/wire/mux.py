"""The multiplexed channel between the HTTP side and an engine replica: one WebSocket
(``GET /v1/engine/mux``) per gateway process and replica carries every request.

The HTTP side sends one JSON message per operation:

- ``{"op": "generate", "request": <GenerateRequest>, "traceparent": str | null}``;
- ``{"op": "abort", "request_id"}``: the caller left; the replica aborts it (no answer;
  ``POST /v1/engine/abort`` remains the call that reports what it had computed).

The replica answers with frames: one per engine step for all the channel's requests (or
fewer, when the reader is slower than the engine: the steps that queued meanwhile go out
in one), each a JSON object with any of

- ``"deltas"``: `CoreDelta` objects, each with its ``"request_id"``;
- ``"refused"``: ``{"request_id", "status", "error", "retry_after"}``: a request turned
  away before it began, as the generate route's 400 / 503 answers it;
- ``"failed"``: ``{"request_id", "error"}``: a request that failed after it was admitted
  (the generate route's last error line).

A request's deltas end with the one that carries a finish_reason. A replica without this
route answers its upgrade 404; the client then streams over ``POST /v1/engine/generate``.
Like `wire/protocol.py`, this module stays free of torch.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from tokenyard.wire.protocol import (
    CoreDelta,
    CoreOutputLike,
    GenerateRequest,
    Json,
    ProtocolError,
    _object,
    _str,
    delta_json,
)

MUX_PATH = "/v1/engine/mux"
GENERATE_OP = "generate"
ABORT_OP = "abort"


def generate_op(request: GenerateRequest, traceparent: str | None = None) -> bytes:
    """The message that starts `request` on the channel."""
    return orjson.dumps({"op": GENERATE_OP, "request": request.to_json(),
                         "traceparent": traceparent})


def abort_op(request_id: str) -> bytes:
    """The message that ends a request whose caller left."""
    return orjson.dumps({"op": ABORT_OP, "request_id": request_id})


def read_op(data: bytes | str) -> tuple[str, Json]:
    """(op, message) of a message from the HTTP side (ProtocolError if malformed)."""
    try:
        obj = _object(json.loads(data), None)
    except ValueError as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(None, f"a channel message is not JSON: {exc}") from exc
    op = obj.get("op")
    if op == ABORT_OP:
        _str(obj.get("request_id"), "request_id")
    elif op != GENERATE_OP:
        raise ProtocolError("op", f"unknown channel operation {op!r}")
    return op, obj


@dataclass(frozen=True)
class Refusal:
    """A request the replica turned away before it began (a generate route's non-200)."""

    request_id: str
    status: int
    error: Json
    retry_after: float | None = None

    def to_json(self) -> Json:
        return {"request_id": self.request_id, "status": self.status, "error": self.error,
                "retry_after": self.retry_after}


@dataclass(frozen=True)
class Failure:
    """A request that failed after it was admitted; `error` is ``{"message", "code"}``."""

    request_id: str
    error: Json


def encode_frame(outputs: Iterable[tuple[str, CoreOutputLike]],
                 refused: Sequence[Refusal] = (), failed: Sequence[Failure] = ()) -> bytes:
    """One frame: the (request id, output) pairs of one or more steps, and refusals and
    failures. orjson, unless a logprob is in it: a logprob of -inf is written as
    ``-Infinity``, which only `json` writes."""
    deltas: list[Json] = []
    plain = True
    for request_id, out in outputs:
        obj = delta_json(out)
        obj["request_id"] = request_id
        plain = plain and obj["new_logprobs"] is None and "prompt_logprobs" not in obj
        deltas.append(obj)
    frame: Json = {"deltas": deltas}
    if refused:
        frame["refused"] = [r.to_json() for r in refused]
    if failed:
        frame["failed"] = [{"request_id": f.request_id, "error": f.error} for f in failed]
    if plain:
        return orjson.dumps(frame)
    return json.dumps(frame, separators=(",", ":")).encode()


@dataclass
class Frame:
    """A decoded frame."""

    deltas: list[CoreDelta]
    refused: list[Refusal]
    failed: list[Failure]


def decode_frame(data: bytes | str) -> Frame:
    """A frame from the replica (ProtocolError if it does not follow the format)."""
    try:
        raw: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        try:
            raw = json.loads(data)  # -Infinity in a logprob
        except ValueError as exc:
            raise ProtocolError(None, f"a frame is not JSON: {exc}") from exc
    obj = _object(raw, None)
    deltas = [CoreDelta.from_json(_str(d.get("request_id"), "request_id"), d)
              for d in (_object(d, "deltas") for d in obj.get("deltas", ()))]
    refused = []
    for r in obj.get("refused", ()):
        r = _object(r, "refused")
        retry = r.get("retry_after")
        refused.append(Refusal(_str(r.get("request_id"), "request_id"), int(r.get("status", 0)),
                               _object(r.get("error"), "error"),
                               float(retry) if retry is not None else None))
    failed = [Failure(_str(f.get("request_id"), "request_id"), _object(f.get("error"), "error"))
              for f in (_object(f, "failed") for f in obj.get("failed", ()))]
    return Frame(deltas, refused, failed)
