"""The wire format between the HTTP process and an engine replica: token ids as JSON.

One source of truth for both ends: the replica server (`engine/server.py`) and the
client the balancer uses (`balancer/replica_client.py`) encode and decode through here.
This module must stay free of torch (and of anything that imports it): the gateway
process imports it and never loads torch.

The replica API:

- ``POST /v1/engine/generate`` a `GenerateRequest`; 200 answers ``application/x-ndjson``,
  one `CoreDelta` line per engine step that moved the request. Errors before the stream
  starts are ``{"error": {"message", "param", "code"}}`` with 400 (invalid request,
  ``context_length_exceeded``) or 503 (``overloaded``, ``draining``; ``retry-after``
  header). A failure after the stream began arrives as a last line ``{"error": {...}}``.
- ``POST /v1/engine/abort`` ``{"request_id"}``, answered ``{"ok": true}`` plus, when the
  replica still held the request, its `AbortReport` (what it had computed: the prefill a
  client that left before its first token still used); ``POST /v1/engine/stop``
  ``{"request_id", "stop"}`` (the HTTP side matched a stop string). Both bodies, and the
  report, are in `wire/abort.py`.
- ``GET /v1/engine/mux``: a WebSocket that carries every request of one HTTP process,
  each step's deltas of all of them in one frame (`wire/mux.py`); the gateway's usual way.
- ``GET /v1/engine/stats`` (`ReplicaStats`), ``GET /v1/engine/info`` (`ReplicaInfo`), both
  in `wire/replica_info.py`; ``GET /healthz``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

GENERATE_PATH = "/v1/engine/generate"
ABORT_PATH = "/v1/engine/abort"
STOP_PATH = "/v1/engine/stop"
STATS_PATH = "/v1/engine/stats"
INFO_PATH = "/v1/engine/info"
#: POST {"name", "path"}: serve a LoRA adapter from now on; DELETE …/{name}: stop.
LORAS_PATH = "/v1/engine/loras"
HEALTH_PATH = "/healthz"
NDJSON = "application/x-ndjson"

# Error codes in {"error": {"code": ...}}.
INVALID_REQUEST = "invalid_request"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
OVERLOADED = "overloaded"
DRAINING = "draining"
ENGINE_ERROR = "engine_error"

# The SamplingParams fields that cross the wire. Stop strings, special-token skipping
# and include_stop_str_in_output are text matters and stay on the HTTP side.
WIRE_PARAMS: tuple[str, ...] = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "seed", "max_tokens",
    "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "guided", "prompt_logprobs",
)

Json = dict[str, Any]


class ProtocolError(ValueError):
    """A message does not follow the wire format; `param` names the offending field."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param


def dumps(obj: Any) -> bytes:
    """Compact JSON as bytes (what every body and stream line is)."""
    return json.dumps(obj, separators=(",", ":")).encode()


def error_body(message: str, code: str, param: str | None = None) -> Json:
    """The error object of every non-200 answer and of a failed stream's last line."""
    return {"error": {"message": message, "param": param, "code": code}}


# -- field checks ---------------------------------------------------------------------------
# JSON from a peer is untrusted: a bool where an int belongs, or a float token id, must be
# refused here rather than fail inside a batched engine step.

def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: Any, param: str) -> int:
    if not _is_int(value):
        raise ProtocolError(param, f"{param} must be an integer")
    return int(value)


def _float(value: Any, param: str) -> float:
    if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
        raise ProtocolError(param, f"{param} must be a finite number")
    return float(value)


def _optional_float(value: Any, param: str) -> float | None:
    return None if value is None else _float(value, param)


