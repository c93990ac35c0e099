"""Shadow results through the gateway's recorder into the store, and the report read
back: grouping by (alias, primary, shadow), filters, medians, ratio and means."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.unit.test_store import database_url, run  # noqa: F401
from tokenyard.gateway.shadow import ShadowRecord, ShadowRecorder, shadow_report_of
from tokenyard.store.repo import Store

T0 = datetime(2026, 11, 22, 12, tzinfo=UTC)


def record(alias: str, shadow: str, primary_ms: float, shadow_ms: float, match: bool,
           at: datetime = T0, tokens: tuple[int, int] = (8, 6)) -> ShadowRecord:
    return ShadowRecord(
        request_id=f"req-{primary_ms}-{shadow_ms}", created_at=at, alias=alias,
        primary_deployment="p", shadow_deployment=shadow, primary_ms=primary_ms,
        shadow_ms=shadow_ms, primary_output_tokens=tokens[0],
        shadow_output_tokens=tokens[1], texts_match=match)


def test_recorded_results_are_reported_per_pair(database_url: str) -> None:  # noqa: F811
    async def scenario(store: Store) -> None:
        recorder = ShadowRecorder(store, flush_s=0.01)
        for ms, shadow_ms, match in ((10, 30, True), (20, 50, False), (30, 90, True)):
            recorder.add(record("a", "s1", ms, shadow_ms, match))
        recorder.add(record("a", "s2", 5, 5, True, tokens=(4, 4)))
        recorder.add(record("b", "s1", 1, 2, False, at=T0 - timedelta(days=2)))
        await recorder.close()  # writes what is left

        rows = await shadow_report_of(store)
        assert [(r.alias, r.shadow, r.count) for r in rows] == [
            ("a", "s1", 3), ("a", "s2", 1), ("b", "s1", 1)]
        first = rows[0]
        assert first.match_rate == 2 / 3
        assert (first.primary_p50_ms, first.shadow_p50_ms, first.latency_ratio) == (
            20.0, 50.0, 2.5)
        assert (first.primary_mean_output_tokens, first.shadow_mean_output_tokens) == (8, 6)
        assert [r.alias for r in await shadow_report_of(store, since=T0 - timedelta(days=1))
                ] == ["a", "a"]
        assert [r.shadow for r in await shadow_report_of(store, alias="a")] == ["s1", "s2"]
        assert await shadow_report_of(store, alias="none") == []

    run(database_url, scenario)
