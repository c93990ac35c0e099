"""LoRA adapters as the gateway serves them (`lora_spec.py`): the fleet file's `adapters`
become deployments `base:adapter` over the base's replicas, with their own prices; the
flag and the wire body carry the adapter; the balancer sends an adapter's requests where
it sent them before, unless that replica is much busier."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.unit.test_pool import FakeReplica, assert_no_leases, make_pool, served_by
from tokenyard.deployments import PriceSpec, parse_fleet
from tokenyard.errors import APIError
from tokenyard.fleet_values import FleetConfigError
from tokenyard.gateway.kinds import kind_of
from tokenyard.gateway.routing import Route, Router
from tokenyard.lora_spec import lora_salt, parse_lora_modules, split_adapter
from tokenyard.wire.protocol import GenerateRequest
from tokenyard.wire.sampling_params import SamplingParams

BASE = "smol-2026-11-22"


def _fleet(adapters: list[dict[str, Any]], **extra: Any) -> Any:
    return parse_fleet({"deployments": [{"name": BASE, "replicas": 1,
                                         "prices": {"input": "0.1", "output": "0.4"},
                                         "adapters": adapters}], **extra})


def test_fleet_adapters_are_deployments_over_their_base() -> None:
    fleet = _fleet([{"name": "pirate", "path": "/a/pirate"},
                    {"name": "sql", "path": "/a/sql", "prices": {"output": "0.9"}}],
                   aliases={"pirate": f"{BASE}:pirate"})
    base = fleet.deployments[BASE]
    pirate, sql = fleet.deployments[f"{BASE}:pirate"], fleet.deployments[f"{BASE}:sql"]
    assert (pirate.parent, pirate.lora, pirate.replicas, pirate.adapters) == (
        BASE, "pirate", 0, ())
    assert pirate.prices == base.prices == PriceSpec(100_000, 0, 400_000)
    assert sql.prices == PriceSpec(0, 0, 900_000)
    assert fleet.aliases["pirate"].routes == ((f"{BASE}:pirate", 1.0),)
    # The base's local replicas load its adapters.
    command = kind_of(base).replica_command(base, ["--threads", "1"])
    assert command[-2:] == ["--lora-modules", "pirate=/a/pirate,sql=/a/sql"]


@pytest.mark.parametrize("adapters, message", [
    ([{"name": "bad name", "path": "/x"}], "letters, digits"),
    ([{"name": "a", "path": "/x"}, {"name": "a", "path": "/y"}], "defined twice"),
    ([{"name": "a"}], "path"),
    ([{"name": "a", "path": "/x", "rank": 8}], "rank"),
])
def test_bad_fleet_adapters_are_refused(adapters: list[dict[str, Any]],
                                        message: str) -> None:
    with pytest.raises(FleetConfigError, match=message):
        _fleet(adapters)


def test_names_flags_and_the_wire() -> None:
    assert split_adapter(f"{BASE}:pirate") == (BASE, "pirate")
    assert split_adapter(BASE) == (BASE, None)
    assert parse_lora_modules("a=/x, b=/y") == {"a": "/x", "b": "/y"}
    for bad in ("a", "a=/x,a=/y", "=/x", "a b=/x"):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)
    assert lora_salt("org", None) == "org"
    assert len({lora_salt("org", None), lora_salt("org", "a"), lora_salt("org", "b"),
                lora_salt(None, "a")}) == 4
    wire = GenerateRequest("r", [1, 2], SamplingParams(), "org", lora="pirate")
    assert GenerateRequest.from_json(wire.to_json()).lora == "pirate"
    plain = GenerateRequest("r", [1, 2], SamplingParams())
    assert "lora" not in plain.to_json()
    assert GenerateRequest.from_json(plain.to_json()).lora is None


def test_the_balancer_prefers_the_replica_holding_the_adapter() -> None:
    async def scenario() -> None:
        a, b = FakeReplica("a"), FakeReplica("b")
        pool = make_pool(a, b, policy="round_robin")  # the policy alone alternates
        params = SamplingParams(max_tokens=16)

        async def ask(request_id: str, lora: str | None, prompt: list[int]) -> str:
            extra = {} if lora is None else {"lora": lora}
            return served_by([x async for x in pool.generate(
                request_id, prompt, params, **extra)])

        home = await ask("first", "pirate", [1, 2, 3])
        # Different prompts (no shared prefix): the adapter alone keeps them together,
        # while the base model's requests alternate.
        for i in range(4):
            assert await ask(f"again{i}", "pirate", [10 + i] * 3) == home
        assert len({await ask(f"base{i}", None, [20 + i]) for i in range(4)}) == 2
        # Unless its replica is much busier than the other.
        for r in (a, b):
            r.gate = asyncio.Event()
        hot = pool.generate("hot", [5], SamplingParams(max_tokens=10_000), lora="sql")
        busy = served_by([await hot.__anext__()])
        late = pool.generate("late", [6], params, lora="sql")
        assert served_by([await late.__anext__()]) != busy
        for r in (a, b):
            assert r.gate is not None
            r.gate.set()
        assert [x async for x in hot] and [x async for x in late]
        assert_no_leases(pool)

    asyncio.run(scenario())


def test_an_alias_of_the_base_reaches_its_adapters() -> None:
    fleet = _fleet([{"name": "pirate", "path": "/a/pirate"}], aliases={"smol": BASE})
    router = Router(fleet)
    assert router.resolve("smol:pirate", 0.5) == Route(f"{BASE}:pirate", "smol:pirate")
    assert router.resolve(f"{BASE}:pirate", 0.5).deployment == f"{BASE}:pirate"
    for unknown in ("smol:nope", f"{BASE}:nope", "other:pirate", "smol:"):
        with pytest.raises(APIError) as caught:
            router.resolve(unknown, 0.5)
        assert (caught.value.status, caught.value.code) == (404, "model_not_found")
