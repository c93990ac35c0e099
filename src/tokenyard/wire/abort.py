"""The abort and stop messages on the wire: ``POST /v1/engine/abort`` (and its
`AbortReport`), ``POST /v1/engine/stop``.

The paths and field checks are in `wire/protocol.py`; like it, this module stays free
of torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenyard.wire.protocol import Json, ProtocolError, _int, _object, _str


def abort_body(request_id: str) -> Json:
    """The body of ``POST /v1/engine/abort``."""
    return {"request_id": request_id}


@dataclass(frozen=True)
class AbortReport:
    """What an aborted request had used on its replica when the abort reached it.

    A request cut before its first output (the client left during its prefill) has no
    delta that says so, yet the prompt tokens it prefilled ran through the model and stay
    in the prefix cache: the HTTP side bills them from this report.
    """

    num_prompt_tokens: int  # prompt tokens computed (prefilled), cached ones included
    num_cached_tokens: int  # of them, read from the prefix cache
    num_output_tokens: int = 0  # tokens sampled before the abort

    def to_json(self) -> Json:
        return {"num_prompt_tokens": self.num_prompt_tokens,
                "num_cached_tokens": self.num_cached_tokens,
                "num_output_tokens": self.num_output_tokens}

    @classmethod
    def from_answer(cls, obj: Any) -> AbortReport | None:
        """The report in an abort's answer (None: the replica no longer held the request,
        or it does not report; ProtocolError on a malformed figure)."""
        if not isinstance(obj, dict) or "num_prompt_tokens" not in obj:
            return None
        figures = [_int(obj.get(name, 0), name) for name in
                   ("num_prompt_tokens", "num_cached_tokens", "num_output_tokens")]
        if min(figures) < 0:
            raise ProtocolError(None, f"negative token counts in an abort's answer: {figures}")
        return cls(*figures)


def abort_answer(report: AbortReport | None) -> Json:
    """The answer of ``POST /v1/engine/abort``: ok, and the report if there is one."""
    return {"ok": True, **(report.to_json() if report is not None else {})}


def stop_body(request_id: str, stop: str) -> Json:
    """The body of ``POST /v1/engine/stop``."""
    return {"request_id": request_id, "stop": stop}


def decode_abort(obj: Any) -> str:
    """The request id of an abort body."""
    return _str(_object(obj, None).get("request_id"), "request_id")


def decode_stop(obj: Any) -> tuple[str, str]:
    """(request id, stop string) of a stop body."""
    obj = _object(obj, None)
    return _str(obj.get("request_id"), "request_id"), _str(obj.get("stop"), "stop")
