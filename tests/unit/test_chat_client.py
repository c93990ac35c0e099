"""`ChatSession` against a small aiohttp server on 127.0.0.1: streaming, retries, errors."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import pytest
from aiohttp import web

from tokenyard.cli.chat import ChatError, ChatSession, RetryPolicy, run_repl

Action = str  # "stream", "stall", "429", "503", "400", "400-retry", "drop"


class FakeServer:
    """Answers /v1/chat/completions with the next scripted action (then "stream" forever)."""

    def __init__(self, actions: list[Action], reply: list[str]) -> None:
        self.actions = list(actions)
        self.reply = reply
        self.bodies: list[dict[str, Any]] = []
        self.idempotency_keys: list[str | None] = []
        self.client_ports: list[int] = []

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "smol", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        self.idempotency_keys.append(request.headers.get("Idempotency-Key"))
        peer = request.transport.get_extra_info("peername") if request.transport else None
        self.client_ports.append(peer[1] if peer else -1)
        action = self.actions.pop(0) if self.actions else "stream"
        if action == "drop":
            assert request.transport is not None
            request.transport.abort()  # the client sees the connection vanish, no response
            return web.Response()
        if action == "429":
            return web.json_response(
                {"error": {"message": "slow down", "type": "rate_limit_error",
                           "param": None, "code": None}},
                status=429, headers={"retry-after": "2"})
        if action == "503":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if action in ("400", "400-retry"):  # the second: the server asks for a retry
            return web.json_response(
                {"error": {"message": "'temperature' must be at most 2",
                           "type": "invalid_request_error", "param": "temperature",
                           "code": "invalid_value"}}, status=400,
                headers={"x-should-retry": "true"} if action == "400-retry" else None)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": "smol"}

        async def send(delta: dict[str, Any], finish: str | None = None) -> None:
            chunk = {**base, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        await send({"role": "assistant", "content": ""})
        for piece in self.reply:
            await send({"content": piece})
            if action == "stall":  # one piece, then silence until the client leaves
                for _ in range(500):
                    if request.transport is None or request.transport.is_closing():
                        return response
                    await asyncio.sleep(0.01)
        await send({}, "stop")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@asynccontextmanager
async def serve(server: FakeServer) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/v1/models", server.models)
    app.router.add_post("/v1/chat/completions", server.chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)  # 0: a free port
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}/v1"
    finally:
        await runner.cleanup()


class Recorder:
    """Injected sleep: records the requested delays and returns at once."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(test())


def test_streams_reply_keeps_conversation_and_reuses_one_connection() -> None:
    async def test() -> None:
        server = FakeServer([], ["Hel", "lo", " there"])
        async with serve(server) as url, ChatSession(url, system="Be brief.") as chat:
            deltas: list[str] = []
            assert await chat.send("hi", deltas.append) == "Hello there"
            assert deltas == ["Hel", "lo", " there"]
            pool = chat.http
            assert await chat.send("again", deltas.append) == "Hello there"
            assert chat.http is pool
            assert chat.last_finish_reason == "stop"
        assert chat.messages == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": "Hello there"},
        ]
        assert server.bodies[1]["messages"] == chat.messages[:4]
        assert server.bodies[0]["model"] == "smol"  # resolved from /v1/models
        assert server.bodies[0]["stream"] is True
        # keep-alive: both requests came over the same client socket
        assert server.client_ports[0] == server.client_ports[1]

    run(test)


def test_429_is_retried_after_the_servers_retry_after() -> None:
    async def test() -> None:
        server = FakeServer(["429", "503"], ["ok"])
        sleep = Recorder()
        async with serve(server) as url, ChatSession(url, "smol", sleep=sleep,
                                                     rand=lambda: 0.5) as chat:
            assert await chat.send("hi", lambda _: None) == "ok"
        # retry-after: 2 for the 429; full jitter 0.5 × min(8, 0.5·2¹) for the 503
        assert sleep.delays == [2.0, 0.5]
        assert len(server.bodies) == 3

    run(test)


def test_400_surfaces_the_api_message_without_retrying() -> None:
    async def test() -> None:
        server = FakeServer(["400"], ["unused"])
        sleep = Recorder()
        async with serve(server) as url, ChatSession(url, "smol", sleep=sleep) as chat:
            with pytest.raises(ChatError) as info:
                await chat.send("hi", lambda _: None)
        assert info.value.status == 400
        assert info.value.message == "'temperature' must be at most 2"
        assert sleep.delays == []
        assert len(server.bodies) == 1
        assert chat.messages == []  # the failed turn is not kept

    run(test)