def _int_list(value: Any, param: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise ProtocolError(param, f"{param} must be a list of integers")
    return list(value)


def _object(value: Any, param: str | None) -> Json:
    if not isinstance(value, dict):
        raise ProtocolError(param, f"{param or 'the body'} must be a JSON object")
    return value


def _str(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise ProtocolError(param, f"{param} must be a non-empty string")
    return value


# -- sampling parameters --------------------------------------------------------------------

def params_to_json(params: SamplingParams) -> Json:
    """The wire fields of `params` (logit_bias keys become strings, as JSON needs)."""
    out: Json = {name: getattr(params, name) for name in WIRE_PARAMS}
    out["stop_token_ids"] = list(params.stop_token_ids)
    if params.logit_bias is not None:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    if params.prompt_logprobs is None:
        del out["prompt_logprobs"]  # a replica from before it knew the field still serves
    if params.guided is None:
        del out["guided"]
    else:
        out["guided"] = guided_to_json(params.guided)
    return out


def guided_to_json(guided: GuidedDecoding) -> Json:
    """A grammar on the wire: ``{"kind", "spec", "any_whitespace", "param"}``."""
    return {"kind": guided.kind, "spec": guided.spec, "any_whitespace": guided.any_whitespace,
            "param": guided.param}


def guided_from_json(obj: Any) -> GuidedDecoding:
    """GuidedDecoding from wire JSON (ProtocolError on a wrong type)."""
    obj = _object(obj, "guided")
    kind, spec = obj.get("kind"), obj.get("spec", "")
    whitespace, param = obj.get("any_whitespace", False), obj.get("param")
    if not isinstance(kind, str) or not isinstance(spec, str):
        raise ProtocolError("guided", "guided.kind and guided.spec must be strings")
    if not isinstance(whitespace, bool) or not (param is None or isinstance(param, str)):
        raise ProtocolError("guided", "guided.any_whitespace must be a boolean and "
                                      "guided.param a string")
    return GuidedDecoding(kind, spec, whitespace, param)  # SamplingParamsError if invalid


_PARAM_KINDS: dict[str, str] = {
    "n": "int", "temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float",
    "presence_penalty": "float", "frequency_penalty": "float",
    "repetition_penalty": "float", "seed": "int?", "max_tokens": "int?", "min_tokens": "int",
    "ignore_eos": "bool", "logprobs": "int?", "prompt_logprobs": "int?",
}


def params_from_json(obj: Any) -> SamplingParams:
    """SamplingParams from wire JSON; missing fields take their defaults.

    Raises ProtocolError (wrong type, unknown field, n != 1) or SamplingParamsError (out of
    range), each naming the parameter.
    """
    obj = _object(obj, "params")
    unknown = sorted(set(obj) - set(WIRE_PARAMS))
    if unknown:
        raise ProtocolError(unknown[0], f"unknown sampling parameter {unknown[0]!r}")
    values: Json = {}
    for name, kind in _PARAM_KINDS.items():
        if name not in obj:
            continue
        value = obj[name]
        if kind.endswith("?") and value is None:
            values[name] = None
        elif kind.startswith("int"):
            values[name] = _int(value, name)
        elif kind == "float":
            values[name] = _float(value, name)
        else:
            if not isinstance(value, bool):
                raise ProtocolError(name, f"{name} must be true or false")
            values[name] = value
    if "stop_token_ids" in obj:
        values["stop_token_ids"] = _int_list(obj["stop_token_ids"], "stop_token_ids")
    bias = obj.get("logit_bias")
    if bias is not None:
        bias = _object(bias, "logit_bias")
        try:
            values["logit_bias"] = {
                int(k): _float(v, "logit_bias") for k, v in bias.items()
            }
        except ValueError as exc:  # int() of a key that is no number
            if isinstance(exc, ProtocolError):
                raise
            raise ProtocolError("logit_bias", "logit_bias keys must be token ids") from exc
    if obj.get("guided") is not None:
        values["guided"] = guided_from_json(obj["guided"])
    # The HTTP side fans n out into single completions; a replica runs one at a time, so
    # seeds and ids stay under the caller's control.
    if values.get("n", 1) != 1:
        raise ProtocolError("n", "a replica runs one completion per request; n must be 1")
    return SamplingParams(**values)  # validates ranges (SamplingParamsError)


# -- generate -------------------------------------------------------------------------------

#: A pinned prompt prefix: (number of prompt tokens, TTL in seconds). The replica keeps
#: the cached full blocks of that prefix for the TTL, refreshed by every hit.
Pin = tuple[int, float]
#: Anthropic's two prompt-cache lifetimes, in seconds.
TTL_5M, TTL_1H = 300.0, 3600.0
MAX_PINS = 16


def cache_writes(pins: Sequence[Pin], num_cached_tokens: int) -> tuple[int, int]:
    """Prompt tokens a request's pins wrote to the cache: (kept 5 minutes, kept 1 hour).

    The tokens of a pinned prefix past the `num_cached_tokens` read from the cache are
    new writes; each is kept as long as the longest pin that covers it, and a TTL above
    5 minutes counts as the 1-hour kind. Pins are in whole blocks (the caller rounds).
    """
    every = max((n for n, _ in pins), default=0)
    long = max((n for n, ttl in pins if ttl > TTL_5M), default=0)
    written, written_long = max(0, every - num_cached_tokens), max(0, long - num_cached_tokens)
    return written - written_long, written_long


def _pins(value: Any) -> list[Pin]:
    if not isinstance(value, list) or len(value) > MAX_PINS:
        raise ProtocolError("pins", f"pins must be a list of at most {MAX_PINS} pairs")
    pins: list[Pin] = []
    for pair in value:
        if not isinstance(pair, list) or len(pair) != 2:
            raise ProtocolError("pins", "each pin is [num_tokens, ttl_seconds]")
        num_tokens, ttl = _int(pair[0], "pins"), _float(pair[1], "pins")
        if num_tokens < 0 or not 0 < ttl <= TTL_1H:
            raise ProtocolError("pins", "a pin needs num_tokens >= 0 and a ttl_seconds "
                                f"in (0, {TTL_1H:g}]")
        pins.append((num_tokens, ttl))
    return pins


@dataclass
class GenerateRequest:
    """The body of ``POST /v1/engine/generate``."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    priority: int = 0
    pins: list[Pin] = field(default_factory=list)
    #: The LoRA adapter to run with (None: the base model); absent from the body then.
    lora: str | None = None

    def to_json(self) -> Json:
        """The wire body."""
        body: Json = {
            "request_id": self.request_id,
            "prompt_token_ids": self.prompt_token_ids,
            "params": params_to_json(self.params),
            "cache_salt": self.cache_salt,
            "priority": self.priority,
            "pins": [[n, ttl] for n, ttl in self.pins],
        }
        if self.lora is not None:
            body["lora"] = self.lora
        return body

    @classmethod
    def from_json(cls, obj: Any) -> GenerateRequest:
        """Decode and type-check a body (ProtocolError / SamplingParamsError on bad input)."""
        obj = _object(obj, None)
        salt = obj.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ProtocolError("cache_salt", "cache_salt must be a string or null")
        lora = obj.get("lora")
        if lora is not None and not isinstance(lora, str):
            raise ProtocolError("lora", "lora must be a string or null")
        prompt = _int_list(obj.get("prompt_token_ids"), "prompt_token_ids")
        if not prompt:
            raise ProtocolError("prompt_token_ids", "prompt_token_ids is empty")
        return cls(
            request_id=_str(obj.get("request_id"), "request_id"),
            prompt_token_ids=prompt,
            params=params_from_json(obj.get("params", {})),
            cache_salt=salt,
            priority=_int(obj.get("priority", 0), "priority"),
            pins=_pins(obj.get("pins", [])),
            lora=lora,
        )


@dataclass
class TokenLogprob:
    """The sampled token's logprob and its top alternatives as (token id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


class LogprobLike(Protocol):
    """What the engine's TokenLogprobs offers (read-only view, to encode it torch-free)."""

    @property
    def logprob(self) -> float: ...

    @property
    def top(self) -> Sequence[tuple[int, float]]: ...


class CoreOutputLike(Protocol):
    """What the engine's EngineCoreOutput offers; `encode_delta` takes any such object."""

    @property
    def new_token_ids(self) -> Sequence[int]: ...

    @property
    def new_logprobs(self) -> Sequence[LogprobLike] | None: ...

    @property
    def finish_reason(self) -> str | None: ...

    @property
    def stop_reason(self) -> int | str | None: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_cached_tokens(self) -> int: ...


@dataclass
class CoreDelta:
    """One engine step's output for one request, as the HTTP side receives it.

    The same fields as the engine's EngineCoreOutput, so the HTTP side's OutputProcessor
    can consume either. `finish_reason` is "stop", "length", "abort" (the replica aborted
    it: an abort call or a drain past its bound) or None while running.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    queue_time: float | None = None  # seconds, first delta only (see EngineCoreOutput)
    prefill_time: float | None = None
    #: First delta only, when asked for: prompt tokens 1… scored (see EngineCoreOutput).
    prompt_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_json(cls, request_id: str, obj: Any) -> CoreDelta:
        """Decode one stream line (the request id is not on the wire: the caller knows it)."""
        obj = _object(obj, None)
        finish = obj.get("finish_reason")
        if finish not in (None, "stop", "length", "abort"):
            raise ProtocolError("finish_reason", f"unknown finish_reason {finish!r}")
        get = obj.get
        ids, prompt, cached = get("new_token_ids"), get("num_prompt_tokens"), get(
            "num_cached_tokens")
        if (type(ids) is list and type(prompt) is int and type(cached) is int
                and all(type(t) is int for t in ids) and get("new_logprobs") is None
                and get("queue_time") is None and get("prompt_logprobs") is None):
            # A decode step's delta, checked in one pass (a frame holds hundreds of them).
            return cls(request_id, ids, None, finish, get("stop_reason"), prompt, cached)
        return cls(
            request_id=request_id,
            new_token_ids=_int_list(obj.get("new_token_ids"), "new_token_ids"),
            new_logprobs=_logprobs_from_json(obj.get("new_logprobs")),
            finish_reason=finish,
            stop_reason=obj.get("stop_reason"),
            num_prompt_tokens=_int(obj.get("num_prompt_tokens"), "num_prompt_tokens"),
            num_cached_tokens=_int(obj.get("num_cached_tokens"), "num_cached_tokens"),
            queue_time=_optional_float(obj.get("queue_time"), "queue_time"),
            prefill_time=_optional_float(obj.get("prefill_time"), "prefill_time"),
            prompt_logprobs=_logprobs_from_json(obj.get("prompt_logprobs")),
        )


def _logprobs_from_json(raw: Any) -> list[TokenLogprob] | None:
    if raw is None:
        return None
    return [TokenLogprob(float(lp["logprob"]), [(int(t), float(v)) for t, v in lp["top"]])
            for lp in raw]


def _logprobs_to_json(logprobs: Sequence[LogprobLike] | None) -> list[Json] | None:
    if logprobs is None:
        return None
    return [{"logprob": lp.logprob, "top": [[t, v] for t, v in lp.top]} for lp in logprobs]


def encode_delta(out: CoreOutputLike) -> bytes:
    """One NDJSON stream line (with its newline) for an engine step's output."""
    return dumps(delta_json(out)) + b"\n"


def delta_json(out: CoreOutputLike) -> Json:
    """An engine step's output as the JSON object `CoreDelta.from_json` reads."""
    line: Json = {
        "new_token_ids": list(out.new_token_ids),
        "new_logprobs": _logprobs_to_json(out.new_logprobs),
        "finish_reason": out.finish_reason,
        "stop_reason": out.stop_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_cached_tokens": out.num_cached_tokens,
    }
    queue_time = getattr(out, "queue_time", None)
    if queue_time is not None:
        line["queue_time"] = queue_time
        line["prefill_time"] = getattr(out, "prefill_time", None)
    prompt_logprobs = getattr(out, "prompt_logprobs", None)
    if prompt_logprobs is not None:  # only when asked: old readers never see the key
        line["prompt_logprobs"] = _logprobs_to_json(prompt_logprobs)
    return line


def encode_stream_error(message: str, code: str = ENGINE_ERROR) -> bytes:
    """The last line of a stream that failed after it began."""
    return dumps({"error": {"message": message, "code": code}}) + b"\n"
