"""Raw HTTP against `tokenyard serve`: client faults get the right status and shape."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.e2e.conftest import Server, all_blocks_back

#: The server's bearer header, filled in once the session's server is up.
AUTH: dict[str, str] = {}


@pytest.fixture(autouse=True)
def _auth(server: Server) -> None:
    AUTH.update(server.headers)


def _chat(server: Server, **extra: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4, **extra}


def test_replica_overload_maps_to_503_and_529_with_retry_after() -> None:
    from tokenyard.api.errors import render_anthropic, render_openai
    from tokenyard.balancer.generation import replica_error as _replica_error
    from tokenyard.balancer.replica_client import ReplicaOverloaded, ReplicaRequestError

    err = _replica_error(ReplicaOverloaded(2.0, "queue full", "overloaded"))
    openai_err, anthropic_err = render_openai(err), render_anthropic(err)
    assert openai_err.status == 503 and anthropic_err.status == 529
    assert openai_err.headers["retry-after"] == anthropic_err.headers["retry-after"] == "2"
    too_long = _replica_error(ReplicaRequestError(400, "too long", "messages",
                                                  "context_length_exceeded"))
    assert (too_long.status, too_long.code) == (400, "context_length_exceeded")


async def _post(url: str, data: bytes | str, headers: dict[str, str] | None = None
                ) -> tuple[int, Any, Any]:
    async with aiohttp.ClientSession(headers=AUTH) as session, session.post(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        return r.status, await r.json(content_type=None), r.headers


def post(url: str, data: bytes | str, headers: dict[str, str] | None = None
         ) -> tuple[int, Any, Any]:
    return asyncio.run(_post(url, data, headers))


def get(url: str) -> tuple[int, Any, Any]:
    async def go() -> tuple[int, Any, Any]:
        async with aiohttp.ClientSession(headers=AUTH) as session, session.get(url) as r:
            return r.status, await r.json(content_type=None), r.headers
    return asyncio.run(go())


def assert_openai_error(body: Any, param: str | None = None) -> None:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param


def assert_anthropic_error(body: Any) -> None:
    assert body["type"] == "error"
    assert body["error"]["type"] and body["error"]["message"]


def test_malformed_json(server: Server) -> None:
    status, body, _ = post(server.base_url + "/v1/chat/completions", b'{"model": ')
    assert status == 400
    assert_openai_error(body)
    status, body, _ = post(server.base_url + "/v1/messages", b"{nope")
    assert status == 400
    assert_anthropic_error(body)


def test_wrong_types(server: Server) -> None:
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, temperature="hot")))
    assert status == 400
    assert_openai_error(body, "temperature")
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps({"model": server.model, "messages": "hi"}))
    assert status == 400
    assert_openai_error(body, "messages")


def test_huge_body_is_413(server: Server) -> None:
    big = json.dumps(_chat(server, user="x" * (5 * 2**20)))
    status, body, _ = post(server.base_url + "/v1/chat/completions", big)
    assert status == 413
    assert_openai_error(body)
    status, body, _ = post(server.base_url + "/v1/messages", big)
    assert status == 413
    assert_anthropic_error(body)


def test_deep_nesting(server: Server) -> None:
    deep = '{"model": "m", "messages": ' + "[" * 100_000 + "]" * 100_000 + "}"
    status, body, _ = post(server.base_url + "/v1/chat/completions", deep)
    assert status == 400
    assert_openai_error(body)


def test_an_unknown_field_is_a_400_naming_it(server: Server) -> None:
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, not_a_field=1)))
    assert status == 400
    assert_openai_error(body, "not_a_field")
    assert body["error"]["message"] == "Unrecognized request argument supplied: not_a_field"


def test_ignore_eos_generates_the_whole_max_tokens(server: Server) -> None:
    # "Say OK." ends early greedily; with ignore_eos it runs to max_tokens.
    messages = [{"role": "user", "content": "Say OK."}]
    plain = {"messages": messages, "max_tokens": 200, "temperature": 0}
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, **plain)))
    assert status == 200 and body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 200
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, **plain, ignore_eos=True)))
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 200


def test_empty_messages(server: Server) -> None:
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps({"model": server.model, "messages": []}))
    assert status == 400
    assert_openai_error(body, "messages")
    status, body, _ = post(server.base_url + "/v1/messages",
                           json.dumps({"model": server.model, "messages": [],
                                       "max_tokens": 4}))
    assert status == 400
    assert_anthropic_error(body)


def test_unsupported_parameters_are_named(server: Server) -> None:
    functions = [{"name": "f", "parameters": {}}]
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, functions=functions)))
    assert status == 400
    assert_openai_error(body, "functions")


def test_context_length_exceeded(server: Server) -> None:
    status, body, _ = post(server.base_url + "/v1/chat/completions",
                           json.dumps(_chat(server, max_tokens=10**6)))
    assert status == 400
    assert body["error"]["code"] == "context_length_exceeded"


def test_request_id_echoed_or_generated(server: Server) -> None:
    _, _, headers = post(server.base_url + "/v1/chat/completions", json.dumps(_chat(server)),
                         {"x-request-id": "my-id-42"})
    # The client's id is kept as the prefix of a unique id (api/middleware.py).
    assert re.fullmatch(r"my-id-42\.[0-9a-f]{16}", headers["x-request-id"])
    timing = headers["Server-Timing"]
    stages = [entry.split(";")[0] for entry in timing.split(", ")]
    # With the gateway on: authenticate first, then authorize, limit, billing pre-check.
    assert stages == ["auth", "parse", "template", "tokenize", "authorize", "limit",
                      "billing", "queue", "prefill", "decode", "balance", "detokenize"]
    _, _, headers = post(server.base_url + "/v1/chat/completions", b"{",
                         {"x-request-id": "no spaces allowed"})
    assert re.fullmatch(r"req_[0-9a-f]{32}", headers["x-request-id"])


def test_operational_routes(server: Server) -> None:
    assert get(server.base_url + "/healthz")[0] == 200
    assert get(server.base_url + "/readyz")[0] == 200
    status, doc, _ = get(server.base_url + "/openapi.json")
    assert status == 200 and "/v1/chat/completions" in doc["paths"]
    assert "ChatCompletionRequest" in doc["components"]["schemas"]
    status, body, _ = get(server.base_url + "/v1/nowhere")
    assert status == 404
    assert_openai_error(body)


async def _replica_stats(session: aiohttp.ClientSession, server: Server) -> dict[str, Any]:
    """The replica's own engine stats (GET /v1/engine/stats, with the replica's token)."""
    async with session.get(server.replica_url + "/v1/engine/stats",
                           headers=server.replica_headers) as r:
        assert r.status == 200, await r.text()
        stats: dict[str, Any] = await r.json()
        return stats


async def _wait_idle(session: aiohttp.ClientSession, server: Server) -> dict[str, Any]:
    """The replica's stats once nothing runs and every KV block is free (or after 2 s)."""
    deadline = time.monotonic() + 2.0
    while True:
        stats = await _replica_stats(session, server)
        idle = (stats["num_running"] == 0 and stats["num_waiting"] == 0
                and all_blocks_back(stats))
        if idle or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


