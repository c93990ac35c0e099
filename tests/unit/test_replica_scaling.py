"""`/admin/v1/deployments/{name}/replicas` (`api/replica_scaling.py`): what it refuses
before it asks Ray, each in the admin API's error shape (an APIError: status, message,
param, code). Through HTTP on a Ray cluster: tests/integration/test_ray_gateway.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from tokenyard.api.replica_scaling import ray_placed, wanted_count
from tokenyard.deployments import parse_fleet
from tokenyard.errors import APIError

FLEET = parse_fleet({"deployments": [
    {"name": "on-ray", "placement": "ray", "replicas": 1, "max_replicas": 3},
    {"name": "listed", "urls": ["http://10.0.0.7:8001"]},
]})
SERVED = cast(Any, {n: SimpleNamespace(spec=s) for n, s in FLEET.deployments.items()})


def test_a_ray_placed_deployment_is_found() -> None:
    assert ray_placed(SERVED, "on-ray").spec.name == "on-ray"


def test_an_unknown_deployment_is_404() -> None:
    with pytest.raises(APIError) as caught:
        ray_placed(SERVED, "missing")
    assert (caught.value.status, caught.value.code) == (404, "not_found")
    assert "'missing'" in caught.value.message


def test_a_deployment_not_placed_by_ray_is_409() -> None:
    with pytest.raises(APIError) as caught:
        ray_placed(SERVED, "listed")
    assert (caught.value.status, caught.value.code) == (409, "not_ray_placed")
    assert caught.value.type == "conflict_error"


@pytest.mark.parametrize("count", [1, 2, 3])
def test_a_count_in_range_is_taken(count: int) -> None:
    assert wanted_count(FLEET.deployments["on-ray"], {"replicas": count}) == count


@pytest.mark.parametrize(("body", "reason"), [
    ({"replicas": 0}, "on-ray: replicas: from 1 to 3, not 0."),
    ({"replicas": 4}, "on-ray: replicas: from 1 to 3, not 4."),
    ({"replicas": True}, "'replicas' must be an integer."),
    ({"replicas": 2.0}, "'replicas' must be an integer."),
    ({"replicas": "2"}, "'replicas' must be an integer."),
    ({}, "'replicas' must be an integer."),
])
def test_a_bad_count_is_400_naming_replicas(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(APIError) as caught:
        wanted_count(FLEET.deployments["on-ray"], body)
    assert (caught.value.status, caught.value.param, caught.value.message) == (
        400, "replicas", reason)
