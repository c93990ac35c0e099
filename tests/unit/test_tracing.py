"""telemetry/tracing.py: traceparent parsing, the ids of a request's span, stage spans,
and that nothing of the SDK is imported while tracing is off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenyard.telemetry import tracing
from tokenyard.telemetry.timeline import Timeline

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_valid_traceparent_is_parsed() -> None:
    assert tracing.parse_traceparent(f"00-{TRACE}-{SPAN}-01") == (
        int(TRACE, 16), int(SPAN, 16), True)
    assert tracing.parse_traceparent(f"00-{TRACE}-{SPAN}-00") == (
        int(TRACE, 16), int(SPAN, 16), False)
    # A later version may append fields; version 00 may not.
    assert tracing.parse_traceparent(f"01-{TRACE}-{SPAN}-01-extra") is not None


@pytest.mark.parametrize("value", [
    None, "", "garbage", f"00-{TRACE}-{SPAN}", f"ff-{TRACE}-{SPAN}-01",
    f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01", f"00-{TRACE[:-1]}x-{SPAN}-01",
    f"00-{TRACE}-{SPAN}-01-extra",
])
def test_a_bad_traceparent_is_ignored(value: str | None) -> None:
    assert tracing.parse_traceparent(value) is None


def test_begin_continues_the_callers_trace_or_starts_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    tracing.enabled.cache_clear()
    try:
        ids = tracing.begin(f"00-{TRACE}-{SPAN}-01")
        assert ids is not None
        assert (ids.trace_id, ids.parent_id, ids.sampled) == (int(TRACE, 16), int(SPAN, 16),
                                                              True)
        assert ids.traceparent() == f"00-{TRACE}-{ids.span_id:016x}-01"
        fresh = tracing.begin("not a traceparent")
        assert fresh is not None and fresh.parent_id is None and fresh.sampled
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
        tracing.enabled.cache_clear()
        assert tracing.begin(f"00-{TRACE}-{SPAN}-01") is None
    finally:
        tracing.enabled.cache_clear()


def test_stage_spans_follow_the_timeline() -> None:
    timeline = Timeline(received_ns=1_000)
    timeline.mark("parsed", 1_500)
    timeline.mark("tokenized", 2_000)  # templated not stamped: tokenize starts at parsed
    timeline.mark("queued", 2_100)
    timeline.mark("admitted", 3_000)
    spans = tracing.stage_spans(timeline, 10_000)
    assert [(s.name, s.start_ns, s.end_ns) for s in spans] == [
        ("parse", 11_000, 11_500), ("tokenize", 11_500, 12_000), ("queue", 12_100, 13_000)]


def test_tracing_off_imports_no_sdk() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    code = (
        "import sys\n"
        "import tokenyard.cli.serve, tokenyard.api.request_end\n"
        "from tokenyard.telemetry import tracing\n"
        "assert not tracing.enabled() and tracing.begin('x') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
