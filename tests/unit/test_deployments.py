"""The fleet file: a good one read whole, and each malformed field named in its error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenyard.deployments import (
    BalancerSpec,
    FleetConfigError,
    PriceSpec,
    ShadowSpec,
    load_fleet,
    parse_fleet,
    single_fleet,
)

GOOD = """
[balancer]
policy = "round_robin"
queue_timeout_s = 2.5
queue_max = 8
eject_after = 4

[[deployments]]
name = "smollm2-135m-instruct-2026-11-22"
replicas = 2
urls = ["http://10.0.0.7:8001"]
engine_args = ["--threads", "1"]
token_env = "FLEET_TEST_TOKEN"
prices = { input = "0.10", cached_input = "0.05", output = 0.4 }

[[deployments]]
name = "gpt-up-2026-12-01"
kind = "upstream"
urls = ["https://api.example.com/v1"]
model = "gpt-up"
capabilities = ["chat", "tools", "vision"]
max_context = 32768

[[deployments]]
name = "qwen-vllm-2026-12-01"
kind = "upstream"
urls = ["http://10.0.0.9:8000/v1"]
model = "Qwen/Qwen2.5-7B-Instruct"
server = "vllm"

[[deployments]]
name = "minilm"
kind = "embeddings"
replicas = 1

