"""External OpenAI-compatible upstreams (`balancer/upstream.py`,
`balancer/upstream_generation.py`): the client's error mapping and the generation's
deltas, usage and early close, against the project's mock OpenAI server (in this
process) and against a real `tokenyard serve --no-auth` (one engine process for the
module); and both dialects' formats over an upstream generation, checked with the
official SDKs' types.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
import anthropic.types
import openai.types
import openai.types.chat
import pytest
from aiohttp import web
from pydantic import TypeAdapter

from tests.e2e.conftest import Server, running_server
from tokenyard.api.anthropic.stream import MessagesFormat
from tokenyard.api.openai.stream import ChatFormat, CompletionFormat
from tokenyard.api.sse import parse_sse
from tokenyard.balancer.replica_client import (
    ReplicaConnectionError,
    ReplicaError,
    ReplicaOverloaded,
    ReplicaRequestError,
    ReplicaStreamError,
)
from tokenyard.balancer.upstream import UpstreamClient, upstream_salt
from tokenyard.balancer.upstream_generation import UpstreamGeneration, request_body
from tokenyard.bench.mock_core import MOCK_MODEL, MOCK_TOKENS, MockConfig
from tokenyard.bench.mock_replica import MockReplica
from tokenyard.errors import APIError
from tokenyard.gateway.generations import finished_completions
from tokenyard.text.content import ImagePart, NormalisedImage, TemplateMessage
from tokenyard.wire.outputs import Completion, RequestOutput
from tokenyard.wire.sampling_params import GuidedDecoding, SamplingParams

T = TypeVar("T")
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colours please."}]
MOCK_PROMPT_WORDS = 6  # the mock counts the words of CHAT
ESTIMATE = 1234  # a prompt estimate no upstream reports


def mock_text(n: int) -> str:
    return "".join(MOCK_TOKENS[i % len(MOCK_TOKENS)][1] for i in range(n))


@asynccontextmanager
async def serving_mock(**config: Any) -> AsyncIterator[tuple[MockReplica, str]]:
    """The mock on a free port of this event loop (its handlers cancelled when the client
    leaves, as `run_mock` serves it), and its OpenAI base URL."""
    mock = MockReplica(MockConfig(**config))
    runner = web.AppRunner(mock.make_app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield mock, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    finally:
        await runner.cleanup()


def with_mock(scenario: Callable[[MockReplica, UpstreamClient], Awaitable[T]],
              **config: Any) -> T:
    async def go() -> T:
        async with serving_mock(**config) as (mock, url), \
                UpstreamClient(url, model=MOCK_MODEL) as client:
            return await scenario(mock, client)
    return asyncio.run(go())


def chat_gen(target: Any, model: str = MOCK_MODEL, **params: Any) -> UpstreamGeneration:
    return UpstreamGeneration(target, "req-1", messages=CHAT, params=SamplingParams(**params),
                              model=model, prompt_tokens_estimate=ESTIMATE)


async def drain(client: UpstreamClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    return [chunk async for chunk in client.open_chat(body)]


async def started_and_read(gen: UpstreamGeneration, outputs: int) -> None:
    """Start `gen` and read `outputs` of its outputs, leaving it open."""
    await gen.start()
    seen = 0
    async for _ in gen:
        seen += 1
        if seen == outputs:
            break


async def outputs_of(gen: UpstreamGeneration) -> list[RequestOutput]:
    await gen.start()
    try:
        return [out async for out in gen]
    finally:
        await gen.close()


# ---------------------------------------------------------------------------- the mock


def test_mock_chat_text_usage_and_timeline() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> UpstreamGeneration:
        gen = chat_gen(client, max_tokens=5, temperature=0.0)
        outs = await outputs_of(gen)
        assert "".join(d.text for o in outs for d in o.deltas) == mock_text(5)
        assert all(d.token_ids == [] for o in outs for d in o.deltas)
        # Until the usage arrives, the prompt count is our estimate; the last has theirs.
        assert outs[0].num_prompt_tokens == ESTIMATE and not outs[0].finished
        assert outs[-1].finished and outs[-1].deltas[-1].finish_reason == "length"
        return gen

    gen = with_mock(scenario, output_len=16)
    assert gen.last is not None
    assert (gen.last.num_prompt_tokens, gen.last.num_output_tokens) == (MOCK_PROMPT_WORDS, 5)
    assert gen.num_prompt_tokens == MOCK_PROMPT_WORDS and gen.num_cached_tokens == 0
    assert gen.finish_reasons == ["length"] and gen.stop_reasons == [None]
    assert not gen.failed
    assert {"queued", "admitted", "first_token", "last_token", "done"} <= set(gen.timeline.events)


def test_mock_completion_of_a_text_prompt() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> UpstreamGeneration:
        gen = UpstreamGeneration(client, "req-2", prompt="one two three", model=MOCK_MODEL,
                                 params=SamplingParams(max_tokens=30),
                                 prompt_tokens_estimate=ESTIMATE)
        outs = await outputs_of(gen)
        assert "".join(d.text for o in outs for d in o.deltas) == mock_text(4)
        return gen

    gen = with_mock(scenario, output_len=4)
    assert gen.finish_reasons == ["stop"] and gen.num_prompt_tokens == 3
    assert gen.last is not None and gen.last.num_output_tokens == 4


@pytest.mark.parametrize("status", [429, 503])
def test_overloaded_upstream_is_replica_overloaded_with_retry_after(status: int) -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> APIError:
        with pytest.raises(ReplicaOverloaded) as refused:
            await drain(client, {"messages": CHAT})
        assert refused.value.retry_after == 0.25  # retry-after-ms wins over retry-after
        # The upstream's own text (it may name its account) is not passed on.
        assert refused.value.message == "the upstream is overloaded; retry after a short wait."
        gen = chat_gen(client)
        with pytest.raises(APIError) as api:
            await gen.start()
        await gen.close()
        assert gen.failed and gen.last is None
        return api.value

    err = with_mock(scenario, **{f"inject_{status}": 1.0})
    assert err.status == 503 and err.headers["retry-after"] == "1"


def test_upstream_500_is_a_connection_error_and_so_is_an_unreachable_one() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> None:
        with pytest.raises(ReplicaConnectionError, match="answered 500: injected failure"):
            await drain(client, {"messages": CHAT})
        async with UpstreamClient("http://127.0.0.1:9/v1", model="x",
                                  connect_timeout=1.0) as gone:
            with pytest.raises(ReplicaConnectionError):
                await drain(gone, {"messages": CHAT})
            assert not await gone.health()
        assert await client.health()

    with_mock(scenario, inject_500=1.0)


def test_upstream_400_keeps_its_message_param_and_code() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> None:
        with pytest.raises(ReplicaRequestError) as refused:
            await drain(client, {"messages": CHAT, "max_tokens": 0})
        err = refused.value
        assert (err.status, err.message, err.param, err.code) == (
            400, "max_tokens must be at least 1", "max_tokens", "invalid_value")

    with_mock(scenario)


def test_mid_stream_failure_is_a_stream_error_after_some_deltas() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> None:
        chunks: list[dict[str, Any]] = []
        with pytest.raises(ReplicaStreamError) as broke:
            async for chunk in client.open_chat({"messages": CHAT, "max_tokens": 8}):
                chunks.append(chunk)
        assert broke.value.message == "the upstream failed while answering"
        assert len(chunks) >= 3  # the role chunk and half the tokens came first
        gen = chat_gen(client, max_tokens=8)
        await gen.start()
        texts: list[str] = []
        with pytest.raises(APIError) as failed:
            async for out in gen:
                texts.extend(d.text for d in out.deltas)
        await gen.close()
        assert failed.value.status == 500 and "failed while answering" in failed.value.message
        assert "injected failure" not in failed.value.message
        assert "".join(texts) == mock_text(4)
        assert gen.failed and gen.finish_reasons == ["abort"]

    with_mock(scenario, inject_stream_error=1.0)


def test_closing_early_closes_the_upstream_stream() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> float:
        gen = chat_gen(client, max_tokens=200)
        await started_and_read(gen, 2)
        assert len(mock.running) == 1  # 200 tokens at 50 ms: ten seconds to go
        began = time.monotonic()
        await gen.close()
        while mock.running and time.monotonic() - began < 5.0:
            await asyncio.sleep(0.01)
        assert not mock.running, "the mock still streams to nobody"
        assert gen.finish_reasons == ["abort"]
        return time.monotonic() - began

    assert with_mock(scenario, output_len=200, itl_ms=50.0) < 1.0


def sse(*events: Any, end: bytes = b"data: [DONE]\r\n\r\n") -> bytes:
    """A canned event stream with CRLF line ends, as some servers send."""
    return b"".join(b"data: " + json.dumps(e).encode() + b"\r\n\r\n" for e in events) + end


def choice(text: str | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    delta = {"content": text} if text is not None else {}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}


def with_route(answer: Callable[[web.Request], Awaitable[web.StreamResponse]],
               scenario: Callable[[UpstreamClient], Awaitable[T]], **client: Any) -> T:
    """`scenario` against a server whose chat route is `answer`, through a client made
    with `client`'s arguments (default model "canned")."""
    async def go() -> T:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", answer)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
            async with UpstreamClient(url, **{"model": "canned", **client}) as upstream:
                return await scenario(upstream)
        finally:
            await runner.cleanup()
    return asyncio.run(go())


