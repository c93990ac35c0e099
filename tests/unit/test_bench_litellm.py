"""The LiteLLM comparison's table and goals (`bench/litellm_table.py`), its saturation
rule, and `bench profile --gateway`'s reading of py-spy's collapsed stacks. Needs no
LiteLLM: the points are built here."""

from __future__ import annotations

from tokenyard.bench.gateway import Side
from tokenyard.bench.gateway_profile import collapsed_tops
from tokenyard.bench.litellm_peer import _saturated
from tokenyard.bench.litellm_table import LITELLM, TOKENYARD, Point, render_section
from tokenyard.bench.stats import RequestRecord, summarize


def _side(e2e_ms: float, n: int = 20, failed: int = 0, cpu_ms: float = 1.0) -> Side:
    records = [RequestRecord(index=i, scheduled_s=0.0, start_s=0.0, e2e_s=e2e_ms / 1000,
                             ttft_s=e2e_ms / 1000, output_tokens=16,
                             ok=i >= failed, error="http_500" if i < failed else None)
               for i in range(n)]
    side = Side(summarize(records, 1.0), n, 10.0, 5.0, machine_cpu_pct=50.0)
    side.tokenyard_cpu_ms_per_request, side.tokenyard_rss_mib = cpu_ms, 150.0
    return side


def _point(gateway: str, rate: float, added_ms: float, stream: bool = False) -> Point:
    direct, side = _side(20.0), _side(20.0 + added_ms)
    added = {q: added_ms for q in ("mean", "p50", "p90", "p99")}
    return Point(gateway, 0, rate, stream, direct, side, added)


def test_saturation_by_failures_or_added_latency() -> None:
    assert not _saturated(_side(25.0), 5.0)
    assert _saturated(_side(25.0), 150.0)  # a queue building up
    assert _saturated(_side(25.0, n=100, failed=2), 5.0)  # over 1 % failed
    assert _saturated(_side(25.0), None)  # nothing answered


def test_section_shows_both_gateways_and_checks_the_goals() -> None:
    points = [_point(TOKENYARD, 10, 2.0), _point(LITELLM, 10, 30.0),
              _point(TOKENYARD, 50, 3.0), _point(LITELLM, 50, 900.0),
              _point(TOKENYARD, 500, 4.0)]
    setup = {"version": "1.106.12", "machine": "m", "date": "d", "rounds": 1,
             "duration_s": 5.0, "measured_s": 60.0, "rates": [10.0, 50.0, 500.0],
             "saturated": {(LITELLM, False): 50.0}}
    text = render_section(points, setup)
    assert "| non-stream | 10 | +2.00 / +2.0 | +30.00 / +30.0 | 15.0× |" in text
    assert "(saturated at 50)" in text  # LiteLLM's 500 req/s row was not run
    assert "15.0× (goal ≥ 10×: met)" in text
    # tokenyard did not saturate up to 500: at least 10× LiteLLM's 50.
    assert "≥ 10× (goal ≥ 5×: met)" in text


def test_section_says_why_when_litellm_is_unavailable() -> None:
    text = render_section([], {"version": "1.106.12", "skipped": "pip failed: no index"})
    assert "Not measured on this machine: pip failed: no index" in text


def test_collapsed_stacks_self_and_inclusive() -> None:
    stacks = ("main (app.py:1);handle (/x/site-packages/aiohttp/web.py:9);parse (p.py:3) 6\n"
              "main (app.py:1);handle (/x/site-packages/aiohttp/web.py:9) 3\n"
              "main (app.py:1);render (/r/src/tokenyard/text/t.py:2) 1\n")
    total, own, inclusive = collapsed_tops(stacks, 10, entry_share=1.01)
    assert total == 10
    assert own[0] == ("parse (p.py:3)", 6)
    assert dict(own)["handle (aiohttp/web.py:9)"] == 3
    assert dict(inclusive)["main (app.py:1)"] == 10
    assert dict(inclusive)["handle (aiohttp/web.py:9)"] == 9
    assert dict(inclusive)["render (tokenyard/text/t.py:2)"] == 1
    _, _, inner = collapsed_tops(stacks, 10)  # main, on every sample, says nothing
    assert "main (app.py:1)" not in dict(inner)
