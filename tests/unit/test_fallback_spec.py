"""The fleet file's fallbacks (`fallback_spec.py`): read on deployments and aliases, kept
by a regional gateway's fleet, each malformed field named; and which failures send a
request on (`gateway/fallbacks.condition`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenyard.balancer.generation import replica_error
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaOverloaded,
    ReplicaRequestError,
)
from tokenyard.deployments import FleetConfigError, parse_fleet
from tokenyard.errors import APIError, context_length_exceeded, invalid_request
from tokenyard.fallback_spec import CONDITIONS, FallbackSpec
from tokenyard.gateway.fallbacks import condition
from tokenyard.gateway.regions import regional_fleet


def _dep(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "replicas": 1, **fields}


def test_deployments_and_aliases_name_their_fallbacks() -> None:
    fleet = parse_fleet({
        "deployments": [
            _dep("small", fallbacks=["big", "chat"], fallback_on=["rate_limit", "timeout"],
                 first_byte_timeout_s=2, region="eu"),
            _dep("big", region="eu"),
            _dep("far", region="us"),
        ],
        "aliases": {"chat": {"route": {"small": 1, "far": 1}, "fallbacks": ["big"]},
                    "plain": "small"},
    })
    assert fleet.deployments["small"].fallbacks == FallbackSpec(
        ("big", "chat"), frozenset({"rate_limit", "timeout"}), 2.0)
    assert fleet.deployments["big"].fallbacks is None
    assert fleet.aliases["chat"].fallbacks == FallbackSpec(("big",), frozenset(CONDITIONS))
    assert fleet.aliases["plain"].fallbacks is None
    # A regional gateway's part of the fleet keeps an alias's fallbacks.
    eu = regional_fleet(parse_fleet({
        "deployments": [_dep("small", region="eu"), _dep("far", region="us")],
        "aliases": {"chat": {"route": {"small": 1, "far": 1}, "fallbacks": ["small"]}}},
        Path("fleet.toml")), "eu")
    assert eu.aliases["chat"].routes == (("small", 1.0),)
    assert eu.aliases["chat"].fallbacks == FallbackSpec(("small",))


@pytest.mark.parametrize(("raw", "named"), [
    ({"deployments": [_dep("d", fallbacks="e")]}, "deployments[0].fallbacks: an array"),
    ({"deployments": [_dep("d", fallbacks=["nope"])]},
     "deployments (d).fallbacks: 'nope' is not a deployment or an alias"),
    ({"deployments": [_dep("d", fallbacks=["d"])]}, "'d' cannot fall back to itself"),
    ({"deployments": [_dep("d", fallbacks=["e", "e"]), _dep("e")]}, "listed twice"),
    ({"deployments": [_dep("d", fallbacks=[f"e{i}" for i in range(9)])]}, "at most 8"),
    ({"deployments": [_dep("d", fallback_on=["sunspots"])]},
     "deployments[0].fallback_on: unknown ['sunspots']"),
    ({"deployments": [_dep("d", first_byte_timeout_s=0)]},
     "deployments[0].first_byte_timeout_s"),
    ({"deployments": [_dep("d", first_byte_timeout_s=True)]},
     "deployments[0].first_byte_timeout_s"),
    ({"deployments": [_dep("d", fallbacks=["e"]), _dep("e", kind="embeddings")]},
     "only a generating deployment"),
    ({"deployments": [_dep("d")], "aliases": {"a": {"route": {"d": 1},
                                                    "fallbacks": ["x"]}}},
     "aliases (a).fallbacks: 'x'"),
    ({"deployments": [_dep("d")], "aliases": {"a": {"route": {"d": 1},
                                                    "fallback_on": "timeout"}}},
     "aliases.a.fallback_on: an array"),
])
def test_each_error_names_its_field(raw: dict[str, Any], named: str) -> None:
    with pytest.raises(FleetConfigError) as info:
        parse_fleet(raw)
    assert named in str(info.value)


@pytest.mark.parametrize(("err", "met"), [
    (replica_error(ReplicaOverloaded(1.0, "full", "overloaded")), "rate_limit"),
    (replica_error(ReplicaConnectionError("answered 500")), "server_error"),
    (replica_error(ReplicaRequestError(500, "boom", None, None)), "server_error"),
    (replica_error(ReplicaRequestError(400, "too long", "messages",
                                       "context_length_exceeded")), "context_length"),
    (context_length_exceeded(8, 10, None), "context_length"),
    (invalid_request("flagged", code="content_policy_violation"), "content_policy"),
    (replica_error(ReplicaRequestError(400, "bad", "top_p", "invalid_value")), None),
    (APIError(429, "the key's own limit", code="rate_limit_exceeded"), None),
    (TimeoutError(), "timeout"),
    (ValueError(), None),
])
def test_which_failures_send_a_request_on(err: BaseException, met: str | None) -> None:
    assert condition(err) == met
