"""Timeline: stage durations from stamped events and the Server-Timing header they render."""

from __future__ import annotations

import re

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
    assert list(durations) == [s for s in STAGES if s in durations]
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


def test_optional_stages_drop_out_and_the_next_stage_starts_at_the_last_stamp() -> None:
    tl = Timeline(received_ns=0)
    tl.mark("authenticated", now_ns=MS)
    tl.mark("parsed", now_ns=3 * MS)
    tl.mark("tokenized", now_ns=4 * MS)  # no "templated": a raw text prompt
    tl.mark("limited", now_ns=6 * MS)  # gateway on, "authorized" skipped
    assert tl.durations_ns() == {"auth": MS, "parse": 2 * MS, "tokenize": MS, "limit": 2 * MS}


def test_gateway_stages_come_in_request_order() -> None:
    assert STAGES.index("auth") < STAGES.index("parse") < STAGES.index("limit")
    assert STAGES.index("limit") < STAGES.index("queue") < STAGES.index("detokenize")
