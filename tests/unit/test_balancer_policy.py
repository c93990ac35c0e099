"""Stage 12's selection policies as a registry: a policy added from outside the pool is
used by a pool and accepted by the fleet file; an unknown name is refused by both."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from tests.unit.test_pool import FakeReplica, assert_no_leases, collect, run, served_by
from tokenyard import deployments
from tokenyard.balancer import policy
from tokenyard.balancer.affinity import AffinityTable, prefix_hashes
from tokenyard.balancer.members import Member
from tokenyard.balancer.policy import RequestFacts, register_policy
from tokenyard.balancer.pool import Pool
from tokenyard.deployments import BalancerSpec, FleetConfigError, parse_fleet

FLEET = {"deployments": [{"name": "d", "replicas": 3}]}


class Backwards(policy.Policy):
    """A policy no pool code knows: the last member first; remembers what it was told.
    It defines only `order` and `placed`: the rest is `Policy`'s defaults."""

    follows_output = False

    def __init__(self, affinity: AffinityTable, block_size: int) -> None:
        self.block_size = block_size
        self.facts: list[RequestFacts] = []
        self.placements: list[tuple[list[int], str]] = []

    async def order(self, members: list[Member], facts: RequestFacts) -> list[Member]:
        self.facts.append(facts)
        return members[::-1]

    async def placed(self, hashes: Sequence[int], member: Member) -> None:
        self.placements.append((list(hashes), member.id))


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made by a test end with it."""
    monkeypatch.setattr(policy, "POLICIES", dict(policy.POLICIES))
    monkeypatch.setattr(deployments, "POLICIES", set(deployments.POLICIES))


def test_the_fleet_file_accepts_exactly_the_registered_policies() -> None:
    assert set(policy.POLICIES) == deployments.POLICIES == {"affinity", "least", "precise",
                                                               "round_robin"}
    for name in policy.POLICIES:
        assert parse_fleet({**FLEET, "balancer": {"policy": name}}).balancer.policy == name


def test_a_registered_policy_is_used_by_a_pool_and_accepted_by_the_fleet_file(
        registries: None) -> None:
    register_policy("backwards", Backwards)
    fleet = parse_fleet({**FLEET, "balancer": {"policy": "backwards"}})
    spec = dataclasses.replace(fleet.balancer, health_interval_s=0)

    async def scenario() -> None:
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        pool = Pool("d", [(r.name, r) for r in (a, b, c)], spec)
        chosen = pool.policy
        assert isinstance(chosen, Backwards) and chosen.block_size == pool.block_size
        prompt = list(range(100, 164))
        assert served_by(await collect(pool, "r1", prompt, max_tokens=16)) == "c"
        assert chosen.facts == [RequestFacts(prefix_hashes(prompt, 16), 64 + 16, 0)]
        # Told of the placement (the first byte came), and not of the output: it does
        # not follow outputs.
        assert chosen.placements == [(prefix_hashes(prompt, 16), "c")]
        assert pool.affinity_hits == 0
        pool.members[2].draining = True  # the pool filters; the policy ranks the rest
        assert served_by(await collect(pool, "r2", prompt)) == "b"
        assert_no_leases(pool)
        # The protocol's defaults: nothing watched, nothing added to the admin rows.
        pool.start()
        assert [set(row) - set(m.snapshot(0.0)) for row, m in
                zip(pool.snapshot(), pool.members, strict=True)] == [set(), set(), set()]
        await pool.close()

    run(scenario)


def test_an_unknown_policy_is_refused_by_the_fleet_file_and_the_pool() -> None:
    with pytest.raises(FleetConfigError,
                       match=r"balancer\.policy: one of affinity, least, precise, round_robin"):
        parse_fleet({**FLEET, "balancer": {"policy": "backwards"}})
    with pytest.raises(ValueError, match="unknown balancer policy 'backwards'; one of "
                                         "affinity, least, precise, round_robin"):
        Pool("d", [("a", FakeReplica("a"))], BalancerSpec(policy="backwards"))