def with_canned(body: bytes, scenario: Callable[[UpstreamClient], Awaitable[T]]) -> T:
    """`scenario` against a server whose chat route answers `body` as an event stream."""
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    return with_route(answer, scenario)


def test_vllm_style_stream_stop_reason_and_cached_tokens() -> None:
    usage = {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42,
             "prompt_tokens_details": {"cached_tokens": 32}}
    body = sse(choice("Hel"), choice("lo"), choice(None, "stop", stop_reason="END"),
               {"choices": [], "usage": usage}, end=b"")  # no [DONE]: ended anyway

    async def scenario(client: UpstreamClient) -> UpstreamGeneration:
        gen = chat_gen(client, stop=["END"])
        outs = await outputs_of(gen)
        assert "".join(d.text for o in outs for d in o.deltas) == "Hello"
        return gen

    gen = with_canned(body, scenario)
    assert gen.finish_reasons == ["stop"] and gen.stop_reasons == ["END"]
    assert (gen.num_prompt_tokens, gen.num_cached_tokens, gen.num_output_tokens) == (40, 32, 2)


def test_an_error_event_first_is_a_refusal_and_a_cut_stream_is_broken() -> None:
    refusal = sse({"error": {"message": "prompt too long", "param": "messages",
                             "code": 400}}, end=b"")

    async def refused(client: UpstreamClient) -> None:
        with pytest.raises(ReplicaRequestError) as err:
            await drain(client, {"messages": CHAT})
        assert (err.value.message, err.value.param) == ("prompt too long", "messages")

    with_canned(refusal, refused)

    async def cut(client: UpstreamClient) -> None:
        gen = chat_gen(client)
        await gen.start()
        with pytest.raises(APIError) as err:
            async for _ in gen:
                pass
        await gen.close()
        assert err.value.status == 500 and gen.failed
        # Neither the upstream's address nor the exception met reaches the tenant.
        assert err.value.message == "The engine failed: the upstream broke off its answer"

    with_canned(sse(choice("Hel"), choice("lo"), end=b""), cut)


