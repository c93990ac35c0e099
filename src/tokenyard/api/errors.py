"""API errors as plain values, rendered in the OpenAI or in the Anthropic wire shape.

An `APIError` names what went wrong once (HTTP status, message, the parameter at fault, a
machine-readable code, extra headers such as `retry-after`); each route family renders it in
its own shape:

- OpenAI routes: ``{"error": {"message", "type", "param", "code"}}``
- Anthropic routes: ``{"type": "error", "error": {"type", "message"}, "request_id"}``

The two APIs disagree on a few statuses: an overloaded server answers 503 on OpenAI routes and
529 on Anthropic routes, whatever status the error was built with.

`APIError` is also an exception, so code deep in a request's parse can `raise` it and the route
catches it once. Nothing here imports torch or touches the network.
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple, TypeVar

import orjson
from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from tokenyard.errors import (
    INVALID_VALUE,
    UNSUPPORTED_PARAMETER,
    UNSUPPORTED_VALUE,
    APIError,
    body_too_large,
    invalid_request,
    malformed_json,
)

# Custom pydantic error types the request schemas raise; `from_validation_error` turns them
# into APIErrors whose `code` is the type and whose message is the schema's own sentence.
_CUSTOM_TYPES = frozenset({UNSUPPORTED_PARAMETER, UNSUPPORTED_VALUE, INVALID_VALUE})

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
#: Anthropic's status for a billing_error (OpenAI answers 429 insufficient_quota).
ANTHROPIC_BILLING_STATUS = 402


def anthropic_error_type(status: int) -> str:
    """The Anthropic `error.type` for an HTTP status (4xx default: invalid_request_error)."""
    if status == 503:
        status = ANTHROPIC_OVERLOADED_STATUS
    found = ANTHROPIC_ERROR_TYPES.get(status)
    if found is not None:
        return found
    return "api_error" if status >= 500 else "invalid_request_error"


class RenderedError(NamedTuple):
    """An error ready to send: status, JSON body bytes and headers (content-type included)."""

    status: int
    body: bytes
    headers: dict[str, str]


def _dumps(obj: Any) -> bytes:
    return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)


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
    """``{"type": "error", "error": {"type", "message"}, "request_id"}``: the spec's
    `ErrorResponse` requires `request_id`, null when the request has none."""
    return {
        "type": "error",
        "error": {"type": anthropic_error_type(anthropic_status(err)),
                  "message": anthropic_message(err)},
        "request_id": request_id,
    }


def openai_status(err: APIError) -> int:
    """The status an OpenAI route answers with (Anthropic's 529 becomes 503)."""
    return 503 if err.status == ANTHROPIC_OVERLOADED_STATUS else err.status


def anthropic_status(err: APIError) -> int:
    """The status an Anthropic route answers with: 503 becomes 529 ("overloaded"), and an
    exhausted credit, cap or budget (OpenAI's 429 insufficient_quota) 402, Anthropic's
    billing_error, which its SDK does not retry as it does a 429."""
    if err.code == "insufficient_quota":
        return ANTHROPIC_BILLING_STATUS
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
    """`text` as a clause inside a sentence of ours: lower first letter, no final period
    (the sentence adds its own: a message never ends in '..')."""
    text = text.rstrip().removesuffix(".")
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
        # isdigit() alone holds for "¹" too, which int() refuses: ASCII digits only.
        loc = (*loc, *(int(s) if s.isascii() and s.isdigit() else s for s in extra))
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
        parsed = model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    _refuse_duplicate_keys(raw)
    return parsed


class _DuplicateKey(ValueError):
    pass


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return out


def _refuse_duplicate_keys(raw: bytes | str) -> None:
    """400 for an object with a key twice. The validator keeps the last one silently, so
    a body that says two things (a model allowed, then another) would be read as one of
    them; a second parse, only of bodies that validated, tells (about 10 µs for a
    typical 2 KB chat body, beside milliseconds of request CPU)."""
    try:
        json.loads(raw, object_pairs_hook=_unique_object)
    except _DuplicateKey as exc:
        raise malformed_json(f"the key {str(exc)!r} appears twice in one object") from None
    except ValueError:  # what the validator accepted and json does not: let it stand
        pass
