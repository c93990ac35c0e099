"""Timeline: stage durations from stamped events and the Server-Timing header they render."""

from __future__ import annotations

import re
import time

from tokenyard.telemetry.timeline import STAGES, Timeline

MS = 1_000_000  # ns


def _full_timeline() -> Timeline:
    tl = Timeline(received_ns=0)
    for event, at_ms in [("parsed", 0.12), ("templated", 0.2), ("tokenized", 0.5),
                         ("queued", 0.6), ("admitted", 2.6)]:
        tl.mark(event, now_ns=round(at_ms * MS))
    assert tl.mark_token(now_ns=12 * MS) is None
    assert tl.mark_token(now_ns=15 * MS) == 3 * MS
    assert tl.mark_token(now_ns=19 * MS) == 4 * MS
    tl.add("detokenize", 250_000)
    tl.add("detokenize", 250_000)
    tl.mark("done", now_ns=20 * MS)
    return tl


def test_stage_durations_are_the_intervals_between_their_events() -> None:
    durations = _full_timeline().durations_ns()
    assert list(durations) == list(STAGES)
    assert durations == {
        "parse": 120_000, "template": 80_000, "tokenize": 300_000, "queue": 2 * MS,
        "prefill": round(9.4 * MS), "decode": 7 * MS, "detokenize": 500_000,
    }


def test_mark_token_stamps_first_token_once_and_counts_tokens() -> None:
    tl = _full_timeline()
    assert tl.get("first_token") == 12 * MS
    assert tl.get("last_token") == 19 * MS
    assert tl.num_tokens == 3
    assert tl.interval_s("received", "done") == 0.02


def test_server_timing_follows_w3c_syntax_in_milliseconds() -> None:
    header = _full_timeline().server_timing()
    assert header == (
        "parse;dur=0.12, template;dur=0.08, tokenize;dur=0.3, queue;dur=2, "
        "prefill;dur=9.4, decode;dur=7, detokenize;dur=0.5"
    )
    metric = r"[A-Za-z0-9!#$%&'*+.^_`|~-]+;dur=\d+(\.\d+)?"
    assert re.fullmatch(rf"{metric}(, {metric})*", header)


def test_unmeasured_stages_are_left_out() -> None:
    tl = Timeline(received_ns=0)
    tl.mark("parsed", now_ns=MS)
    assert tl.server_timing() == "parse;dur=1"
    assert tl.interval_ns("queued", "admitted") is None
    assert Timeline().server_timing() == ""


def test_timings_ms_is_the_dict_for_the_last_stream_event() -> None:
    timings = _full_timeline().timings_ms()
    assert timings["parse"] == 0.12
    assert timings["prefill"] == 9.4
    assert all(isinstance(v, float) for v in timings.values())


def test_marking_is_cheap() -> None:
    start = time.perf_counter()
    for _ in range(1000):
        tl = Timeline()
        for event in ("parsed", "templated", "tokenized", "queued", "admitted"):
            tl.mark(event)
        tl.mark_token()
        tl.mark_token()
        tl.mark("done")
        tl.server_timing()
    per_request_us = (time.perf_counter() - start) * 1e3
    assert per_request_us < 100  # a few µs in practice; generous for a shared machine