def test_a_refusal_that_is_no_api_error_keeps_its_text_in_the_log() -> None:
    """A 4xx page from whatever stands in front of the upstream (a proxy's HTML, naming
    its software) is not passed on; a 404 (a wrong URL or model name) is the
    deployment's fault, not the request's."""
    async def answer(request: web.Request) -> web.StreamResponse:
        status = int((await request.json())["model"])  # the status it is told to answer
        return web.Response(status=status, text="<html>nginx/1.25.3 at 10.0.0.9</html>",
                            content_type="text/html")

    async def refused(client: UpstreamClient) -> ReplicaError:
        with pytest.raises(ReplicaError) as err:
            await drain(client, {"messages": CHAT})
        return err.value

    page = with_route(answer, refused, model="413", deployment="up-1")
    assert isinstance(page, ReplicaRequestError) and page.status == 413
    assert page.message == "the upstream deployment up-1 refused the request (413)."
    missing = with_route(answer, refused, model="404", deployment="up-1")
    assert isinstance(missing, ReplicaConnectionError)


def test_a_salt_goes_only_to_a_server_that_keeps_a_cache_per_salt() -> None:
    """The tenant's salt goes, as a digest, to a server that salts its prefix cache (the
    mock remembers prompts per salt, as vLLM does); a server that cannot is not sent it,
    and the cached tokens it reports for a salted request read 0, for they may be another
    tenant's. Unsalted (one tenant, no gateway), its cache is that tenant's own."""
    prompt = " ".join(f"w{i}" for i in range(40))  # two full blocks before the last word

    async def go() -> None:
        async with serving_mock() as (mock, url), \
                UpstreamClient(url, model=MOCK_MODEL, salts_cache=True) as salted, \
                UpstreamClient(url, model=MOCK_MODEL, api_key="k-1") as plain:
            async def run(client: UpstreamClient, salt: str | None) -> tuple[int, Any]:
                gen = UpstreamGeneration(client, "r", prompt=prompt, model=MOCK_MODEL,
                                         params=SamplingParams(max_tokens=2),
                                         prompt_tokens_estimate=1, cache_salt=salt)
                await outputs_of(gen)
                return gen.num_cached_tokens, mock.received[-1]

            cached, seen = await run(salted, "org-a")
            assert cached == 0 and seen.body["cache_salt"] == upstream_salt("org-a")
            assert "org-a" not in seen.body["cache_salt"] and seen.authorization is None
            assert (await run(salted, "org-a"))[0] == 32  # its own cache: hit
            cached, seen = await run(salted, "org-b")
            assert cached == 0 and seen.body["cache_salt"] == upstream_salt("org-b")
            assert upstream_salt("org-a") != upstream_salt("org-b")

            cached, seen = await run(plain, "org-a")
            assert "cache_salt" not in seen.body and seen.authorization == "Bearer k-1"
            assert cached == 0  # the first unsalted prompt: nothing cached yet
            cached, _ = await run(plain, "org-b")
            assert cached == 0  # the server's cache hit org-a's prompt: not shown
            assert (await run(plain, None))[0] == 32  # one tenant: shown

    asyncio.run(go())


