"""Reading the fleet file's values (`deployments.py`): each reader returns the value in
its expected type or raises `FleetConfigError` naming the field (`where`). A leaf module."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

#: What a region's name may be (a deployment's `region`, an org's allowed regions, `serve
#: --region`): lowercase letters, digits and dashes, as providers name theirs ("eu",
#: "us-east-1", "europe-west4").
REGION_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?")


class FleetConfigError(ValueError):
    """The fleet file is malformed; the message names the field."""


def a_weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (
            math.isfinite(value) and value >= 0):
        raise FleetConfigError(f"{where}: a non-negative number")
    return float(value)


def a_table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FleetConfigError(f"{where}: a table")
    return value


def an_array(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise FleetConfigError(f"{where}: an array")
    return value


def a_string(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise FleetConfigError(f"{where}: a non-empty string")
    return value


def opt_string(value: Any, where: str) -> str | None:
    return None if value is None else a_string(value, where)


def only_fields(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        raise FleetConfigError(f"{where}: unknown field(s) {', '.join(unknown)}")


def valid_region(name: object) -> bool:
    """Whether `name` is a region name (`REGION_NAME`)."""
    return isinstance(name, str) and REGION_NAME.fullmatch(name) is not None


def opt_region(value: Any, where: str) -> str | None:
    """A region name, or None where the field is left out."""
    if value is None:
        return None
    if not valid_region(value):
        raise FleetConfigError(f"{where}: a region name (lowercase letters, digits and "
                               f"dashes, e.g. \"eu\" or \"us-east-1\"), not {value!r}")
    return str(value)


def a_blocklist_pattern(pattern: str, where: str) -> re.Pattern[str]:
    """A moderation blocklist's regular expression, compiled as its classifier matches it:
    on its own, so that its inline flags (a leading ``(?i)``, ``(?s)``…) apply to it alone,
    and case-insensitively. One that cannot compile is a `FleetConfigError` naming it."""
    try:
        return re.compile(pattern, re.IGNORECASE)
    except (re.error, OverflowError, RecursionError) as exc:
        raise FleetConfigError(f"{where}: {pattern!r} is not a valid regular expression "
                               f"({exc})") from None


@dataclass(frozen=True)
class PriceSpec:
    """Micros per million tokens (the store's unit); read from decimal currency units."""

    input: int = 0
    cached_input: int = 0
    output: int = 0


def price_spec(value: Any, where: str) -> PriceSpec:
    """A price table ({input, cached_input, output}: decimal amounts per million
    tokens) as micros."""
    table = a_table(value, where)
    only_fields(table, {"input", "cached_input", "output"}, where)
    out = {}
    for name, amount in table.items():
        try:
            micros = Decimal(str(amount)) * 1_000_000
        except InvalidOperation:
            raise FleetConfigError(f"{where}.{name}: a decimal amount per million "
                                   "tokens") from None
        if micros < 0 or micros != micros.to_integral_value():
            raise FleetConfigError(f"{where}.{name}: non-negative, at most 6 decimals")
        out[name] = int(micros)
    return PriceSpec(**out)
