"""When a deployment's local replicas run: always (started with `tokenyard serve`), or on
demand (started by the first request, stopped when idle), and how many on-demand models
one host keeps resident. A leaf, like `deployments.py`, which calls `on_demand_spec` on
each deployment's table and `models_spec` on the file's `[models]` table.

    [models]
    max_resident_models = 2        # on-demand models loaded at once on this host; the
                                   # least recently used idle one is unloaded for another
    [[deployments]]
    name = "qwen-2026-11-01"
    replicas = 1
    load = "on_demand"             # "always" (the default) or "on_demand"
    idle_unload_s = 300            # stop its replicas after this long without a request
    load_timeout_s = 60            # the longest a request waits for its load
    pinned = false                 # true: never unloaded (idle or for another's room)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tokenyard.fleet_values import FleetConfigError, a_table, only_fields

LOADS = ("always", "on_demand")
_FIELDS = ("load", "idle_unload_s", "load_timeout_s", "pinned")
#: An on-demand model's idle time before it is unloaded, unless its entry says.
DEFAULT_IDLE_UNLOAD_S = 300.0
#: The longest a request waits for its model's load, unless its entry says.
DEFAULT_LOAD_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class OnDemandSpec:
    """A deployment whose local replicas start on its first request and stop when idle."""

    idle_unload_s: float = DEFAULT_IDLE_UNLOAD_S
    load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S
    #: Never unloaded, neither when idle nor to make room for another model.
    pinned: bool = False


@dataclass(frozen=True)
class ModelsSpec:
    """The fleet file's `[models]`: the host's budget of resident on-demand models."""

    #: On-demand models loaded (or loading) at once; None: no limit. Always-loaded
    #: deployments are not counted: they are never unloaded.
    max_resident_models: int | None = None


def _seconds(value: Any, where: str, *, above_zero: bool = True) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not math.isfinite(value) or value < 0 or (above_zero and value == 0)):
        raise FleetConfigError(f"{where}: a positive number of seconds, not {value!r}")
    return float(value)


def on_demand_spec(item: Mapping[str, Any], where: str) -> tuple[dict[str, Any],
                                                                 OnDemandSpec | None]:
    """Take the load fields out of a deployment's table: (the rest, its on-demand spec, or
    None for one loaded always). Only local replicas (`replicas`, no `urls`, no Ray) can
    be loaded on demand: tokenyard starts and stops them itself."""
    rest = {k: v for k, v in item.items() if k not in _FIELDS}
    load = item.get("load", "always")
    if load not in LOADS:
        raise FleetConfigError(f"{where}.load: one of {', '.join(LOADS)}, not {load!r}")
    if load == "always":
        extra = sorted(set(_FIELDS[1:]) & item.keys())
        if extra:
            raise FleetConfigError(f"{where}: {', '.join(extra)} only with "
                                   "load = \"on_demand\"")
        return rest, None
    if item.get("kind", "engine") != "engine":
        raise FleetConfigError(f"{where}.load: \"on_demand\" is for engine deployments "
                               "(an embeddings model's replicas run always)")
    if item.get("urls") or item.get(
            "placement", "local") != "local":
        raise FleetConfigError(f"{where}.load: \"on_demand\" starts and stops local "
                               "replicas ('replicas' = N); it lists no urls and is not "
                               "placed by Ray")
    pinned = item.get("pinned", False)
    if not isinstance(pinned, bool):
        raise FleetConfigError(f"{where}.pinned: true or false, not {pinned!r}")
    return rest, OnDemandSpec(
        idle_unload_s=_seconds(item.get("idle_unload_s", DEFAULT_IDLE_UNLOAD_S),
                               f"{where}.idle_unload_s"),
        load_timeout_s=_seconds(item.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S),
                                f"{where}.load_timeout_s"),
        pinned=pinned)


def models_spec(value: Any) -> ModelsSpec:
    """The `[models]` table (absent: no limit)."""
    table = a_table(value, "models")
    only_fields(table, {"max_resident_models"}, "models")
    most = table.get("max_resident_models")
    if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < 1):
        raise FleetConfigError(f"models.max_resident_models: a positive integer, not {most!r}")
    return ModelsSpec(most)
