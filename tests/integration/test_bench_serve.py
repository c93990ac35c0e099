"""`tokenyard bench serve` and `bench gateway` against the mock replica, with
`tokenyard serve --replica-url` in front of it: real processes, no model.

One mock and one tokenyard serve the module (tokenyard reads the embedded tokenizer when it
starts, a few seconds); `bench gateway` starts its own pair.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tokenyard.balancer.replica_client import ReplicaClient
from tokenyard.bench.children import Child, start_mock, start_tokenyard
from tokenyard.bench.mock_core import MOCK_TOKENS, MockConfig
from tokenyard.bench.mock_replica import CONFIG_PATH
from tokenyard.cli import main as cli_main
from tokenyard.wire.sampling_params import SamplingParams

OUTPUT_LEN = 6


@dataclass(frozen=True)
class Stack:
    mock: Child
    tokenyard: Child
    api_key: str

    @property
    def base_url(self) -> str:
        return self.tokenyard.url + "/v1"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    mock = start_mock(MockConfig(output_len=OUTPUT_LEN, itl_ms=1.0))
    try:
        tokenyard, api_key = start_tokenyard(mock.url)
        assert api_key, "".join(tokenyard.lines)
        try:
            yield Stack(mock, tokenyard, api_key)
        finally:
            # Graceful shutdown is part of the contract: SIGTERM → exit 0.
            assert tokenyard.stop() == 0, "".join(tokenyard.lines)
    finally:
        mock.stop()


async def _post(url: str, body: dict[str, Any], api_key: str | None = None) -> Any:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with aiohttp.ClientSession() as session, session.post(
        url, json=body, headers=headers
    ) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def _bench_serve(tmp_path: Path, stack: Stack, *args: str) -> dict[str, Any]:
    out = tmp_path / "results.json"
    cli_main(["bench", "serve", "--quiet", "--out", str(out), "--base-url", stack.base_url,
              "--api-key", stack.api_key, *args])
    return json.loads(out.read_text())


@pytest.mark.parametrize("api,load", [
    ("openai-chat", ["--concurrency", "3"]),
    ("anthropic", ["--rate", "40"]),
])
def test_bench_serve_reports_every_request_it_sent(
    stack: Stack, tmp_path: Path, api: str, load: list[str]
) -> None:
    doc = _bench_serve(tmp_path, stack, "--api", api,
                       "--requests", "10", "--input-len", "20", "--output-len", "50",
                       "--plot-dir", str(tmp_path / "plots"), *load)
    assert doc["config"]["model"] == "mock"  # found through GET /v1/models
    (level,) = doc["levels"]
    report = level["report"]
    assert (report["sent"], report["completed"], report["failed"]) == (10, 10, 0)
    assert report["output_tokens"] == 10 * OUTPUT_LEN  # the mock stops before max_tokens
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert report[name]["count"] > 0 and report[name]["p50"] > 0, name
    # tokenyard sends the replica steps already waiting in one write, so the client reads
    # many tokens together and most gaps can be 0: some are not.
    assert report["itl_ms"]["count"] > 0 and report["itl_ms"]["p99"] > 0, report["itl_ms"]
    assert report["e2e_ms"]["p50"] >= report["ttft_ms"]["p50"]
    assert report["request_rate"] > 0 and report["output_token_rate"] > 0
    assert {"tokenize", "decode"} <= set(report["server_timing_ms"])
    plots = {p.name for p in (tmp_path / "plots").iterdir()}
    assert plots == {"latency_cdf.png", "stage_waterfall.png"}


def test_a_list_of_rates_runs_one_open_loop_level_each(stack: Stack, tmp_path: Path) -> None:
    doc = _bench_serve(tmp_path, stack, "--requests", "4", "--input-len", "10",
                       "--output-len", "4", "--rate", "20,40")
    assert [level["rate"] for level in doc["levels"]] == [20.0, 40.0]
    assert all(level["report"]["completed"] == 4 for level in doc["levels"])


def test_completion_prompts_are_as_many_tokens_as_words(stack: Stack, tmp_path: Path) -> None:
    doc = _bench_serve(tmp_path, stack, "--api", "openai-completions",
                       "--requests", "4", "--input-len", "40", "--output-len", "4",
                       "--concurrency", "1,2", "--plot-dir", str(tmp_path / "plots"))
    for level in doc["levels"]:
        assert level["report"]["prompt_tokens"] == 4 * 40
    assert (tmp_path / "plots" / "throughput_concurrency.png").exists()


def test_the_mock_s_token_ids_decode_to_its_sentence_through_tokenyard(stack: Stack) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    through = asyncio.run(_post(stack.base_url + "/chat/completions", body, stack.api_key))
    direct = asyncio.run(_post(stack.mock.url + "/v1/chat/completions", body))
    expected = "".join(text for _, text in MOCK_TOKENS[:5])
    assert through["choices"][0]["message"]["content"] == expected
    assert direct["choices"][0]["message"]["content"] == expected


def test_the_mock_speaks_the_replica_protocol(stack: Stack) -> None:
    async def scenario() -> None:
        async with ReplicaClient(stack.mock.url) as client:
            info = await client.info()
            assert info.model == "mock" and info.vocab_size >= 49152
            assert await client.health()
            short = [d async for d in client.generate("a", [1, 2], SamplingParams(max_tokens=3))]
            assert [d.new_token_ids[0] for d in short] == [t for t, _ in MOCK_TOKENS[:3]]
            assert [d.finish_reason for d in short] == [None, None, "length"]
            # Queue and prefill times ride on the first delta only, as from the engine.
            assert (short[0].queue_time, short[0].prefill_time) == (0.0, 0.0)
            assert all(d.prefill_time is None for d in short[1:])
            endless = SamplingParams(max_tokens=100_000, ignore_eos=True)
            finishes = []
            async for delta in client.generate("b", [1], endless):
                if not finishes:
                    assert (await client.stats()).num_running == 1
                    await client.abort("b")
                finishes.append(delta.finish_reason)
            assert finishes[-1] == "abort" and len(finishes) < 100
            async for delta in client.generate("c", [1], endless):
                if delta.finish_reason is None:
                    await client.stop("c", "fox")
                else:
                    assert (delta.finish_reason, delta.stop_reason) == ("stop", "fox")

    asyncio.run(scenario())


def test_a_stop_string_through_tokenyard_ends_the_mock_s_stream(stack: Stack) -> None:
    body = {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 50, "stop": [" jumps"]}
    reply = asyncio.run(_post(stack.base_url + "/chat/completions", body, stack.api_key))
    choice = reply["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        " The quick brown fox", "stop")


def test_injected_failures_count_as_failed_requests_of_their_type(
    stack: Stack, tmp_path: Path
) -> None:
    config_url = stack.mock.url + CONFIG_PATH
    args = ["--requests", "6", "--concurrency", "2",
            "--input-len", "10", "--output-len", "8"]
    try:
        asyncio.run(_post(config_url, {"inject_500": 1.0}))
        report = _bench_serve(tmp_path, stack, *args)["levels"][0]["report"]
        assert (report["completed"], report["failures"]) == (0, {"http_500": 6})
        asyncio.run(_post(config_url, {"inject_500": 0.0, "inject_stream_error": 1.0}))
        report = _bench_serve(tmp_path, stack, *args)["levels"][0]["report"]
        assert (report["completed"], report["failures"]) == (0, {"stream_server_error": 6})
    finally:
        asyncio.run(_post(config_url, {"inject_500": 0.0, "inject_stream_error": 0.0}))


def test_bench_gateway_reports_direct_and_gateway_figures(tmp_path: Path) -> None:
    out = tmp_path / "gateway.json"
    assert cli_main(["bench", "gateway", "--rates", "10", "--duration", "1.5", "--quiet",
                     "--output-len", "4", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(p["rate"], p["stream"]) for p in doc["points"]] == [(10, True), (10, False)]
    for point in doc["points"]:
        for side in ("direct", "gateway"):
            report = point[side]["report"]
            assert report["completed"] == report["sent"] > 0
            assert report["e2e_ms"]["p50"] > 0
        # tokenyard's CPU time, read from /proc while it served these requests: some, and
        # far from a core's worth at 10 requests/s (a few ms each; bounds for a busy host).
        gateway = point["gateway"]
        assert 0 < gateway["tokenyard_cpu_ms_per_request"] < 100, gateway
        assert 0 < gateway["tokenyard_cpu_pct"] < 100, gateway
        assert gateway["tokenyard_rss_mib"] > 0
        assert set(point["overhead_e2e_ms"]) >= {"p50", "p99"}
    assert doc["tokenyard_peak_rss_mib"] > 0
