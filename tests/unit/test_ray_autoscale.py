"""Autoscaling a Ray-placed deployment (`cli/ray_autoscale.py`, `placement_spec.Autoscale`):
the replicas wanted follow the queued plus running work per replica and the fullest KV
cache, within min..max, with a cooldown between changes. The loop on a Ray cluster is
tests/integration/test_ray_placement.py's."""

from __future__ import annotations

import pytest

from tokenyard.cli.ray_autoscale import Decider, wanted
from tokenyard.deployments import parse_fleet
from tokenyard.fleet_values import FleetConfigError
from tokenyard.placement_spec import Autoscale

RULE = Autoscale(target_work=4, kv_target=0.9, interval_s=1, cooldown_s=10)


def test_wanted_follows_work_per_replica_within_the_range() -> None:
    assert wanted(1, [(9, 0.1)], RULE, 1, 5) == 3  # 9 requests at 4 each
    assert wanted(3, [(1, 0.1), (0, 0.0), (2, 0.2)], RULE, 1, 5) == 1
    assert wanted(3, [(0, 0.0)] * 3, RULE, 2, 5) == 2  # never below min
    assert wanted(2, [(40, 0.1), (40, 0.1)], RULE, 1, 5) == 5  # nor above max
    assert wanted(2, [(1, 0.95), (1, 0.1)], RULE, 1, 5) == 3  # a full KV cache adds one
    assert wanted(2, [(1, 0.95), (1, 0.1)], Autoscale(target_work=4), 1, 5) == 1


def test_decider_waits_out_the_cooldown_and_needs_figures() -> None:
    decider = Decider(RULE, 1, 5)
    assert decider.decide(100.0, 1, []) is None  # no replica answered: no decision
    assert decider.decide(100.0, 1, [(12, 0.0)]) == 3
    assert decider.decide(105.0, 3, [(0, 0.0)] * 3) is None  # cooling down
    assert decider.decide(111.0, 3, [(4, 0.0)] * 3) is None  # already right: no change
    assert decider.decide(111.0, 3, [(0, 0.0)] * 3) == 1
    assert decider.changed_at == 111.0


def test_fleet_file_autoscale_table() -> None:
    spec = parse_fleet({"deployments": [{
        "name": "m", "placement": "ray", "max_replicas": 3,
        "autoscale": {"target_work": 2, "kv_target": 0.8, "cooldown_s": 5}}]}).deployments["m"]
    assert spec.ray is not None
    assert spec.ray.autoscale == Autoscale(2.0, 0.8, 5.0, 5.0)
    for bad in ({"target_work": 0}, {"kv_target": 1.5}, {"every": 3}):
        with pytest.raises(FleetConfigError, match="autoscale"):
            parse_fleet({"deployments": [{"name": "m", "placement": "ray",
                                          "autoscale": bad}]})
    with pytest.raises(FleetConfigError, match='only with placement = "ray"'):
        parse_fleet({"deployments": [{"name": "m", "replicas": 1, "autoscale": {}}]})
