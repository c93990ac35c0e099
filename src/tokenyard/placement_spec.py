"""Where an engine deployment's replicas run when tokenyard does not start them itself: the
fleet file's placement fields, read into plain values (a leaf, like `deployments.py`,
which calls `ray_placement` on each deployment's table).

    [[deployments]]
    name = "smollm2-135m-instruct-2026-11-22"
    kind = "engine"
    placement = "ray"              # replicas are Ray actors (cli/ray_replicas.py)
    ray_address = "auto"           # the cluster's GCS, HEAD:6379 (default: RAY_ADDRESS, else
                                   # "auto"); not Ray Client's ray://
    replicas = 2                   # started when the deployment has none yet
    min_replicas = 1               # the range `tokenyard admin replicas scale` keeps to
    max_replicas = 4
    resources = { num_cpus = 2, num_gpus = 0, custom = { cpu_host = 1 } }
    # Between min and max by the replicas' own figures (cli/ray_autoscale.py): queued plus
    # running requests per replica, the fullest KV cache; looked at every interval_s, no
    # change within cooldown_s of the last one.
    autoscale = { target_work = 8, kv_target = 0.9, interval_s = 5, cooldown_s = 60 }
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tokenyard.fleet_values import FleetConfigError, a_table, a_weight, only_fields, opt_string

PLACEMENTS = ("local", "ray")
_FIELDS = ("placement", "ray_address", "min_replicas", "max_replicas", "resources",
           "autoscale")
MAX_REPLICAS = 64


@dataclass(frozen=True)
class Autoscale:
    """When a Ray-placed deployment grows or shrinks (`cli/ray_autoscale.py`)."""

    #: Requests running or queued per replica the deployment aims at.
    target_work: float = 8.0
    #: The KV-cache use (0..1) of the fullest replica beyond which it grows (None: not
    #: a signal).
    kv_target: float | None = None
    interval_s: float = 5.0
    cooldown_s: float = 60.0


@dataclass(frozen=True)
class RayPlacement:
    """An engine deployment whose replicas are Ray actors."""

    replicas: int
    min_replicas: int
    max_replicas: int
    #: The cluster's address (None: `RAY_ADDRESS`, else "auto": the local node's cluster).
    address: str | None = None
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    #: Custom resources one replica takes (a host class a cluster's nodes declare).
    custom: Mapping[str, float] = field(default_factory=dict)
    autoscale: Autoscale | None = None

    def check(self, count: int) -> None:
        """ValueError unless `count` replicas are within the deployment's range."""
        if not self.min_replicas <= count <= self.max_replicas:
            raise ValueError(f"replicas: from {self.min_replicas} to {self.max_replicas}, "
                             f"not {count}")


def _count(value: Any, where: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not (
            least <= value <= MAX_REPLICAS):
        raise FleetConfigError(f"{where}: an integer from {least} to {MAX_REPLICAS}")
    return value




def ray_placement(item: Mapping[str, Any], where: str) -> tuple[dict[str, Any],
                                                                 RayPlacement | None]:
    """Take the placement fields out of a deployment's table: (the rest, the Ray placement
    or None for local and listed replicas). Under Ray, `replicas` counts actors (taken
    out too: `tokenyard serve` starts no local children for it)."""
    rest = {k: v for k, v in item.items() if k not in _FIELDS}
    placement = item.get("placement", "local")
    if placement not in PLACEMENTS:
        raise FleetConfigError(f"{where}.placement: one of {', '.join(PLACEMENTS)}, "
                               f"not {placement!r}")
    if placement == "local":
        extra = sorted(set(_FIELDS[1:]) & item.keys())
        if extra:
            raise FleetConfigError(f"{where}: {', '.join(extra)} only with placement = \"ray\"")
        return rest, None
    if item.get("kind", "engine") != "engine" or item.get("urls"):
        raise FleetConfigError(f"{where}.placement: \"ray\" places engine replicas; "
                               "it lists no urls")
    replicas = _count(rest.pop("replicas", 1), f"{where}.replicas", 1)
    low = _count(item.get("min_replicas", 1), f"{where}.min_replicas", 1)
    high = _count(item.get("max_replicas", max(replicas, low)), f"{where}.max_replicas", 1)
    if not low <= replicas <= high:
        raise FleetConfigError(f"{where}: needs min_replicas <= replicas <= max_replicas")
    resources = a_table(item.get("resources", {}), f"{where}.resources")
    only_fields(resources, {"num_cpus", "num_gpus", "custom"}, f"{where}.resources")
    custom = a_table(resources.get("custom", {}), f"{where}.resources.custom")
    address = opt_string(item.get("ray_address"), f"{where}.ray_address")
    if address is not None and address.startswith("ray://"):
        # Ray Client is not installed (the `ray` extra is Ray's core), and a gateway is a
        # driver of the cluster: it joins through the GCS address.
        raise FleetConfigError(f"{where}.ray_address: Ray Client (ray://) is not supported; "
                               "give the cluster's GCS address (HEAD:6379) or auto")
    return rest, RayPlacement(
        replicas, low, high, address,
        a_weight(resources.get("num_cpus", 1), f"{where}.resources.num_cpus"),
        a_weight(resources.get("num_gpus", 0), f"{where}.resources.num_gpus"),
        {k: a_weight(v, f"{where}.resources.custom.{k}") for k, v in custom.items()},
        _autoscale(item["autoscale"], f"{where}.autoscale") if "autoscale" in item else None)


def _autoscale(value: Any, where: str) -> Autoscale:
    table = a_table(value, where)
    only_fields(table, set(Autoscale.__dataclass_fields__), where)
    numbers = {k: a_weight(v, f"{where}.{k}") for k, v in table.items()}
    rule = Autoscale(**numbers)
    if not rule.target_work > 0 or not rule.interval_s > 0 or (
            rule.kv_target is not None and not 0 < rule.kv_target <= 1):
        raise FleetConfigError(f"{where}: target_work and interval_s above 0, kv_target "
                               "in (0, 1]")
    return rule
