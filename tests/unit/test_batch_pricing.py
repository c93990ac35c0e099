"""A batch line's class and price: below every live priority class (and shadow copies),
so the scheduler and the balancer's queue serve it last; half the live prices, each
rounded half up, unless the deployment's fleet entry sets its own (`batch_prices`); the
lane's settings from `ServeConfig`."""

from __future__ import annotations

from typing import Any, cast

import pytest

from tokenyard.config import ServeConfig
from tokenyard.deployments import FleetConfigError, PriceSpec, parse_fleet
from tokenyard.gateway.batches import BatchSettings
from tokenyard.gateway.billing import batch_prices
from tokenyard.gateway.gate import BATCH_PRIORITY, Ticket
from tokenyard.gateway.shadow_copies import SHADOW_PRIORITY
from tokenyard.store.money import Prices
from tokenyard.store.records import PRIORITY_CLASSES


def test_a_batch_line_runs_below_every_live_class() -> None:
    assert max(*PRIORITY_CLASSES.values(), SHADOW_PRIORITY) < BATCH_PRIORITY
    key = cast(Any, type("Key", (), {"priority": PRIORITY_CLASSES["high"]})())
    live = Ticket(key, cast(Any, None), "m", "/v1/chat/completions", "r1", Prices())
    line = Ticket(key, cast(Any, None), "m", "/v1/chat/completions", "r2", Prices(),
                  batch_id="batch_x")
    assert (live.priority, line.priority) == (PRIORITY_CLASSES["high"], BATCH_PRIORITY)


def test_batch_prices_are_half_the_live_ones_rounded_half_up() -> None:
    assert batch_prices(Prices(input=3, cached_input=2, output=1_000_001)) == Prices(
        input=2, cached_input=1, output=500_001)
    assert batch_prices(Prices()) == Prices()


def test_a_fleet_entry_sets_its_batch_prices_in_the_units_of_its_prices() -> None:
    fleet = parse_fleet({"deployments": [
        {"name": "a", "urls": ["http://x:1"], "prices": {"input": "2", "output": "4"},
         "batch_prices": {"input": "0.5", "cached_input": "0.25", "output": "1.5"}},
        {"name": "b", "urls": ["http://x:1"], "prices": {"input": "2"}}]})
    assert fleet.deployments["a"].batch_prices == PriceSpec(500_000, 250_000, 1_500_000)
    assert fleet.deployments["b"].batch_prices is None  # half the live prices
    with pytest.raises(FleetConfigError, match=r"deployments\[0\]\.batch_prices\.output"):
        parse_fleet({"deployments": [{"name": "a", "urls": ["http://x:1"],
                                      "batch_prices": {"output": "-1"}}]})


def test_the_batch_settings_come_from_the_serve_config(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENYARD_BATCH_ENQUEUED_TOKENS", "1234")
    monkeypatch.setenv("TOKENYARD_BATCH_LEASE_S", "2.5")
    settings = BatchSettings.of(ServeConfig.from_env())
    assert (settings.enqueued_tokens, settings.lease_s, settings.concurrency) == (
        1234, 2.5, ServeConfig.batch_concurrency)
    monkeypatch.setenv("TOKENYARD_BATCH_CONCURRENCY", "0")
    with pytest.raises(ValueError, match="batch_concurrency"):
        ServeConfig.from_env()


def test_serve_s_batch_flags_reach_the_lane_s_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenyard serve --batch-*` over TOKENYARD_BATCH_*: what `AppState.batch` (and so
    the lane) is given, never read from the environment by the lane itself."""
    from tokenyard.cli.main import build_parser, serve_config

    monkeypatch.setenv("TOKENYARD_BATCH_CONCURRENCY", "5")
    monkeypatch.setenv("TOKENYARD_BATCH_LEASE_S", "9")
    args = build_parser().parse_args(["serve", "--batch-concurrency", "7",
                                      "--batch-enqueued-tokens", "99"])
    settings = BatchSettings.of(serve_config(args))
    assert (settings.concurrency, settings.lease_s, settings.enqueued_tokens) == (7, 9.0, 99)
