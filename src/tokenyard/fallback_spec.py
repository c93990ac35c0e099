"""A deployment's or an alias's fallbacks in the fleet file, read and checked. A leaf
module, like `deployments` which uses it; `gateway/fallbacks.py` runs them.

    [[deployments]]
    name = "small-2026-11-01"
    fallbacks = ["big-2026-11-01", "smollm2"]   # deployments or aliases, tried in order
    fallback_on = ["rate_limit", "server_error", "timeout"]   # default: every condition
    first_byte_timeout_s = 20                   # default: no bound

    [aliases.chat]
    route = { "small-2026-11-01" = 1 }
    fallbacks = ["big-2026-11-01"]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenyard.fleet_values import FleetConfigError, a_string, an_array

#: What sends a request on to the next candidate, each before the first byte of the
#: answer: the deployment (a replica or its upstream) is full or rate limited (429,
#: 503); it failed (another 5xx, unreachable); it sent nothing within
#: `first_byte_timeout_s`; the request does not fit its context window; its input
#: moderation or its upstream refused the content.
CONDITIONS = ("rate_limit", "server_error", "timeout", "context_length", "content_policy")
#: The fleet file's fields of a deployment or an alias table that this module reads.
FIELDS = ("fallbacks", "fallback_on", "first_byte_timeout_s")
#: The most fallbacks one name (or one request) may list: each is a whole attempt.
MAX_FALLBACKS = 8


@dataclass(frozen=True)
class FallbackSpec:
    """Where a request for a name goes when it fails there before its first byte."""

    #: Deployments or aliases tried in order after the name itself.
    to: tuple[str, ...] = ()
    #: The conditions (of CONDITIONS) that send it on.
    on: frozenset[str] = frozenset(CONDITIONS)
    #: How long to wait for the first byte before trying the next (None: no bound).
    first_byte_timeout_s: float | None = None


def fallback_spec(item: Mapping[str, Any], where: str
                  ) -> tuple[dict[str, Any], FallbackSpec | None]:
    """`item` without its fallback fields, and them checked (None: it names none)."""
    rest = {k: v for k, v in item.items() if k not in FIELDS}
    if not any(name in item for name in FIELDS):
        return rest, None
    to = tuple(a_string(n, f"{where}.fallbacks[]")
               for n in an_array(item.get("fallbacks", []), f"{where}.fallbacks"))
    if len(to) > MAX_FALLBACKS:
        raise FleetConfigError(f"{where}.fallbacks: at most {MAX_FALLBACKS} names")
    if len(set(to)) != len(to):
        raise FleetConfigError(f"{where}.fallbacks: a name is listed twice")
    on = frozenset(a_string(c, f"{where}.fallback_on[]")
                   for c in an_array(item.get("fallback_on", list(CONDITIONS)),
                                     f"{where}.fallback_on"))
    if on - set(CONDITIONS):
        raise FleetConfigError(f"{where}.fallback_on: unknown {sorted(on - set(CONDITIONS))}"
                               f"; known: {', '.join(CONDITIONS)}")
    timeout = item.get("first_byte_timeout_s")
    if timeout is not None and (isinstance(timeout, bool)
                                or not isinstance(timeout, int | float)
                                or not math.isfinite(timeout) or timeout <= 0):
        raise FleetConfigError(f"{where}.first_byte_timeout_s: a positive number of seconds")
    return rest, FallbackSpec(to, on, None if timeout is None else float(timeout))


def check_fallbacks(deployments: Mapping[str, Any], aliases: Mapping[str, Any]) -> None:
    """Each fallback of a deployment (`DeploymentSpec`s) or an alias (`AliasSpec`s) is
    another name of the fleet, and both generate text (an embeddings deployment cannot
    stand in for a chat one, nor the other way round)."""
    generating = {n: s.kind != "embeddings" for n, s in deployments.items()} | {
        n: all(deployments[t].kind != "embeddings" for t, _ in a.routes)
        for n, a in aliases.items()}
    for kind, named in (("deployments", deployments), ("aliases", aliases)):
        for name, spec in named.items():
            where = f"{kind} ({name}).fallbacks"
            for target in spec.fallbacks.to if spec.fallbacks is not None else ():
                if target == name:
                    raise FleetConfigError(f"{where}: '{name}' cannot fall back to itself")
                if target not in generating:
                    raise FleetConfigError(f"{where}: '{target}' is not a deployment or "
                                           "an alias")
                if not generating[target] or not generating[name]:
                    raise FleetConfigError(f"{where}: '{target}': only a generating "
                                           "deployment or alias falls back or is fallen "
                                           "back to")
