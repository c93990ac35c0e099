"""The serving benchmark's pure parts: percentiles, goodput, stream parsing, Server-Timing,
workload lengths."""

from __future__ import annotations

import asyncio
import json
import random
import statistics
from collections.abc import AsyncIterator

import numpy as np
import pytest

from tokenyard.api.sse import SSEEvent
from tokenyard.bench.loadgen import (
    Target,
    interpret_anthropic,
    interpret_openai,
    parse_server_timing,
    read_stream,
    stages_from_timings,
)
from tokenyard.bench.stats import (
    RequestRecord,
    difference,
    distribution,
    meets_slo,
    percentile,
    summarize,
)
from tokenyard.bench.workloads import LengthDist, RequestSpec, make_workload, multiturn

# ---------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_percentile_matches_numpy_linear_interpolation(n: int) -> None:
    rng = random.Random(n)
    values = [rng.lognormvariate(0, 1) for _ in range(n)]
    for q in (0, 1, 10, 33.3, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_refuses_no_values_and_q_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def _record(i: int, ttft_ms: float | None = 10.0, itls_ms: tuple[float, ...] = (5.0,),
            error: str | None = None, tokens: int = 2) -> RequestRecord:
    return RequestRecord(
        index=i, scheduled_s=0.0, start_s=0.0, ok=error is None,
        ttft_s=None if ttft_ms is None else ttft_ms / 1000,
        itls_s=[x / 1000 for x in itls_ms], e2e_s=0.1, output_tokens=tokens, error=error,
    )


def test_goodput_counts_completed_requests_meeting_both_slos_per_second() -> None:
    records = [
        _record(0, 50, (10, 10)),     # meets both
        _record(1, 250, (10,)),       # TTFT too slow
        _record(2, 50, (10, 40)),     # mean ITL 25 ms: too slow
        _record(3, 50, ()),           # one chunk: no ITL, meets the ITL SLO
        _record(4, 50, (1,), error="http_500"),  # failed: never counts
    ]
    report = summarize(records, duration_s=2.0, slo_ttft_ms=100, slo_itl_ms=20)
    assert report.goodput == pytest.approx(2 / 2.0)
    assert [meets_slo(r, 100, None) for r in records] == [True, False, True, True, False]
    assert summarize(records, 2.0).goodput is None  # no SLO, no goodput


def test_summary_counts_failures_by_type_and_pools_itls() -> None:
    records = [_record(i, 10 * (i + 1), (2.0, 4.0), tokens=3) for i in range(4)]
    records += [_record(4, error="http_503"), _record(5, error="http_503"),
                _record(6, error="stream_server_error")]
    records[4].error_detail = "service_unavailable_error: busy"
    report = summarize(records, duration_s=4.0)
    assert (report.sent, report.completed, report.failed) == (7, 4, 3)
    assert report.failures == {"http_503": 2, "stream_server_error": 1}
    assert report.failure_examples["http_503"] == "service_unavailable_error: busy"
    assert report.request_rate == pytest.approx(1.0)
    assert report.output_token_rate == pytest.approx(12 / 4.0)
    assert report.itl_ms is not None and report.itl_ms.count == 8
    assert report.itl_ms.mean == pytest.approx(3.0)
    assert report.ttft_ms is not None and report.ttft_ms.p50 == pytest.approx(25.0)
    # TPOT: (e2e - ttft) / (tokens - 1) per request.
    assert report.tpot_ms is not None
    assert report.tpot_ms.max == pytest.approx((100 - 10) / 2)


def test_difference_is_other_minus_base_at_each_percentile() -> None:
    base = distribution([0.010, 0.020, 0.030])
    other = distribution([0.012, 0.025, 0.040])
    diff = difference(base, other)
    assert diff is not None
    assert diff["p50"] == pytest.approx(5.0)
    assert diff["p99"] == pytest.approx((25 + 0.98 * 15) - (20 + 0.98 * 10))
    assert difference(base, None) is None


# ---------------------------------------------------------------------------- streams


def _ev(data: object, event: str | None = None) -> SSEEvent:
    return SSEEvent(event=event, data=data if isinstance(data, str) else json.dumps(data))


def test_openai_chunks_carry_content_usage_and_the_terminator() -> None:
    role = interpret_openai(_ev({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]}))
    assert role.content == "" and not role.done
    chat = interpret_openai(_ev({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}))
    assert chat.content == "Hi"
    text = interpret_openai(_ev({"choices": [{"index": 0, "text": " there"}]}))
    assert text.content == " there"
    usage = interpret_openai(_ev({"choices": [], "usage": {"prompt_tokens": 7,
                                                           "completion_tokens": 3},
                                  "timings": {"decode": 1.5, "queue": 0.25}}))
    assert (usage.prompt_tokens, usage.output_tokens) == (7, 3)
    assert usage.timings == {"decode": 1.5, "queue": 0.25}
    assert usage.cached_tokens is None  # no prompt_tokens_details: unknown, not 0
    cached = interpret_openai(_ev({"choices": [], "usage": {
        "prompt_tokens": 40, "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 32}}}))
    assert (cached.prompt_tokens, cached.cached_tokens) == (40, 32)
    assert interpret_openai(_ev("[DONE]")).done


def test_openai_error_event_reports_its_type() -> None:
    err = interpret_openai(_ev({"error": {"message": "boom", "type": "server_error",
                                          "param": None, "code": None}}))
    assert (err.error, err.error_detail) == ("server_error", "boom")


def test_anthropic_events_carry_usage_text_errors_and_the_stop() -> None:
    start = interpret_anthropic(_ev({"type": "message_start", "message": {
        "usage": {"input_tokens": 12, "output_tokens": 0}}}, "message_start"))
    assert start.prompt_tokens == 12 and start.output_tokens is None
    delta = interpret_anthropic(_ev({"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "text_delta", "text": "ok"}},
                                    "content_block_delta"))
    assert delta.content == "ok"
    assert interpret_anthropic(_ev({"type": "ping"}, "ping")) == interpret_anthropic(
        _ev({"type": "content_block_stop", "index": 0}, "content_block_stop"))
    end = interpret_anthropic(_ev({"type": "message_delta", "usage": {"output_tokens": 5}},
                                  "message_delta"))
    assert end.output_tokens == 5
    stop = interpret_anthropic(_ev({"type": "message_stop", "timings": {"decode": 2}},
                                   "message_stop"))
    assert stop.done and stop.timings == {"decode": 2.0}
    err = interpret_anthropic(_ev({"type": "error", "error": {
        "type": "overloaded_error", "message": "busy"}}, "error"))
    assert (err.error, err.error_detail) == ("overloaded_error", "busy")


class _Content:
    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    async def iter_any(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


class _Response:
    """What `read_stream` uses of an aiohttp response: `.content.iter_any()`."""

    def __init__(self, body: bytes, piece: int) -> None:
        self.content = _Content([body[i:i + piece] for i in range(0, len(body), piece)])


def _read(body: bytes, api: str, piece: int = 7) -> RequestRecord:
    record = RequestRecord(index=0, scheduled_s=0.0, start_s=0.0)
    asyncio.run(read_stream(_Response(body, piece), api, record, 0.0))  # type: ignore[arg-type]
    record.ok = record.error is None
    return record


def _openai_stream(*texts: str, usage: bool = True, error: bool = False) -> bytes:
    out = b": keep-alive comment\n\n"
    out += b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    for text in texts:
        out += b"data: " + json.dumps({"choices": [{"index": 0, "delta": {
            "content": text}}]}).encode() + b"\n\n"
        out += b": ping\n\n"
    if error:
        return out + b'data: {"error":{"message":"engine failed","type":"server_error"}}\n\n'
    if usage:
        out += (b'data: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":9},'
                b'"timings":{"queue":1.0,"decode":3.5}}\n\n')
    return out + b"data: [DONE]\n\n"


@pytest.mark.parametrize("piece", [1, 7, 4096])
def test_an_openai_stream_split_anywhere_gives_one_record(piece: int) -> None:
    record = _read(_openai_stream("a", "b", "c"), "openai-chat", piece)
    assert record.ok and record.ttft_s is not None
    assert len(record.itls_s) == 2  # three content chunks; comments are not content
    assert (record.prompt_tokens, record.output_tokens) == (4, 9)
    assert record.server_timing_ms == {"queue": 1.0, "decode": 3.5}


def test_without_usage_output_tokens_are_the_content_chunks() -> None:
    record = _read(_openai_stream("a", "b", usage=False), "openai-chat")
    assert record.ok and record.output_tokens == 2


def test_an_error_event_fails_the_request_with_its_type() -> None:
    record = _read(_openai_stream("a", error=True), "openai-chat")
    assert not record.ok
    assert record.error == "stream_server_error"
    assert record.error_detail == "engine failed"


def test_a_stream_without_its_terminator_is_incomplete() -> None:
    body = _openai_stream("a").removesuffix(b"data: [DONE]\n\n")
    assert _read(body, "openai-chat").error == "incomplete_stream"


def test_an_anthropic_stream_with_an_error_event_fails() -> None:
    body = (b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
            b'{"input_tokens":3}}}\n\n'
            b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
            b'"delta":{"type":"text_delta","text":"x"}}\n\n'
            b'event: error\ndata: {"type":"error","error":{"type":"api_error",'
            b'"message":"down"}}\n\n')
    record = _read(body, "anthropic")
    assert record.error == "stream_api_error" and record.prompt_tokens == 3


# ---------------------------------------------------------------------------- Server-Timing


def test_server_timing_header_parses_into_stages_in_ms() -> None:
    header = ('parse;dur=0.236, template;dur=15.394,tokenize;dur=0.4 , '
              'cache;desc="hit, warm";dur=2, miss, db;dur=abc, edge;dur="1.5"')
    assert parse_server_timing(header) == {
        "parse": 0.236, "template": 15.394, "tokenize": 0.4, "cache": 2.0, "edge": 1.5,
    }
    assert parse_server_timing("") == {}


def test_llama_cpp_timings_keep_only_their_durations() -> None:
    timings = {"prompt_n": 10, "prompt_ms": 12.5, "predicted_n": 4, "predicted_ms": 40.0,
               "predicted_per_second": 100.0}
    assert stages_from_timings(timings) == {"prompt": 12.5, "predicted": 40.0}
    assert stages_from_timings(None) is None


# ---------------------------------------------------------------------------- workloads


def test_fixed_lengths_are_exact_and_other_distributions_stay_near_their_mean() -> None:
    rng = random.Random(0)
    assert {LengthDist(50).sample(rng) for _ in range(20)} == {50}
    uniform = [LengthDist(100, "uniform", 0.5).sample(rng) for _ in range(4000)]
    assert min(uniform) >= 50 and max(uniform) <= 150
    assert statistics.mean(uniform) == pytest.approx(100, abs=3)
    normal = [LengthDist(200, "normal", 0.1).sample(rng) for _ in range(4000)]
    assert statistics.mean(normal) == pytest.approx(200, abs=2)
    assert statistics.stdev(normal) == pytest.approx(20, rel=0.1)
    assert min(LengthDist(2, "normal", 5.0).sample(rng) for _ in range(500)) == 1
    with pytest.raises(ValueError):
        LengthDist(10, "zipf")


def test_synthetic_prompts_have_the_drawn_number_of_words_and_repeat_with_the_seed() -> None:
    def take(seed: int) -> list[RequestSpec]:
        workload = make_workload("synthetic", LengthDist(30, "uniform", 0.5),
                                 LengthDist(8), seed)
        return [next(workload) for _ in range(20)]

    specs = take(1)
    assert specs == take(1) and specs != take(2)
    for spec in specs:
        assert len(spec.messages[0]["content"].split()) == spec.input_len
        assert spec.max_tokens == 8


def test_multiturn_requests_extend_their_conversation_s_previous_turn() -> None:
    workload = multiturn(LengthDist(5), LengthDist(3), seed=0, turns=3, conversations=2)
    last: dict[int, RequestSpec] = {}
    specs = [next(workload) for _ in range(12)]
    for spec in specs:
        assert spec.conversation is not None
        previous = last.get(spec.conversation)
        if previous is None:
            assert spec.turn == 0 and len(spec.messages) == 1
        else:
            assert spec.turn == previous.turn + 1
            assert spec.messages[:len(previous.messages)] == previous.messages
            assert spec.messages[len(previous.messages)]["role"] == "assistant"
        last[spec.conversation] = spec
    assert max(s.turn for s in specs) == 2
    assert len({s.conversation for s in specs}) == 4  # two slots, each refilled once
    assert "Assistant:" in specs[-1].prompt_text()


def test_target_bodies_follow_each_api() -> None:
    spec = RequestSpec([{"role": "user", "content": "hi"}], 5, 1)
    chat = json.loads(Target("http://h/v1", "m", "openai-chat", ignore_eos=True).body(spec))
    assert chat["stream_options"] == {"include_usage": True} and chat["ignore_eos"] is True
    completion = json.loads(Target("http://h/v1", "m", "openai-completions").body(spec))
    assert completion["prompt"] == "hi" and "messages" not in completion
    anthropic = Target("http://h/v1", "m", "anthropic", api_key="k")
    assert anthropic.url == "http://h/v1/messages"
    assert "stream_options" not in json.loads(anthropic.body(spec))
    assert anthropic.headers()["Authorization"] == "Bearer k"