async def _long_stream(session: aiohttp.ClientSession, server: Server) -> aiohttp.ClientResponse:
    """A streamed 400-token chat completion, once its first three events have arrived."""
    response = await session.post(
        server.base_url + "/v1/chat/completions",
        json=_chat(server, max_tokens=400, min_tokens=400, stream=True),
    )
    assert response.status == 200
    chunks = 0
    async for line in response.content:
        chunks += line.startswith(b"data: ")
        if chunks >= 3:
            break
    return response


def test_disconnect_mid_stream_frees_the_replica(server: Server) -> None:
    async def go() -> dict[str, Any]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            response = await _long_stream(session, server)
            response.close()  # go away mid-stream
            return await _wait_idle(session, server)

    stats = asyncio.run(go())
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert all_blocks_back(stats), stats


def test_disconnect_while_waiting_for_a_non_streamed_answer(server: Server) -> None:
    async def go() -> tuple[dict[str, Any], dict[str, Any]]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            request = asyncio.create_task(session.post(
                server.base_url + "/v1/chat/completions",
                json=_chat(server, max_tokens=400, min_tokens=400),
            ))
            await asyncio.sleep(0.7)
            busy = await _replica_stats(session, server)
            request.cancel()  # closes the connection: the server's handler is cancelled
            with contextlib.suppress(asyncio.CancelledError):
                await request
            return busy, await _wait_idle(session, server)

    busy, stats = asyncio.run(go())
    assert busy["num_running"] == 1, busy
    assert stats["num_running"] == 0 and all_blocks_back(stats), stats


