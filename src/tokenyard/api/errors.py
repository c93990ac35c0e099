"""API errors as plain values, rendered in the OpenAI or in the Anthropic wire shape.

An `APIError` names what went wrong once (HTTP status, message, the parameter at fault, a
machine-readable code, extra headers such as `retry-after`); each route family renders it in
its own shape:

- OpenAI routes: ``{"error": {"message", "type", "param", "code"}}``
- Anthropic routes: ``{"type": "error", "error": {"type", "message"}}`` (+ ``request_id``)

The two APIs disagree on a few statuses: an overloaded server answers 503 on OpenAI routes and
529 on Anthropic routes, whatever status the error was built with.

`APIError` is also an exception, so code deep in a request's parse can `raise` it and the route
catches it once. Nothing here imports torch or touches the network.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

# ---------------------------------------------------------------------------- error codes

# Custom pydantic error types the request schemas raise; `from_validation_error` turns them
# into APIErrors whose `code` is the type and whose message is the schema's own sentence.
UNSUPPORTED_PARAMETER = "unsupported_parameter"
UNSUPPORTED_VALUE = "unsupported_value"
INVALID_VALUE = "invalid_value"
_CUSTOM_TYPES = frozenset({UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, INVALID_VALUE})

#: The `error.type` the OpenAI API uses for each status.
OPENAI_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}

#: The `error.type` the Anthropic API uses for each status.
ANTHROPIC_ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}

#: Anthropic's status for "the service is overloaded" (OpenAI uses 503).
ANTHROPIC_OVERLOADED_STATUS = 529


def openai_error_type(status: int) -> str:
    """The OpenAI `error.type` for an HTTP status (4xx default: invalid_request_error)."""
    found = OPENAI_ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "server_error" if status >= 500 else "invalid_request_error"


def anthropic_error_type(status: int) -> str:
    """The Anthropic `error.type` for an HTTP status (4xx default: invalid_request_error)."""
    if status == 503:
        status = ANTHROPIC_OVERLOADED_STATUS
    found = ANTHROPIC_ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


# ---------------------------------------------------------------------------- the value


class APIError(Exception):
    """One failed request, independent of the API flavour that will render it.

    `type` is the OpenAI-style error type; it defaults from `status`. The Anthropic renderer
    derives its own type from the status. `headers` travel with the response (`retry-after`).
    """

    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type if type is not None else openai_error_type(status)
        self.param = param
        self.code = code
        self.headers: dict[str, str] = dict(headers or {})

    def __repr__(self) -> str:
        return (
            f"APIError(status={self.status}, message={self.message!r}, type={self.type!r}, "
            f"param={self.param!r}, code={self.code!r}, headers={self.headers!r})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, APIError):
            return NotImplemented
        return (
            self.status, self.message, self.type, self.param, self.code, self.headers
        ) == (other.status, other.message, other.type, other.param, other.code, other.headers)

    def __hash__(self) -> int:
        return hash((self.status, self.message, self.type, self.param, self.code))


class RenderedError(NamedTuple):
    """An error ready to send: status, JSON body bytes and headers (content-type included)."""

    status: int
    body: bytes
    headers: dict[str, str]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def openai_error_body(err: APIError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: also an OpenAI stream's error event."""
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def anthropic_message(err: APIError) -> str:
    """The message as Anthropic words it: prefixed with the parameter path when it has one."""
    if err.param and err.param not in err.message:
        return f"{err.param}: {err.message}"
    return err.message


