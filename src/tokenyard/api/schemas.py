"""What both dialects' request schemas share: the strict base model, how a top-level
field is refused by name (unknown, or documented but not implemented), and how a
message's text parts are joined into the chat template's single string."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from tokenyard.api.errors import schema_error
from tokenyard.errors import UNSUPPORTED_PARAMETER

#: How several text parts of one message are joined into the template's single string.
TEXT_PART_SEPARATOR = "\n"


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
