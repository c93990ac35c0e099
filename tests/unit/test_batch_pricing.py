"""A batch line's class and price: below every live priority class (and shadow copies),
so the scheduler and the balancer's queue serve it last; half the live prices, each
rounded half up."""

from __future__ import annotations

from typing import Any, cast

from tokenyard.gateway.billing import batch_prices
from tokenyard.gateway.pipeline import BATCH_PRIORITY, Ticket
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
