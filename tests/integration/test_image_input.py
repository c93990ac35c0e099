"""Image input through HTTP, with the official SDKs against a served tokenyard: a fleet
of the embedded engine's deployment (behind the mock replica: it has no vision), an
OpenAI-compatible upstream that declares `vision` and one that does not. The upstream
is a real local HTTP server that records the bodies it gets and also serves an image.

What is pinned: an image to a deployment without vision is a 400 naming the part, in
each dialect's shape, and nothing is fetched for it; bytes that are not an image are a
400 whatever the deployment; the vision upstream gets our re-encoding as a data URI,
never the client's bytes; and a URL on a loopback address is refused by the served
gateway's default policy, which never connects to it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from aiohttp import web
from PIL import Image, PngImagePlugin

from tests.e2e.conftest import Server, running_server
from tests.e2e.test_gateway import _mock_replica

VLM = "vlm-2026-11-22"
TEXT_ONLY = "text-upstream-2026-11-22"


def _png(secret: str = "") -> bytes:
    info = PngImagePlugin.PngInfo()
    if secret:
        info.add_text("Comment", secret)
    out = io.BytesIO()
    Image.new("RGB", (5, 3), (10, 200, 30)).save(out, format="PNG", pnginfo=info)
    return out.getvalue()


def _uri(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


class FakeUpstream:
    """An OpenAI-compatible upstream on 127.0.0.1 in its own thread: records every chat
    body, answers one streamed sentence; also serves /img.png (and counts its hits)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.image_hits = 0
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete,
                                        args=(self._serve(),), daemon=True)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}
        for choice in ({"index": 0, "delta": {"role": "assistant", "content": "Green."},
                        "finish_reason": None},
                       {"index": 0, "delta": {}, "finish_reason": "stop"}):
            await response.write(f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"
                                 .encode())
        usage = {"prompt_tokens": 90, "completion_tokens": 2, "total_tokens": 92}
        await response.write(f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}"
                             "\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def _image(self, request: web.Request) -> web.Response:
        self.image_hits += 1
        return web.Response(body=_png(), content_type="image/png")

    async def _serve(self) -> None:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/img.png", self._image)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> FakeUpstream:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Server, FakeUpstream]]:
    with FakeUpstream() as upstream, _mock_replica() as replica, \
            tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "tokenyard.toml"
        config.write_text(f"""
[[deployments]]
name = "tiny-engine-2026-11-22"
kind = "engine"
urls = ["{replica}"]

[[deployments]]
name = "{VLM}"
kind = "upstream"
urls = ["{upstream.url}/v1"]
model = "fake-vlm"
capabilities = ["chat", "vision"]

[[deployments]]
name = "{TEXT_ONLY}"
kind = "upstream"
urls = ["{upstream.url}/v1"]
model = "fake-text"
""")
        with running_server("--config", str(config), "--no-embeddings") as (server, _):
            yield server, upstream


def _openai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=server.api_key or "x",
                         max_retries=0)


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=server.api_key or "x",
                               max_retries=0)


def _look(image_part: dict[str, Any]) -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": "What colour?"},
                                         image_part]}]


ENGINE = "tiny-engine-2026-11-22"


def _refused_local_url(fleet: tuple[Server, FakeUpstream], model: str,
                       stream: bool = False) -> Any:
    """The 400 body of a chat request with an image URL on the fake upstream's loopback
    address; asserts that neither the image nor the upstream was reached."""
    server, upstream = fleet
    sent = len(upstream.bodies)
    part = {"type": "image_url", "image_url": {"url": upstream.url + "/img.png"}}
    with pytest.raises(openai.BadRequestError) as refused:
        _openai(server).chat.completions.create(model=model, messages=_look(part),
                                                max_tokens=4, stream=stream)
    assert upstream.image_hits == 0 and len(upstream.bodies) == sent
    return refused.value.body


@pytest.mark.parametrize("model", [ENGINE, TEXT_ONLY])
@pytest.mark.parametrize("stream", [False, True])
def test_an_image_part_to_a_model_without_vision_is_a_400_naming_the_part(
    fleet: tuple[Server, FakeUpstream], model: str, stream: bool
) -> None:
    body = _refused_local_url(fleet, model, stream)
    assert body["param"] == "messages.0.content.1"
    assert body["type"] == "invalid_request_error" and body["code"] == "unsupported_value"
    assert f"'{model}' does not support image input" in body["message"]