# ---------------------------------------------------------------------------- the formats


async def stream_bytes(fmt: Any, gen: UpstreamGeneration) -> bytes:
    """What `api.respond` streams for one generation in `fmt`'s shape."""
    await gen.start()
    pieces = [fmt.encode(e) for e in fmt.head()]
    try:
        async for out in gen:
            pieces.extend(fmt.encode(e) for e in fmt.events(0, out))
    finally:
        await gen.close()
    pieces.extend(fmt.encode(e) for e in fmt.tail([gen]))
    pieces.append(fmt.terminator)
    return b"".join(pieces)


async def body_json(fmt: Any, gen: UpstreamGeneration) -> dict[str, Any]:
    """What `api.respond` answers, not streamed."""
    await gen.start()
    completions: list[Completion] = await finished_completions(gen)
    return fmt.body([gen], [completions]).model_dump(mode="json")


def openai_chunks(data: bytes) -> list[openai.types.chat.ChatCompletionChunk]:
    events = list(parse_sse([data]))
    assert events[-1].is_done
    return [openai.types.chat.ChatCompletionChunk.model_validate(e.json())
            for e in events[:-1]]


ANTHROPIC_EVENT = TypeAdapter(anthropic.types.RawMessageStreamEvent)


def anthropic_events(data: bytes) -> list[Any]:
    """The events (named after their `type`), checked with the SDK's types; its union
    has no ping (its stream skips them), which must come third."""
    events = list(parse_sse([data]))
    assert all(e.event == e.json()["type"] for e in events)
    assert [e.event for e in events].index("ping") == 2
    return [ANTHROPIC_EVENT.validate_python(e.json()) for e in events if e.event != "ping"]