def test_64_concurrent_streams_complete_with_usage(server: Server) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, dict[str, Any]]:
        body = {"model": server.model, "max_tokens": 8, "min_tokens": 8, "stream": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": f"Count to {i}."}]}
        async with session.post(server.base_url + "/v1/chat/completions", json=body) as r:
            assert r.status == 200
            events = [line[6:] async for line in r.content if line.startswith(b"data: ")]
        assert events[-1].strip() == b"[DONE]"
        text_chunks = sum(
            1 for e in events[:-1] if json.loads(e)["choices"]
            and json.loads(e)["choices"][0]["delta"].get("content")
        )
        return text_chunks, json.loads(events[-2])["usage"]

    async def go() -> list[tuple[int, dict[str, Any]]]:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), headers=AUTH
        ) as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    results = asyncio.run(go())
    assert len(results) == 64
    for text_chunks, usage in results:
        assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] > 0
        assert 0 < text_chunks <= 8


def _sse_events(raw: bytes) -> list[Any]:
    """The JSON payloads of a stream's events, either API's (named events or not)."""
    lines = [line for event in raw.split(b"\n\n") for line in event.split(b"\n")]
    return [json.loads(line[6:]) for line in lines
            if line.startswith(b"data: ") and line != b"data: [DONE]"]


async def _raw_post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None
                    ) -> tuple[Any, bytes]:
    async with aiohttp.ClientSession(headers=AUTH) as session, session.post(
        url, headers=headers, json=body
    ) as r:
        return r.headers, await r.read()