def test_an_image_block_to_a_model_without_vision_is_a_400_in_anthropics_shape(
    fleet: tuple[Server, FakeUpstream],
) -> None:
    server, _ = fleet
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(_png()).decode()}}
    client = _anthropic(server)
    messages: Any = [{"role": "user", "content": [{"type": "text", "text": "Colour?"}, block]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model=ENGINE, max_tokens=4, messages=messages)
    body: Any = refused.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.0.content.1: ")
    assert "does not support image input" in body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as counted:
        client.messages.count_tokens(model=ENGINE, messages=messages)
    counted_body: Any = counted.value.body
    assert counted_body["error"]["message"].startswith("messages.0.content.1: ")


@pytest.mark.parametrize("model", [ENGINE, VLM])
def test_a_data_uri_that_is_not_an_image_is_a_400_whatever_the_model(
    fleet: tuple[Server, FakeUpstream], model: str
) -> None:
    server, upstream = fleet
    sent = len(upstream.bodies)
    part = {"type": "image_url", "image_url": {"url": _uri(b"%PDF-1.4 not an image")}}
    with pytest.raises(openai.BadRequestError) as refused:
        _openai(server).chat.completions.create(model=model, messages=_look(part),
                                                max_tokens=4)
    body: Any = refused.value.body
    assert body["param"] == "messages.0.content.1.image_url.url"
    assert body["code"] == "invalid_value" and "not a PNG, JPEG, GIF or WebP" in body["message"]
    block: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(b"GIF89a...").decode()}}
    with pytest.raises(anthropic.BadRequestError) as refused_anthropic:
        _anthropic(server).messages.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [block]}])
    error: Any = refused_anthropic.value.body
    assert error["error"]["message"].startswith("Invalid 'messages.0.content.0.source.data': ")
    assert len(upstream.bodies) == sent


def test_the_vision_upstream_gets_our_re_encoding_in_order(
    fleet: tuple[Server, FakeUpstream],
) -> None:
    server, upstream = fleet
    client_png = _png(secret="client-metadata")
    part = {"type": "image_url", "image_url": {"url": _uri(client_png), "detail": "low"}}
    reply = _openai(server).chat.completions.create(model=VLM, messages=_look(part),
                                                    max_tokens=4)
    assert reply.choices[0].message.content == "Green." and reply.model == VLM
    content = upstream.bodies[-1]["messages"][0]["content"]
    assert [c["type"] for c in content] == ["text", "image_url"]
    assert content[0]["text"] == "What colour?"
    sent_url = content[1]["image_url"]["url"]
    assert content[1]["image_url"]["detail"] == "low"
    assert sent_url.startswith("data:image/png;base64,") and sent_url != _uri(client_png)
    sent = base64.b64decode(sent_url.split(",", 1)[1])
    assert b"client-metadata" not in sent
    assert Image.open(io.BytesIO(sent)).size == (5, 3)


def test_the_anthropic_route_sends_images_to_the_vision_upstream_too(
    fleet: tuple[Server, FakeUpstream],
) -> None:
    server, upstream = fleet
    block: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": base64.b64encode(_png()).decode()}}
    reply = _anthropic(server).messages.create(model=VLM, max_tokens=4, messages=[
        {"role": "user", "content": [block, {"type": "text", "text": "Colour?"}]}])
    assert reply.content[0].text == "Green."  # type: ignore[union-attr]
    content = upstream.bodies[-1]["messages"][-1]["content"]
    assert [c["type"] for c in content] == ["image_url", "text"]
    assert content[0]["image_url"]["url"].startswith("data:image/png;base64,")


def test_a_loopback_url_is_refused_by_the_served_default_policy(
    fleet: tuple[Server, FakeUpstream],
) -> None:
    body = _refused_local_url(fleet, VLM)
    assert body["param"] == "messages.0.content.1" and body["code"] == "invalid_value"
    assert "127.0.0.1, which is not a public address" in body["message"]