def check_anthropic_stream(events: list[Any], text: str, input_tokens: int,
                           output_tokens: int, stop_reason: str) -> None:
    types = [e.type for e in events]
    assert types[:2] == ["message_start", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    delta = events[-2]
    assert delta.delta.stop_reason == stop_reason
    # Anthropic's input_tokens leave out the prompt tokens read from the upstream's cache.
    usage = delta.usage
    assert (usage.input_tokens + (usage.cache_read_input_tokens or 0),
            usage.output_tokens) == (input_tokens, output_tokens)


def test_both_dialects_over_a_mock_upstream_streamed_and_not() -> None:
    async def scenario(mock: MockReplica, client: UpstreamClient) -> None:
        fmt = ChatFormat("served", 1, True, None)
        chunks = openai_chunks(await stream_bytes(fmt, chat_gen(client, max_tokens=5)))
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
            == mock_text(5)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and not chunks[-1].choices
        assert (usage.prompt_tokens, usage.completion_tokens) == (MOCK_PROMPT_WORDS, 5)

        body = openai.types.chat.ChatCompletion.model_validate(await body_json(
            ChatFormat("served", 1, False, None), chat_gen(client, max_tokens=5)))
        assert body.choices[0].message.content == mock_text(5)
        assert body.usage is not None
        assert (body.usage.prompt_tokens, body.usage.completion_tokens) == (MOCK_PROMPT_WORDS, 5)

        events = anthropic_events(await stream_bytes(
            MessagesFormat("served", [], "req-1"), chat_gen(client, max_tokens=5)))
        check_anthropic_stream(events, mock_text(5), MOCK_PROMPT_WORDS, 5, "max_tokens")

        message = anthropic.types.Message.model_validate(await body_json(
            MessagesFormat("served", [], "req-1"), chat_gen(client, max_tokens=50)))
        assert message.content[0].type == "text" and message.content[0].text == mock_text(7)
        assert message.stop_reason == "end_turn"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (
            MOCK_PROMPT_WORDS, 7)

    with_mock(scenario, output_len=7)


# ---------------------------------------------------------------------------- a tokenyard


@pytest.fixture(scope="module")
def upstream() -> Iterator[Server]:
    with running_server("--no-auth") as (server, _):
        yield server


def run_upstream(server: Server, scenario: Callable[[UpstreamClient], Awaitable[T]]) -> T:
    async def go() -> T:
        async with UpstreamClient(server.base_url + "/v1", model=server.model) as client:
            return await scenario(client)
    return asyncio.run(go())


async def direct(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The upstream's own non-streamed answer."""
    async with aiohttp.ClientSession() as session, session.post(
        f"{server.base_url}/v1{path}", json={"model": server.model, **body}
    ) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def metric(server: Server, name: str) -> float:
    async with aiohttp.ClientSession() as session, \
            session.get(server.base_url + "/metrics") as r:
        text = await r.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


@pytest.mark.slow
def test_tokenyard_chat_matches_its_own_answer_with_usage_and_logprobs(
    upstream: Server,
) -> None:
    async def scenario(client: UpstreamClient) -> None:
        assert await client.health()
        gen = chat_gen(client, upstream.model, max_tokens=12, temperature=0.0, logprobs=2)
        await gen.start()
        completion = (await finished_completions(gen))[0]
        want = await direct(upstream, "/chat/completions", {
            "messages": CHAT, "max_tokens": 12, "temperature": 0.0, "logprobs": True,
            "top_logprobs": 2})
        choice = want["choices"][0]
        assert completion.text == choice["message"]["content"] and completion.text
        assert completion.finish_reason == choice["finish_reason"]
        assert gen.num_prompt_tokens == want["usage"]["prompt_tokens"] != ESTIMATE
        assert gen.last is not None
        assert gen.last.num_output_tokens == want["usage"]["completion_tokens"]
        assert completion.logprobs is not None
        entries = choice["logprobs"]["content"]
        assert [gen.token_bytes(lp.token_id) for lp in completion.logprobs] == [
            bytes(e["bytes"]) for e in entries]
        # The second request finds the first's prompt in the prefix cache, and its short
        # uncached tail goes through the paged attention kernel instead of a whole
        # prefill's SDPA: equal within 1e-5 per layer, but the block matmuls' 8-bit
        # activations then round a few values differently, which moves a logprob by up
        # to ~1e-3 (as two attention backends do in vLLM).
        assert [lp.logprob for lp in completion.logprobs] == pytest.approx(
            [e["logprob"] for e in entries], abs=2e-3)
        assert all(len(lp.top) == 2 for lp in completion.logprobs)

    run_upstream(upstream, scenario)


@pytest.mark.slow
def test_tokenyard_completion_and_its_legacy_format(upstream: Server) -> None:
    async def scenario(client: UpstreamClient) -> None:
        def gen() -> UpstreamGeneration:
            return UpstreamGeneration(
                client, "req-3", prompt="The capital of France is", model=upstream.model,
                params=SamplingParams(max_tokens=6, temperature=0.0, n=2, logprobs=1),
                prompt_tokens_estimate=ESTIMATE)
        streamed = gen()
        fmt = CompletionFormat("served", 2, True, streamed.token_bytes, None)
        events = list(parse_sse([await stream_bytes(fmt, streamed)]))
        assert events[-1].is_done
        # The SDK's Completion is a body's type (finish_reason required): the stream's
        # chunks are parsed with it once their running choices read as finished.
        chunks = [openai.types.Completion.model_validate(
            {**e.json(), "choices": [{**c, "finish_reason": c["finish_reason"] or "stop"}
                                     for c in e.json()["choices"]]}) for e in events[:-1]]
        texts = ["", ""]
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.text
        want = await direct(upstream, "/completions", {
            "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0.0,
            "n": 2})
        assert texts == [c["text"] for c in want["choices"]]
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]
        assert chunks[-1].usage.prompt_tokens == want["usage"]["prompt_tokens"]
        tokens = ["", ""]
        for c in chunks:
            for ch in c.choices:
                tokens[ch.index] += "".join(ch.logprobs.tokens or ()) if ch.logprobs else ""
        assert tokens == texts

    run_upstream(upstream, scenario)


@pytest.mark.slow
def test_tokenyard_refusal_keeps_its_param(upstream: Server) -> None:
    async def scenario(client: UpstreamClient) -> None:
        with pytest.raises(ReplicaRequestError) as refused:
            await drain(client, {"messages": CHAT, "logit_bias": {"999999": 5}})
        err = refused.value
        assert (err.status, err.param) == (400, "logit_bias") and "999999" in err.message
        # Our own checks pass it (no vocabulary here): the upstream refuses it.
        gen = chat_gen(client, upstream.model, logit_bias={999999: 5.0})
        with pytest.raises(APIError) as api:
            await gen.start()
        await gen.close()
        assert (api.value.status, api.value.param, api.value.message) == (
            400, "logit_bias", err.message)

    run_upstream(upstream, scenario)


@pytest.mark.slow
def test_tokenyard_sees_the_disconnect_of_a_closed_generation(upstream: Server) -> None:
    async def stats(session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(upstream.replica_url + "/v1/engine/stats",
                               headers=upstream.replica_headers) as r:
            found: dict[str, Any] = await r.json()
            return found

    async def scenario(client: UpstreamClient) -> None:
        aborted = 'tokenyard:request_success_total{finished_reason="abort"}'
        before = await metric(upstream, aborted)
        gen = chat_gen(client, upstream.model, max_tokens=400, min_tokens=400)
        await started_and_read(gen, 3)
        await gen.close()
        async with aiohttp.ClientSession() as session:
            deadline = time.monotonic() + 3.0
            while (now := await stats(session))["num_running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        assert now["num_running"] == 0 and now["num_free_kv_blocks"] == now["num_kv_blocks"]
        assert await metric(upstream, aborted) == before + 1

    run_upstream(upstream, scenario)


@pytest.mark.slow
def test_both_dialects_over_a_tokenyard_upstream(upstream: Server) -> None:
    async def scenario(client: UpstreamClient) -> None:
        want = await direct(upstream, "/chat/completions", {
            "messages": CHAT, "max_tokens": 10, "temperature": 0.0})
        text, usage = want["choices"][0]["message"]["content"], want["usage"]
        stop = "end_turn" if want["choices"][0]["finish_reason"] == "stop" else "max_tokens"

        gen = chat_gen(client, upstream.model, max_tokens=10, temperature=0.0, n=2)
        fmt = ChatFormat("served", 2, True, gen.token_bytes)
        chunks = openai_chunks(await stream_bytes(fmt, gen))
        for index in (0, 1):
            assert "".join(c.choices[0].delta.content or "" for c in chunks
                           if c.choices and c.choices[0].index == index) == text
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.prompt_tokens == usage["prompt_tokens"]
        assert chunks[-1].usage.completion_tokens == 2 * usage["completion_tokens"]

        events = anthropic_events(await stream_bytes(
            MessagesFormat("served", [], "req-1"),
            chat_gen(client, upstream.model, max_tokens=10, temperature=0.0)))
        check_anthropic_stream(events, text, usage["prompt_tokens"],
                               usage["completion_tokens"], stop)

        message = anthropic.types.Message.model_validate(await body_json(
            MessagesFormat("served", [], "req-1"),
            chat_gen(client, upstream.model, max_tokens=10, temperature=0.0)))
        assert message.content[0].type == "text" and message.content[0].text == text
        cached = message.usage.cache_read_input_tokens
        assert cached, "the same prompt again: the upstream's prefix cache served it"
        assert (message.usage.input_tokens + cached, message.usage.output_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"])

    run_upstream(upstream, scenario)


def test_request_body_maps_the_sampling_parameters() -> None:
    params = SamplingParams(n=2, temperature=0.3, top_p=0.9, max_tokens=7, stop=["\n"],
                            seed=5, presence_penalty=0.5, logit_bias={12: -100.0},
                            logprobs=3, top_k=4)
    gen = UpstreamGeneration(object(), "r", messages=CHAT, params=params, model="m",
                             prompt_tokens_estimate=1, user="u-1")
    body = gen.body()
    assert body == {
        "model": "m", "messages": CHAT, "temperature": 0.3, "top_p": 0.9, "max_tokens": 7,
        "n": 2, "stop": ["\n"], "seed": 5, "presence_penalty": 0.5,
        "logit_bias": {"12": -100.0}, "user": "u-1", "top_k": 4, "logprobs": True,
        "top_logprobs": 3,
    }
    json.dumps(body)
    text = UpstreamGeneration(object(), "r", prompt="hi", params=params, model="m",
                              prompt_tokens_estimate=1).body()
    assert text["prompt"] == "hi" and text["logprobs"] == 3 and "top_logprobs" not in text
    with pytest.raises(ValueError):
        UpstreamGeneration(object(), "r", params=params, model="m",
                           prompt_tokens_estimate=1)


def test_request_body_sends_images_as_our_reencoding_only() -> None:
    image = NormalisedImage("image/png", b"\x89PNG...", 1, 1)
    messages: list[TemplateMessage] = [{
        "role": "user", "content": "What is this?",
        "parts": ["What is this?", ImagePart("messages.0.content.1",
                                             "https://example.com/cat.png", "low", image)],
    }]
    body = request_body(SamplingParams(), "m", messages=messages)
    assert body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": image.data_uri(), "detail": "low"}},
    ]}]
    assert "example.com" not in json.dumps(body)


def test_request_body_passes_a_grammar_on_in_the_upstreams_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spelled = {
        GuidedDecoding("json_object"): {"response_format": {"type": "json_object"}},
        GuidedDecoding("json_schema", json.dumps(schema)): {"response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema, "strict": True}}},
        GuidedDecoding("regex", "[0-9]+"): {"guided_regex": "[0-9]+"},
        GuidedDecoding("ebnf", 'root ::= "a"'): {"guided_grammar": 'root ::= "a"'},
    }
    for guided, fields in spelled.items():
        body = request_body(SamplingParams(guided=guided), "m", messages=CHAT)
        assert {k: body[k] for k in fields} == fields, guided