[aliases]
smollm2 = "smollm2-135m-instruct-2026-11-22"
[aliases.smollm2-next]
route = { "smollm2-135m-instruct-2026-11-22" = 90, "gpt-up-2026-12-01" = 10 }
shadow = { deployment = "gpt-up-2026-12-01", share = 0.05 }
"""


def test_a_good_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "tokenyard.toml"
    path.write_text(GOOD)
    fleet = load_fleet(path)
    assert fleet.path == path
    assert fleet.balancer == BalancerSpec(policy="round_robin", queue_timeout_s=2.5,
                                          queue_max=8, eject_after=4)
    engine = fleet.deployments["smollm2-135m-instruct-2026-11-22"]
    assert (engine.kind, engine.replicas, engine.urls) == ("engine", 2,
                                                            ("http://10.0.0.7:8001",))
    assert engine.engine_args == ("--threads", "1")
    # The kind's default: at least chat and completions, never vision (only upstreams).
    assert {"chat", "completions"} <= engine.capabilities and "vision" not in engine.capabilities
    assert engine.prices == PriceSpec(input=100_000, cached_input=50_000, output=400_000)
    monkeypatch.setenv("FLEET_TEST_TOKEN", "s3cret")
    assert engine.token() == "s3cret"
    upstream = fleet.deployments["gpt-up-2026-12-01"]
    assert upstream.capabilities == {"chat", "tools", "vision"}
    assert (upstream.model, upstream.max_context, upstream.token()) == ("gpt-up", 32768, None)
    # No `server`: any OpenAI-compatible one, which keeps no cache per tenant.
    assert upstream.server == "openai" and not upstream.salts_cache
    vllm = fleet.deployments["qwen-vllm-2026-12-01"]
    assert vllm.server == "vllm" and vllm.salts_cache
    assert engine.server is None and not engine.salts_cache
    assert fleet.deployments["minilm"].capabilities == {"embeddings"}
    assert fleet.aliases["smollm2"].routes == (("smollm2-135m-instruct-2026-11-22", 1.0),)
    nxt = fleet.aliases["smollm2-next"]
    assert nxt.routes == (("smollm2-135m-instruct-2026-11-22", 90.0),
                          ("gpt-up-2026-12-01", 10.0))
    assert nxt.shadow == ShadowSpec("gpt-up-2026-12-01", 0.05)
    assert fleet.names() == ["smollm2-135m-instruct-2026-11-22", "gpt-up-2026-12-01",
                             "qwen-vllm-2026-12-01", "minilm", "smollm2", "smollm2-next"]


def test_single_fleet_without_a_file() -> None:
    fleet = single_fleet("m", replicas=3, embeddings="emb", policy="least")
    assert fleet.deployments["m"].replicas == 3 and fleet.balancer.policy == "least"
    assert fleet.deployments["emb"].kind == "embeddings"
    running = single_fleet("m", replicas=3, urls=["http://x:1"])
    assert running.deployments["m"].replicas == 0 and list(running.deployments) == ["m"]


def _dep(**fields: Any) -> dict[str, Any]:
    return {"name": "d", "replicas": 1, **fields}


@pytest.mark.parametrize(("raw", "named"), [
    ({"deployments": [_dep()], "extra": 1}, "the file: unknown field(s) extra"),
    ({}, "'deployments'"),
    ({"deployments": []}, "'deployments'"),
    ({"deployments": ["x"]}, "deployments[0]: a table"),
    ({"deployments": [_dep(name="")]}, "deployments[0].name"),
    ({"deployments": [_dep(), _dep()]}, "deployments[1].name: 'd' is defined twice"),
    ({"deployments": [_dep(kind="gpu")]}, "deployments[0].kind"),
    ({"deployments": [_dep(replicas=-1)]}, "deployments[0].replicas"),
    ({"deployments": [_dep(replicas=True)]}, "deployments[0].replicas"),
    ({"deployments": [_dep(replicas=0)]}, "deployments[0]: needs 'replicas'"),
    ({"deployments": [_dep(urls="http://a")]}, "deployments[0].urls: an array"),
    ({"deployments": [_dep(urls=["ftp://a"])]}, "deployments[0].urls"),
    ({"deployments": [_dep(kind="upstream", model="m")]}, "deployments[0].replicas"),
    ({"deployments": [_dep(kind="upstream", replicas=0, urls=["http://a"])]},
     "deployments[0].model"),
    ({"deployments": [_dep(kind="upstream", replicas=0, urls=["http://a"], model="m",
                           server="tgi")]},
     "deployments[0].server: one of vllm, sglang, openai"),
    ({"deployments": [_dep(kind="upstream", replicas=0, urls=["http://a"], model="m",
                           server=1)]}, "deployments[0].server: one of"),
    ({"deployments": [_dep(server="vllm")]},
     "deployments[0].server: only an upstream deployment"),
    ({"deployments": [_dep(capabilities=["telepathy"])]}, "deployments[0].capabilities"),
    ({"deployments": [_dep(max_context=0)]}, "deployments[0].max_context"),
    ({"deployments": [_dep(engine_args=[1])]}, "deployments[0].engine_args[]"),
    ({"deployments": [_dep(colour="red")]}, "deployments[0]: unknown field(s) colour"),
    ({"deployments": [_dep(prices={"input": "abc"})]}, "deployments[0].prices.input"),
    ({"deployments": [_dep(prices={"output": "-1"})]}, "deployments[0].prices.output"),
    ({"deployments": [_dep(prices={"input": "0.0000001"})]}, "deployments[0].prices.input"),
    ({"deployments": [_dep(prices={"gold": "1"})]}, "deployments[0].prices: unknown"),
    ({"deployments": [_dep()], "aliases": {"d": "d"}}, "aliases.d: an alias may not"),
    ({"deployments": [_dep()], "aliases": {"a": "nope"}}, "aliases.a: 'nope'"),
    ({"deployments": [_dep()], "aliases": {"a": {"route": {"d": -1}}}}, "aliases.a.route.d"),
    ({"deployments": [_dep()], "aliases": {"a": {"route": {"d": 0}}}}, "aliases.a.route"),
    ({"deployments": [_dep()], "aliases": {"a": {"route": {"d": 1},
                                                 "shadow": {"deployment": "d", "share": 2}}}},
     "aliases.a.shadow.share"),
    ({"deployments": [_dep()], "aliases": {"a": {"route": {"d": 1},
                                                 "shadow": {"deployment": "x"}}}},
     "aliases.a: 'x' is not a deployment"),
    ({"deployments": [_dep()], "balancer": {"policy": "random"}}, "balancer.policy"),
    ({"deployments": [_dep()], "balancer": {"queue_timeout_s": -1}},
     "balancer.queue_timeout_s"),
    ({"deployments": [_dep()], "balancer": {"queue_max": 0}}, "balancer.queue_max"),
    ({"deployments": [_dep()], "balancer": {"eject_after": 1.5}}, "balancer.eject_after"),
    ({"deployments": [_dep()], "balancer": {"wat": 1}}, "balancer: unknown field(s) wat"),
])
def test_each_error_names_its_field(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(FleetConfigError) as info:
        parse_fleet(raw)
    assert named in str(info.value)


def test_an_unreadable_file_names_the_path(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[deployments]\nname = ")
    with pytest.raises(FleetConfigError, match=r"bad\.toml"):
        load_fleet(bad)
    with pytest.raises(FleetConfigError, match=r"missing\.toml"):
        load_fleet(tmp_path / "missing.toml")


def test_on_demand_deployments_and_the_resident_budget() -> None:
    fleet = parse_fleet({
        "models": {"max_resident_models": 2},
        "deployments": [_dep(name="always"),
                        _dep(name="od", load="on_demand", idle_unload_s=30, pinned=True,
                             load_timeout_s=90),
                        _dep(name="od2", load="on_demand")]})
    assert fleet.models.max_resident_models == 2
    assert fleet.deployments["always"].on_demand is None
    od = fleet.deployments["od"].on_demand
    assert od is not None and (od.idle_unload_s, od.load_timeout_s, od.pinned) == (30, 90, True)
    od2 = fleet.deployments["od2"].on_demand
    assert od2 is not None and od2.idle_unload_s == 300 and not od2.pinned
    assert parse_fleet({"deployments": [_dep()]}).models.max_resident_models is None


@pytest.mark.parametrize(("raw", "named"), [
    ({"deployments": [_dep(load="lazy")]},
     "deployments[0].load: one of always, on_demand, not 'lazy'"),
    ({"deployments": [_dep(idle_unload_s=5)]},
     "deployments[0]: idle_unload_s only with load = \"on_demand\""),
    ({"deployments": [_dep(pinned=True)]}, "deployments[0]: pinned only with"),
    ({"deployments": [_dep(load="on_demand", idle_unload_s=0)]},
     "deployments[0].idle_unload_s: a positive number of seconds"),
    ({"deployments": [_dep(load="on_demand", idle_unload_s="5m")]},
     "deployments[0].idle_unload_s"),
    ({"deployments": [_dep(load="on_demand", load_timeout_s=-1)]},
     "deployments[0].load_timeout_s"),
    ({"deployments": [_dep(load="on_demand", pinned="yes")]},
     "deployments[0].pinned: true or false"),
    ({"deployments": [_dep(load="on_demand", replicas=0, urls=["http://a"])]},
     "deployments[0].load: \"on_demand\" starts and stops local replicas"),
    ({"deployments": [_dep(kind="upstream", load="on_demand", replicas=0,
                           urls=["http://a"], model="m")]}, "deployments[0].load"),
    ({"deployments": [_dep(kind="embeddings", load="on_demand")]},
     "deployments[0].load: \"on_demand\" is for engine deployments"),
    ({"deployments": [_dep()], "models": {"max_resident_models": 0}},
     "models.max_resident_models: a positive integer"),
    ({"deployments": [_dep()], "models": {"max_resident": 2}},
     "models: unknown field(s) max_resident"),
])
def test_each_load_error_names_its_field(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(FleetConfigError) as info:
        parse_fleet(raw)
    assert named in str(info.value)
