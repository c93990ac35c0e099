"""Issue 40: the workers of one `tokenyard serve --workers 2`, without Redis, never spend
past an account together.

The parent holds every org balance, spend cap and budget for its workers
(gateway/money_server.py, over the socket of their shared limits). The same load as
test_money_two_gateways (50 requests at once: chat completions streamed and not with n of
1 to 3, Anthropic messages streamed and not) against an account that covers about three
and a half of them, spread by the kernel over both workers of one port, on SQLite. Before
the parent held money, each worker held only its own requests.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import running_server
from tests.integration.test_money_two_gateways import (
    KINDS,
    Pair,
    measure_prompts,
    mock_fleet,
    spend_past_budget_check,
)


@pytest.fixture(scope="module")
def workers() -> Iterator[Pair]:
    with mock_fleet() as (tmp, config), \
            running_server("--config", str(config), "--workers", "2", state_dir=tmp) as (
                server, proc):
        pair = Pair((server, server), None, proc)
        measure_prompts(pair)
        yield pair


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_workers_of_one_serve_never_spend_past_an_account(workers: Pair,
                                                              kind: str) -> None:
    spend_past_budget_check(workers, kind)