def test_stream_header_has_the_stages_before_the_first_byte_and_the_last_event_all(
    server: Server,
) -> None:
    headers, raw = asyncio.run(_raw_post(server.base_url + "/v1/chat/completions",
                                         _chat(server, stream=True), {"x-request-id": "s-1"}))
    assert headers["x-request-id"].startswith("s-1.")
    assert headers["content-type"].startswith("text/event-stream")
    header_stages = [e.split(";")[0] for e in headers["Server-Timing"].split(", ")]
    assert header_stages == ["auth", "parse", "template", "tokenize", "authorize", "limit",
                             "billing", "queue", "prefill", "balance"]
    assert raw.endswith(b"data: [DONE]\n\n")
    events = _sse_events(raw)
    assert all("timings" not in e for e in events[:-1])
    timings = events[-1]["timings"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert set(timings) >= {"parse", "tokenize", "queue", "prefill", "decode", "detokenize"}
    assert all(v >= 0 for v in timings.values()) and timings["prefill"] > 0
    # With include_usage the usage chunk is last, and it carries the timings.
    _, raw = asyncio.run(_raw_post(server.base_url + "/v1/chat/completions", _chat(
        server, stream=True, stream_options={"include_usage": True})))
    events = _sse_events(raw)
    assert events[-1]["choices"] == [] and "decode" in events[-1]["timings"]


def test_anthropic_message_stop_carries_the_timings(server: Server) -> None:
    _, raw = asyncio.run(_raw_post(server.base_url + "/v1/messages", {
        "model": server.model, "max_tokens": 3, "stream": True,
        "messages": [{"role": "user", "content": "Hi"}]}))
    events = _sse_events(raw)
    assert events[-1]["type"] == "message_stop" and events[-1]["timings"]["decode"] >= 0


def test_streamed_completions_of_several_prompts_run_and_arrive_together(
    server: Server,
) -> None:
    body = {"model": server.model, "prompt": ["The sky is", "Paris is the capital of"],
            "max_tokens": 8, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    _, raw = asyncio.run(_raw_post(server.base_url + "/v1/completions", body))
    events = _sse_events(raw)
    order = [e["choices"][0]["index"] for e in events if e["choices"]]
    assert sorted(set(order)) == [0, 1]
    # Interleaved: prompt 1's first token comes before prompt 0's last.
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)
    usage = events[-1]["usage"]
    assert usage is not None, events[-3:]
    assert usage["completion_tokens"] == 16


# ---------------------------------------------------------------------------- fake replica
# Overload and a failure after the stream began cannot be provoked on demand from the real
# engine, so these run the HTTP app against a scripted replica (no model is loaded: the
# tokenizer is read from the model's files only).


def _fake_replica(mode: str) -> web.Application:
    from tokenyard.wire.protocol import dumps, encode_stream_error, error_body

    async def info(request: web.Request) -> web.Response:
        return web.json_response({
            "model": "fake", "max_model_len": 2048, "vocab_size": 49152,
            "eos_token_ids": [2], "block_size": 16, "num_kv_blocks": 64,
        })

    async def generate(request: web.Request) -> web.StreamResponse:
        if mode == "overloaded":
            return web.Response(status=503, body=dumps(error_body("full", "overloaded")),
                                headers={"Retry-After": "3"},
                                content_type="application/json")
        response = web.StreamResponse()
        await response.prepare(request)
        delta = {"new_token_ids": [28120], "new_logprobs": None, "finish_reason": None,
                 "stop_reason": None, "num_prompt_tokens": 5, "num_cached_tokens": 0}
        await response.write(dumps(delta) + b"\n")
        await response.write(encode_stream_error("the step failed"))
        return response

    app = web.Application()
    app.router.add_get("/v1/engine/info", info)
    app.router.add_post("/v1/engine/generate", generate)
    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app.router.add_get("/healthz", health)
    return app


async def _with_fake(mode: str, path: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
    from tokenyard.api.app import build_state, make_app
    from tokenyard.config import default_cache_dir
    from tokenyard.deployments import BalancerSpec

    replica = web.AppRunner(_fake_replica(mode))
    await replica.setup()
    site = web.TCPSite(replica, "127.0.0.1", 0)
    await site.start()
    replica_url = f"http://127.0.0.1:{replica.addresses[0][1]}"
    # No waiting at the balancer: the fake's own refusal is what the client must see.
    state = await build_state(replica_url, None, default_cache_dir(),
                              balancer=BalancerSpec(queue_timeout_s=0))
    front = web.AppRunner(make_app(state))
    await front.setup()
    await web.TCPSite(front, "127.0.0.1", 0).start()
    try:
        async with aiohttp.ClientSession(headers=AUTH) as session, session.post(
            f"http://127.0.0.1:{front.addresses[0][1]}{path}", json=body
        ) as r:
            return r.status, r.headers, await r.read()
    finally:
        await front.cleanup()
        await replica.cleanup()


_HI = [{"role": "user", "content": "Hi"}]


def test_overloaded_replica_is_503_or_529_with_retry_after() -> None:
    status, headers, raw = asyncio.run(_with_fake(
        "overloaded", "/v1/chat/completions", {"model": "fake", "messages": _HI}))
    assert status == 503 and headers["retry-after"] == "3"
    assert json.loads(raw)["error"]["type"]
    status, headers, raw = asyncio.run(_with_fake(
        "overloaded", "/v1/messages", {"model": "fake", "messages": _HI, "max_tokens": 4}))
    assert status == 529 and headers["retry-after"] == "3"
    assert json.loads(raw)["error"]["type"] == "overloaded_error"


def test_failure_after_the_stream_began_is_an_error_event() -> None:
    status, _, raw = asyncio.run(_with_fake(
        "midstream", "/v1/chat/completions",
        {"model": "fake", "messages": _HI, "stream": True}))
    assert status == 200
    events = [line for line in raw.split(b"\n\n") if line.startswith(b"data: ")]
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"
    assert "error" in json.loads(events[-1][6:])
    status, _, raw = asyncio.run(_with_fake(
        "midstream", "/v1/messages",
        {"model": "fake", "messages": _HI, "max_tokens": 4, "stream": True}))
    assert status == 200 and b"event: error\n" in raw


def _metric_values(text: str) -> dict[str, float]:
    """The samples of a Prometheus text page, by series (name and labels)."""
    return {line.split()[0]: float(line.split()[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_metrics_show_the_replica_busy_then_idle_with_every_kv_block_free(
    server: Server,
) -> None:
    async def scenario() -> tuple[dict[str, float], ...]:
        async with aiohttp.ClientSession(headers=AUTH) as session:
            async def metrics() -> dict[str, float]:
                async with session.get(f"{server.base_url}/metrics") as resp:
                    assert resp.status == 200
                    assert resp.headers["Content-Type"].startswith("text/plain")
                    return _metric_values(await resp.text())

            before = await metrics()
            async with session.post(f"{server.base_url}/v1/chat/completions",
                                    json=_chat(server, min_tokens=4)) as resp:
                assert resp.status == 200
                usage = (await resp.json())["usage"]
            after = await metrics()
            # A long stream, read while it runs, then dropped.
            response = await _long_stream(session, server)
            busy = await metrics()
            response.close()
            replica = await _wait_idle(session, server)
            idle = await metrics()
            return before, usage, after, busy, replica, idle

    before, usage, after, busy, replica, idle = asyncio.run(scenario())

    def added(name: str) -> float:
        return after[name] - before.get(name, 0.0)  # a labelled series starts unseen

    # The HTTP process observes each request it served, once, with its real counts.
    assert added('tokenyard:e2e_request_latency_seconds_count{lane="live"}') == 1
    assert added('tokenyard:time_to_first_token_seconds_count{lane="live"}') == 1
    assert added('tokenyard:request_queue_time_seconds_count{lane="live"}') == 1
    assert (added('tokenyard:inter_token_latency_seconds_count{lane="live"}')
            == usage["completion_tokens"] - 1)
    assert added("tokenyard:prompt_tokens_total") == usage["prompt_tokens"]
    assert added("tokenyard:generation_tokens_total") == usage["completion_tokens"] == 4
    assert added('tokenyard:request_success_total{finished_reason="length"}') == 1
    # The engine's figures are the replica's own: read while a stream runs, they show it in
    # the batch holding KV blocks, and its prompt looked up in the prefix cache.
    assert (busy["tokenyard:num_requests_running"], busy["tokenyard:num_requests_waiting"]) \
        == (1, 0), busy
    assert busy["tokenyard:kv_cache_usage_perc"] > 0, busy
    assert busy["tokenyard:prefix_cache_queries"] > after["tokenyard:prefix_cache_queries"]
    # Once the replica is idle with every block free, /metrics says so, and its cumulative
    # counters are the replica's (GET /v1/engine/stats), not a count of the HTTP process's.
    assert replica["num_running"] == 0, replica
    assert all_blocks_back(replica) and replica["num_kv_blocks"] > 0, replica
    assert idle["tokenyard:num_requests_running"] == idle["tokenyard:num_requests_waiting"] == 0
    pinned = replica.get("num_pinned_kv_blocks", 0) / replica["num_kv_blocks"]
    assert idle["tokenyard:kv_cache_usage_perc"] == pytest.approx(pinned)
    assert (idle["tokenyard:prefix_cache_queries"], idle["tokenyard:prefix_cache_hits"],
            idle["tokenyard:num_preemptions_total"]) == (
        replica["prefix_cache_queries"], replica["prefix_cache_hits"],
        replica["num_preemptions"])
