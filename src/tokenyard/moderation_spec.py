"""A deployment's `moderation` table in the fleet file: the policy per direction and the
classifier, read and checked. A leaf module, like `deployments` which uses it.

    moderation = { input = "block", output = "flag", classifier = "blocklist",
                   patterns = { insult = ["(?i)idiot"] } }
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenyard.fleet_values import (
    FleetConfigError,
    a_blocklist_pattern,
    a_string,
    a_table,
    a_weight,
    an_array,
    only_fields,
    opt_string,
)

#: Moderation policies, in order of strictness; classifiers a deployment may name.
MODERATION_MODES = ("off", "flag", "block")
CLASSIFIERS = ("local", "blocklist", "upstream")


@dataclass(frozen=True)
class ModerationSpec:
    """A deployment's `moderation` table: a policy per direction (off, flag: recorded,
    never delaying the request; block: refused or stopped) and the classifier to use."""

    input: str = "off"
    output: str = "off"
    classifier: str = "local"
    #: local: the probability from which a text is flagged.
    threshold: float = 0.5
    #: blocklist: (category, regular expressions) pairs, matched case-insensitively.
    patterns: tuple[tuple[str, tuple[str, ...]], ...] = ()
    #: upstream: the base URL (ending in /v1), the model asked for, its key's variable.
    url: str | None = None
    model: str | None = None
    token_env: str | None = None
    #: output: characters of streamed text held back until checked.
    window: int = 32


def moderation_spec(value: Any, where: str) -> ModerationSpec:
    """A deployment's `moderation` table, checked (FleetConfigError names the field)."""
    table = a_table(value, where)
    only_fields(table, set(ModerationSpec.__dataclass_fields__), where)
    for name in ("input", "output"):
        if table.get(name, "off") not in MODERATION_MODES:
            raise FleetConfigError(f"{where}.{name}: one of {', '.join(MODERATION_MODES)}")
    classifier = table.get("classifier", "local")
    if classifier not in CLASSIFIERS:
        raise FleetConfigError(f"{where}.classifier: one of {', '.join(CLASSIFIERS)}")
    patterns = tuple(
        (category, tuple(a_string(p, f"{where}.patterns.{category}[]")
                         for p in an_array(items, f"{where}.patterns.{category}")))
        for category, items in a_table(table.get("patterns", {}), f"{where}.patterns").items())
    for category, regexes in patterns:
        for regex in regexes:  # compiled as the classifier will (an error names the name)
            a_blocklist_pattern(regex, f"{where}.patterns.{category}")
    if classifier == "blocklist" and not patterns:
        raise FleetConfigError(f"{where}.patterns: a blocklist needs patterns per category")
    if classifier == "upstream" and not table.get("url"):
        raise FleetConfigError(f"{where}.url: an upstream classifier needs its base URL")
    threshold = a_weight(table.get("threshold", 0.5), f"{where}.threshold")
    window = table.get("window", 32)
    if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= 4096:
        raise FleetConfigError(f"{where}.window: an integer from 1 to 4096")
    return ModerationSpec(
        input=table.get("input", "off"), output=table.get("output", "off"),
        classifier=classifier, threshold=threshold, patterns=patterns,
        url=opt_string(table.get("url"), f"{where}.url"),
        model=opt_string(table.get("model"), f"{where}.model"),
        token_env=opt_string(table.get("token_env"), f"{where}.token_env"), window=window,
    )