def anthropic_error_body(err: APIError, request_id: str | None = None) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` (+ ``request_id`` when given)."""
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": anthropic_error_type(err.status), "message": anthropic_message(err)},
    }
    if request_id is not None:
        body["request_id"] = request_id
    return body


def openai_status(err: APIError) -> int:
    """The status an OpenAI route answers with (Anthropic's 529 becomes 503)."""
    return 503 if err.status == ANTHROPIC_OVERLOADED_STATUS else err.status


def anthropic_status(err: APIError) -> int:
    """The status an Anthropic route answers with (503 becomes 529, "overloaded")."""
    return ANTHROPIC_OVERLOADED_STATUS if err.status == 503 else err.status


def render_openai(err: APIError) -> RenderedError:
    """Status, body and headers for an OpenAI route."""
    headers = {"content-type": "application/json", **err.headers}
    return RenderedError(openai_status(err), _dumps(openai_error_body(err)), headers)


def render_anthropic(err: APIError, request_id: str | None = None) -> RenderedError:
    """Status, body and headers for an Anthropic route."""
    headers = {"content-type": "application/json", **err.headers}
    body = _dumps(anthropic_error_body(err, request_id))
    return RenderedError(anthropic_status(err), body, headers)


# ---------------------------------------------------------------------------- constructors


def invalid_request(
    message: str, param: str | None = None, code: str | None = None
) -> APIError:
    """400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, message: str | None = None) -> APIError:
    """400 for a parameter the server understands but does not implement yet."""
    text = message or f"'{param}' is not supported by this server yet."
    return APIError(400, text, param=param, code=UNSUPPORTED_PARAMETER)


def malformed_json(detail: str | None = None) -> APIError:
    """400 for a body that is not JSON (or nests deeper than the parser allows)."""
    text = "The request body could not be parsed as JSON"
    text += f" ({detail})." if detail else "."
    return APIError(400, text, code="invalid_json")


def body_too_large(limit_bytes: int, size: int | None = None) -> APIError:
    """413 for a body over the configured cap."""
    got = f" ({size} bytes)" if size is not None else ""
    return APIError(
        413,
        f"The request body{got} exceeds the maximum of {limit_bytes} bytes.",
        code="request_too_large",
    )


def model_not_found(model: str) -> APIError:
    """404 model_not_found (OpenAI types it invalid_request_error; Anthropic not_found_error)."""
    return APIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def not_found(message: str) -> APIError:
    """404 for a route or resource that does not exist."""
    return APIError(404, message, code="not_found")


def context_length_exceeded(
    context_window: int,
    prompt_tokens: int,
    max_tokens: int | None = None,
    param: str = "messages",
) -> APIError:
    """400 context_length_exceeded, naming the window and both token counts."""
    if max_tokens:
        total = prompt_tokens + max_tokens
        text = (
            f"This model's context window is {context_window} tokens, but {total} tokens were "
            f"requested: {prompt_tokens} in the prompt and {max_tokens} for the completion. "
            "Shorten the prompt or lower the completion's maximum length."
        )
    else:
        text = (
            f"This model's context window is {context_window} tokens, but the prompt alone is "
            f"{prompt_tokens} tokens ({prompt_tokens} in the prompt, 0 left for the "
            "completion). Shorten the prompt."
        )
    return APIError(400, text, param=param, code="context_length_exceeded")


def _retry_headers(retry_after_s: float | None) -> dict[str, str]:
    if retry_after_s is None:
        return {}
    return {"retry-after": str(max(1, round(retry_after_s + 0.499)))}


def overloaded(retry_after_s: float | None = 1.0, message: str | None = None) -> APIError:
    """503 on OpenAI routes / 529 on Anthropic routes, with `retry-after` (whole seconds)."""
    return APIError(
        503,
        message or "The server is overloaded; retry after a short wait.",
        type="service_unavailable_error",
        code="server_is_overloaded",
        headers=_retry_headers(retry_after_s),
    )


def authentication_failed(message: str = "Invalid API key.") -> APIError:
    """401 authentication_error."""
    return APIError(401, message, code="invalid_api_key")


def permission_denied(message: str) -> APIError:
    """403 permission_error."""
    return APIError(403, message)


def rate_limited(message: str, retry_after_s: float | None = None) -> APIError:
    """429 rate_limit_error with `retry-after`."""
    return APIError(
        429, message, code="rate_limit_exceeded", headers=_retry_headers(retry_after_s)
    )


def insufficient_quota(message: str) -> APIError:
    """429 insufficient_quota (credit or spend cap exhausted: retrying does not help)."""
    return APIError(429, message, type="insufficient_quota", code="insufficient_quota")


def internal_error(message: str = "The server had an error processing the request.") -> APIError:
    """500 server_error / api_error."""
    return APIError(500, message)


# ---------------------------------------------------------------------------- schema errors


def schema_error(error_type: str, field: str | None, message: str) -> PydanticCustomError:
    """A validation error a request schema raises from a validator.

    `error_type` is one of UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, INVALID_VALUE (it becomes
    the API error's `code`); `field` is appended to the error's location to name the exact
    parameter (validators on a model otherwise report the model's own location).
    """
    # Braces in the message would be read as format fields by pydantic-core.
    safe = message.replace("{", "(").replace("}", ")")
    return PydanticCustomError(error_type, safe, {"field": field} if field else None)


_FIELD_SEGMENT = re.compile(r"[a-z_][a-z0-9_]*|[0-9]+")
# Union-member labels pydantic puts into locations; never field names of ours.
_TYPE_LABELS = frozenset(
    {"str", "int", "float", "bool", "list", "dict", "none", "bytes", "tuple", "set", "literal"}
)


def _clean_loc(loc: tuple[int | str, ...]) -> list[int | str]:
    # Keep field names and list indexes; drop union labels ("str", "list[Part]",
    # "function-after[...]", class names) that pydantic inserts for union members.
    return [
        seg
        for seg in loc
        if isinstance(seg, int) or (_FIELD_SEGMENT.fullmatch(seg) and seg not in _TYPE_LABELS)
    ]


def param_path(loc: tuple[int | str, ...] | list[int | str]) -> str | None:
    """A location as a dotted parameter path ("messages.0.role"), or None for the root."""
    parts = _clean_loc(tuple(loc))
    return ".".join(str(p) for p in parts) or None


def _pick(errors: list[Any]) -> Any:
    # A custom (unsupported/invalid) error explains itself best; otherwise stay with the first
    # failing top-level field and, among the union alternatives tried there, the deepest one.
    for err in errors:
        if err["type"] in _CUSTOM_TYPES:
            return err
    first = errors[0]
    head = first["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == head]
    return max(same, key=lambda e: len(_clean_loc(e["loc"])))


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text else text


def from_validation_error(exc: ValidationError) -> APIError:
    """A pydantic ValidationError as a 400 naming the failing parameter path."""
    errors = exc.errors(include_url=False, include_context=True, include_input=False)
    if not errors:
        return invalid_request("The request body is invalid.")
    err = _pick(errors)
    kind: str = err["type"]
    msg: str = err["msg"]
    loc = tuple(err["loc"])
    ctx = err.get("ctx") or {}
    if kind in _CUSTOM_TYPES and isinstance(ctx.get("field"), str):
        extra = ctx["field"].split(".")
        loc = (*loc, *(int(s) if s.isdigit() else s for s in extra))
    param = param_path(loc)
    if kind == "json_invalid":
        return malformed_json(msg.removeprefix("Invalid JSON: "))
    if param is None and kind in ("model_type", "model_attributes_type", "dict_type"):
        return invalid_request("The request body must be a JSON object.", code="invalid_type")
    if kind in _CUSTOM_TYPES:
        if param and param not in msg:
            msg = f"Invalid '{param}': {msg}"
        return invalid_request(msg, param=param, code=kind)
    if kind == "missing":
        return invalid_request(
            f"Missing required parameter: '{param}'.", param=param,
            code="missing_required_parameter",
        )
    if kind == "too_short" and ctx.get("min_length") == 1:
        return invalid_request(
            f"Invalid value for '{param}': it must not be empty.", param=param,
            code=INVALID_VALUE,
        )
    if kind.endswith("_type") or kind in ("literal_error", "enum", "union_tag_invalid"):
        code = "invalid_type" if kind.endswith("_type") else INVALID_VALUE
        return invalid_request(
            f"Invalid type for '{param}': {_lower_first(msg)}." if code == "invalid_type"
            else f"Invalid value for '{param}': {_lower_first(msg)}.",
            param=param, code=code,
        )
    where = f"'{param}'" if param else "the request body"
    return invalid_request(f"Invalid value for {where}: {_lower_first(msg)}.", param=param,
                           code=INVALID_VALUE)


_M = TypeVar("_M", bound=BaseModel)


def parse_body(model: type[_M], raw: bytes | str, max_bytes: int | None = None) -> _M:
    """Validate a raw JSON body into `model`, raising APIError (400/413) on any client fault.

    Malformed JSON, nesting deeper than the parser's limit, invalid UTF-8, a non-object body,
    wrong types and out-of-range values all become 400s naming the parameter; a body over
    `max_bytes` is a 413 before any parsing.
    """
    size = len(raw)
    if max_bytes is not None and size > max_bytes:
        raise body_too_large(max_bytes, size)
    if not raw.strip():
        raise malformed_json("the body is empty")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
