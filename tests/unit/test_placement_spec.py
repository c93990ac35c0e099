"""The fleet file's placement fields (`placement_spec.py`): `placement = "ray"` reads the
replica range and per-replica resources, refuses what cannot be placed, and leaves local
and listed replicas as they were."""

from __future__ import annotations

from typing import Any

import pytest

from tokenyard.deployments import parse_fleet
from tokenyard.fleet_values import FleetConfigError
from tokenyard.placement_spec import RayPlacement


def _one(**fields: Any) -> Any:
    return parse_fleet({"deployments": [{"name": "m", **fields}]}).deployments["m"]


def test_ray_placement_reads_range_address_and_resources() -> None:
    spec = _one(placement="ray", ray_address="head:6379", replicas=2, min_replicas=1,
                max_replicas=4, resources={"num_cpus": 2, "num_gpus": 1,
                                           "custom": {"cpu_host": 0.5}})
    assert spec.replicas == 0  # no local children: the replicas are Ray actors
    assert spec.ray == RayPlacement(2, 1, 4, "head:6379", 2.0, 1.0, {"cpu_host": 0.5})
    assert _one(placement="ray").ray == RayPlacement(1, 1, 1)
    assert _one(replicas=1).ray is None and _one(urls=["http://x:1"]).ray is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"placement": "k8s"}, "placement: one of local, ray"),
    ({"placement": "ray", "replicas": 5, "max_replicas": 3}, "min_replicas <= replicas"),
    ({"placement": "ray", "replicas": 0}, "replicas: an integer from 1"),
    ({"placement": "ray", "urls": ["http://x:1"]}, "lists no urls"),
    ({"placement": "ray", "kind": "upstream", "model": "x"}, "places engine replicas"),
    ({"placement": "ray", "resources": {"num_gpu": 1}}, "unknown field"),
    ({"placement": "ray", "resources": {"custom": {"h": -1}}}, "custom.h: a non-negative"),
    ({"replicas": 1, "max_replicas": 3}, 'only with placement = "ray"'),
    ({"placement": "ray", "ray_address": "ray://head:10001"}, r"Ray Client \(ray://\)"),
])
def test_bad_placement_is_refused_with_the_field_named(fields: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(FleetConfigError, match=message):
        _one(**fields)


def test_scale_stays_within_the_range() -> None:
    placement = RayPlacement(2, 1, 3)
    placement.check(1)
    placement.check(3)
    for count in (0, 4):
        with pytest.raises(ValueError, match="from 1 to 3"):
            placement.check(count)
