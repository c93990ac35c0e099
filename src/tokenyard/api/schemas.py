"""What both dialects' request schemas share: the strict base model, how a top-level
field is refused by name (unknown, or documented but not implemented), and how a
message's text parts are joined into the chat template's single string."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from tokenyard.api.errors import schema_error
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_PARAMETER, invalid_request
from tokenyard.text.stop import MAX_STOP_LENGTH

#: How several text parts of one message are joined into the template's single string.
TEXT_PART_SEPARATOR = "\n"

# The body cap bounds every string of a request, and what the model reads (messages, tools,
# schemas) is bounded again by its context window. What it never reads (the model's name,
# the identifiers and tags kept, logged or compared with the request) is bounded on its own,
# as the API's spec bounds it where it does (tests/unit/test_string_bounds.py holds every
# string field of the request schemas to one or the other).

#: The longest model (or deployment) name a request may name; served names are far shorter.
MAX_MODEL_LENGTH = 256
#: The longest opaque identifier a client attaches (an end user's, a workspace's, a stored
#: response's id), as Anthropic bounds `metadata.user_id`.
MAX_ID_LENGTH = 512

ModelName = Annotated[str, Field(max_length=MAX_MODEL_LENGTH)]
Identifier = Annotated[str, Field(max_length=MAX_ID_LENGTH)]
#: One stop string (OpenAI's `stop`, Anthropic's `stop_sequences`); their number is
#: SamplingParams' to bound.
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]


class RequestModel(BaseModel):
    """Base of every request body: strict types, finite numbers. Unknown fields of nested
    objects are ignored (an SDK's own response objects sent back as messages carry extra
    ones); a request's top level refuses them (`reject_unknown`)."""

    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


def reject_unknown(data: Any, known: Iterable[str]) -> None:
    """Refuse a request whose top level has a field no route knows, naming it, as OpenAI
    and Anthropic do: a misspelt or unsupported parameter is never silently dropped."""
    if not isinstance(data, dict):
        return
    names = set(known)
    for name in data:
        if name not in names:
            raise schema_error(UNSUPPORTED_PARAMETER, str(name),
                               f"Unrecognized request argument supplied: {name}")


#: Whether a documented field's value is one this server can serve (else a 400 naming it).
Acceptable = Callable[[Any], bool]


def is_none(value: Any) -> bool:
    """Acceptable when absent or null only."""
    return value is None


def none_or_empty(value: Any) -> bool:
    """Acceptable when absent, null or an empty list."""
    return value is None or value == []


def reject_unsupported(data: Any, accepted: Mapping[str, Acceptable],
                       what: str = "parameter") -> None:
    """Refuse, naming it, the first documented field of `data` whose value this server
    does not implement (`accepted[name](value)` false): a client asking for a feature
    must learn it is missing rather than get an answer without it."""
    if not isinstance(data, dict):
        return
    for name, ok in accepted.items():
        if name in data and not ok(data[name]):
            raise schema_error(UNSUPPORTED_PARAMETER, name,
                               f"The '{name}' {what} is not supported by this server yet.")


def page_limit(query: Mapping[str, str], default: int, most: int) -> int:
    """A list route's `limit` query parameter: `default` when absent, else a whole number
    from 1 to `most` (a 400 naming `limit` otherwise)."""
    raw = query.get("limit")
    if raw is None:
        return default
    limit = int(raw) if raw.isdigit() else 0
    if not 1 <= limit <= most:
        raise invalid_request(
            f"Invalid 'limit': expected a whole number from 1 to {most}, got {raw!r}.",
            param="limit", code=INVALID_VALUE)
    return limit