def test_dropped_connection_is_retried_with_backoff() -> None:
    async def test() -> None:
        server = FakeServer(["drop"], ["back"])
        sleep = Recorder()
        async with serve(server) as url, ChatSession(url, "smol", sleep=sleep,
                                                     rand=lambda: 1.0) as chat:
            assert await chat.send("hi", lambda _: None) == "back"
        assert sleep.delays == [0.5]  # 1.0 × min(8, 0.5·2⁰)
        assert len(server.bodies) == 2

    run(test)


def test_gives_up_after_max_attempts_with_capped_exponential_delays() -> None:
    async def test() -> None:
        server = FakeServer(["503"] * 10, ["never"])
        sleep = Recorder()
        policy = RetryPolicy(base=0.5, cap=2.0, max_attempts=5)
        async with serve(server) as url, ChatSession(url, "smol", sleep=sleep, retry=policy,
                                                     rand=lambda: 1.0) as chat:
            with pytest.raises(ChatError, match="gave up after 5 attempts"):
                await chat.send("hi", lambda _: None)
        assert sleep.delays == [0.5, 1.0, 2.0, 2.0]
        assert len(server.bodies) == 5

    run(test)


def test_cancelling_a_reply_closes_its_stream_and_keeps_what_was_shown() -> None:
    async def test() -> None:
        server = FakeServer(["stall"], ["partial", "never sent"])
        async with serve(server) as url, ChatSession(url, "smol") as chat:
            shown = asyncio.Event()
            task = asyncio.create_task(chat.send("hi", lambda _: shown.set()))
            await asyncio.wait_for(shown.wait(), 5)
            task.cancel()  # what Ctrl-C does in the REPL
            with pytest.raises(asyncio.CancelledError):
                await task
            assert chat.messages == [{"role": "user", "content": "hi"},
                                     {"role": "assistant", "content": "partial"}]
            # the conversation goes on over the same session
            assert await chat.send("more", lambda _: None) == "partialnever sent"
        assert server.client_ports[0] != server.client_ports[1]  # the stalled one was closed

    run(test)


def test_empty_input_is_rejected_before_any_request() -> None:
    async def test() -> None:
        chat = ChatSession("http://127.0.0.1:9/v1", "smol")
        with pytest.raises(ValueError):
            await chat.send("   ", lambda _: None)
        await chat.close()

    run(test)


def test_reset_keeps_the_system_message() -> None:
    chat = ChatSession("http://127.0.0.1:9/v1", "smol", system="old")
    chat.turns += [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    chat.reset()
    chat.set_system("new")
    assert chat.messages == [{"role": "system", "content": "new"}]


@contextmanager
def serve_in_thread(server: FakeServer) -> Iterator[str]:
    """The fake server on its own loop in a thread (the REPL runs its own loop)."""
    urls: list[str] = []
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def host() -> None:
        async with serve(server) as url:
            urls.append(url)
            ready.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(host(),))
    thread.start()
    try:
        assert ready.wait(5)
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join()
        loop.close()


def scripted(lines: list[str]) -> Callable[[str], str]:
    """A `read_line` that answers `lines`, then EOF (Ctrl-D)."""
    remaining = iter(lines)

    def read_line(prompt: str) -> str:
        try:
            return next(remaining)
        except StopIteration:
            raise EOFError from None

    return read_line


def test_repl_handles_commands_empty_input_and_eof() -> None:
    server = FakeServer([], ["Hi!"])
    out = io.StringIO()
    with serve_in_thread(server) as url:
        chat = ChatSession(url, "smol")
        assert run_repl(chat, scripted(["", "/system Be terse.", "hello", "/reset"]), out) == 0
    text = out.getvalue()
    assert "[empty message" in text
    assert "Hi!" in text
    assert "[conversation cleared]" in text
    assert chat.messages == [{"role": "system", "content": "Be terse."}]
    assert server.bodies[0]["messages"][0] == {"role": "system", "content": "Be terse."}


class InterruptOn(io.StringIO):
    """Terminal output that presses Ctrl-C (SIGINT to this process) the first time `text`
    is shown."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text: str | None = text

    def write(self, s: str) -> int:
        if s == self.text:
            self.text = None
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(s)


def test_ctrl_c_during_a_reply_stops_it_without_leaving() -> None:
    server = FakeServer(["stall"], ["partial", " rest"])
    out = InterruptOn("partial")
    with serve_in_thread(server) as url:
        chat = ChatSession(url, "smol")
        assert run_repl(chat, scripted(["hi", "again"]), out) == 0
    assert "[stopped]" in out.getvalue()
    assert len(server.bodies) == 2  # the REPL went on to the next line
    assert chat.messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "partial"},  # what was shown before Ctrl-C
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "partial rest"},
    ]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
