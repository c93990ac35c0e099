"""Image input at the gateway (`api/images.py`, `text/content.py`): the address policy,
fetching under it from a real local HTTP server, the format and size rules, re-encoding,
and the template messages that carry images to an OpenAI-compatible upstream."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import struct
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from PIL import Image, PngImagePlugin

from tokenyard.api.image_fetch import (
    ImageLimits,
    ImageRejected,
    IPAddress,
    is_public_address,
)
from tokenyard.api.images import (
    admit_images,
    load_image,
    load_images,
    normalise_image,
    template_message,
)
from tokenyard.errors import APIError
from tokenyard.text.content import (
    ImagePart,
    NormalisedImage,
    TemplateMessage,
    needs_vision,
    openai_content,
    require_vision,
)

# ---------------------------------------------------------------------------- fixtures


def encoded(fmt: str, size: tuple[int, int] = (6, 4), color: Any = (200, 30, 30),
            mode: str = "RGB", **save: Any) -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, color).save(out, format=fmt, **save)
    return out.getvalue()


def data_uri(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG file whose header declares `width` x `height` (a decompression bomb's
    shape: the pixels are never there)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def loopback_only(address: IPAddress) -> bool:
    return address == ipaddress.ip_address("127.0.0.1")


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


class ImageServer:
    """A real aiohttp server on 127.0.0.1 serving images, redirects and misbehaviour."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.port = 0
        self.png = encoded("PNG")
        app = web.Application()
        app.router.add_get("/{name}", self._handle)
        self._runner = web.AppRunner(app)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.hits.append(name)
        if name == "img.png":
            return web.Response(body=self.png, content_type="image/png")
        if name == "hop":
            raise web.HTTPFound(f"http://127.0.0.1:{self.port}/img.png")
        if name == "relative":
            raise web.HTTPFound("/img.png")
        if name == "to-metadata":
            raise web.HTTPFound("http://169.254.169.254/latest/meta-data/")
        if name == "loop":
            raise web.HTTPFound("/loop")
        if name == "big":
            return web.Response(body=b"\x89PNG" + b"\0" * 5000, content_type="image/png")
        if name == "big-chunked":
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            for _ in range(10):
                await response.write(b"\0" * 1000)
            await response.write_eof()
            return response
        if name == "slow":
            await asyncio.sleep(5)
            return web.Response(body=self.png)
        if name == "text":
            return web.Response(text="<html>not an image</html>", content_type="image/png")
        if name == "bmp":
            return web.Response(body=encoded("BMP"), content_type="image/bmp")
        raise web.HTTPNotFound()

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.port}/{name}"

    async def __aenter__(self) -> ImageServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def with_server(body: Callable[[ImageServer], Awaitable[Any]]) -> Any:
    async with ImageServer() as server:
        return await body(server)


def resolver(table: dict[str, list[str]]) -> Callable[[str, int], Awaitable[list[str]]]:
    async def resolve(host: str, port: int) -> list[str]:
        return table[host]
    return resolve


# ---------------------------------------------------------------------------- addresses


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.8.9.10", "::1", "10.0.0.1", "172.16.5.4", "192.168.1.1",
    "169.254.169.254", "100.64.0.1", "100.127.255.254", "0.0.0.0", "::", "224.0.0.1",
    "239.1.2.3", "255.255.255.255", "240.0.0.1", "192.0.2.1", "fc00::1", "fd12:3456::1",
    "fe80::1", "ff02::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
    "2002:7f00:1::", "64:ff9b::a00:1", "2001:0:4136:e378:8000:63bf:80ff:fffe",
])
def test_the_default_policy_refuses_addresses_that_are_not_public(address: str) -> None:
    assert not is_public_address(ipaddress.ip_address(address))


@pytest.mark.parametrize("address", [
    "8.8.8.8", "93.184.216.34", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808",
])
def test_the_default_policy_allows_public_addresses(address: str) -> None:
    assert is_public_address(ipaddress.ip_address(address))


# ---------------------------------------------------------------------------- fetching


def test_an_allowed_local_url_is_fetched_decoded_and_re_encoded() -> None:
    async def body(server: ImageServer) -> NormalisedImage:
        return await load_image(server.url("img.png"), allow=loopback_only)

    image = run(with_server(body))
    assert (image.media_type, image.width, image.height) == ("image/png", 6, 4)
    assert Image.open(io.BytesIO(image.data)).getpixel((0, 0)) == (200, 30, 30)


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "10.0.0.1", "169.254.169.254"])
def test_the_default_policy_refuses_local_and_private_urls_before_connecting(host: str) -> None:
    async def body(server: ImageServer) -> str:
        with pytest.raises(ImageRejected, match="not a public address") as refused:
            await load_image(f"http://{host}:{server.port}/img.png")
        return str(refused.value)

    run(with_server(body))


def test_the_default_policy_never_reaches_the_local_server() -> None:
    async def body(server: ImageServer) -> list[str]:
        with pytest.raises(ImageRejected):
            await load_image(server.url("img.png"))
        return server.hits

    assert run(with_server(body)) == []


def test_redirects_are_followed_and_each_hop_checked() -> None:
    async def body(server: ImageServer) -> tuple[NormalisedImage, NormalisedImage, list[str]]:
        a = await load_image(server.url("hop"), allow=loopback_only)
        b = await load_image(server.url("relative"), allow=loopback_only)
        return a, b, server.hits

    a, b, hits = run(with_server(body))
    assert a.width == b.width == 6
    assert hits == ["hop", "img.png", "relative", "img.png"]


def test_a_redirect_from_an_allowed_host_to_the_metadata_address_is_refused() -> None:
    async def body(server: ImageServer) -> None:
        with pytest.raises(ImageRejected, match=r"169\.254\.169\.254"):
            await load_image(server.url("to-metadata"), allow=loopback_only)

    run(with_server(body))


def test_more_than_three_redirects_are_refused() -> None:
    async def body(server: ImageServer) -> list[str]:
        with pytest.raises(ImageRejected, match="more than 3 times"):
            await load_image(server.url("loop"), allow=loopback_only)
        return server.hits

    assert run(with_server(body)) == ["loop"] * 4


def test_a_hostname_resolving_to_a_private_address_is_refused() -> None:
    async def body(server: ImageServer) -> None:
        for addresses in (["10.1.2.3"], ["93.184.216.34", "127.0.0.1"], ["::ffff:192.168.0.1"]):
            with pytest.raises(ImageRejected, match="not a public address"):
                await load_image(f"http://images.example.com:{server.port}/img.png",
                                 resolve=resolver({"images.example.com": addresses}))

    run(with_server(body))


def test_the_connection_goes_to_the_address_resolved_once() -> None:
    # A name the system cannot resolve: the fetch succeeds only through the pinned
    # address. A second lookup (DNS rebinding) would get a private address instead.
    answers = [["127.0.0.1"], ["10.0.0.1"]]
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[min(len(calls), 2) - 1]

    async def body(server: ImageServer) -> NormalisedImage:
        return await load_image(f"http://rebind.invalid:{server.port}/img.png",
                                allow=loopback_only, resolve=rebinding)

    assert run(with_server(body)).width == 6
    assert calls == ["rebind.invalid"]


@pytest.mark.parametrize("name", ["big", "big-chunked"])
def test_a_body_over_the_byte_cap_is_refused_while_streaming(name: str) -> None:
    async def body(server: ImageServer) -> None:
        with pytest.raises(ImageRejected, match="larger than 2000 bytes"):
            await load_image(server.url(name), allow=loopback_only,
                             limits=ImageLimits(max_bytes=2000))

    run(with_server(body))


def test_a_slow_server_hits_the_deadline() -> None:
    async def body(server: ImageServer) -> None:
        with pytest.raises(ImageRejected, match=r"longer than 0\.3 s"):
            await load_image(server.url("slow"), allow=loopback_only,
                             limits=ImageLimits(timeout_s=0.3))

    run(with_server(body))


@pytest.mark.parametrize(("name", "reason"), [
    ("text", "could not be decoded"),
    ("bmp", "could not be decoded"),
    ("missing", "HTTP 404"),
])
def test_a_url_that_is_not_an_allowed_image_is_refused(name: str, reason: str) -> None:
    async def body(server: ImageServer) -> None:
        with pytest.raises(ImageRejected, match=reason):
            await load_image(server.url(name), allow=loopback_only)

    run(with_server(body))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png",
                                 "gopher://example.com/", "http:///nohost.png"])
def test_only_http_and_https_urls_with_a_host_are_fetched(url: str) -> None:
    with pytest.raises(ImageRejected):
        run(load_image(url))


# ---------------------------------------------------------------------------- data and formats


@pytest.mark.parametrize(("fmt", "media_type", "out_type"), [
    ("PNG", "image/png", "image/png"),
    ("JPEG", "image/jpeg", "image/jpeg"),
    ("GIF", "image/gif", "image/png"),
    ("WEBP", "image/webp", "image/png"),
])
def test_each_allowed_format_is_re_encoded(fmt: str, media_type: str, out_type: str) -> None:
    raw = encoded(fmt)
    image = run(load_image(data_uri(media_type, raw)))
    assert (image.media_type, image.width, image.height) == (out_type, 6, 4)
    assert Image.open(io.BytesIO(image.data)).format == out_type.split("/")[1].upper()


def test_what_goes_on_is_our_encoding_not_the_clients_bytes() -> None:
    info = PngImagePlugin.PngInfo()
    info.add_text("Comment", "client-secret")
    raw = encoded("PNG", pnginfo=info)
    image = normalise_image(raw, "image/png")
    assert b"client-secret" in raw and b"client-secret" not in image.data


def test_a_gif_keeps_its_first_frame_only() -> None:
    frames = [Image.new("RGB", (3, 3), c) for c in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    image = normalise_image(out.getvalue(), "image/gif")
    decoded = Image.open(io.BytesIO(image.data)).convert("RGB")
    assert decoded.getpixel((1, 1)) == (255, 0, 0)
    assert getattr(Image.open(io.BytesIO(image.data)), "n_frames", 1) == 1


def test_exif_orientation_is_applied_and_metadata_dropped() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    exif[0x010F] = "SecretCam"
    raw = encoded("JPEG", size=(8, 4), exif=exif.tobytes())
    image = normalise_image(raw, "image/jpeg")
    assert (image.width, image.height) == (4, 8)
    assert b"SecretCam" not in image.data
    assert not Image.open(io.BytesIO(image.data)).getexif()


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    for width, height in ((100_000, 100_000), (9000, 10), (5000, 5000)):
        with pytest.raises(ImageRejected, match="pixels"):
            normalise_image(png_declaring(width, height), "image/png",
                            ImageLimits(max_pixels=4000 * 4000))


@pytest.mark.parametrize(("source", "reason"), [
    (data_uri("image/png", b"plain text, not an image"), "not a PNG, JPEG, GIF or WebP"),
    (data_uri("image/jpeg", encoded("PNG")), "not the declared image/jpeg"),
    (data_uri("image/bmp", encoded("BMP")), "'image/bmp' is not supported"),
    (data_uri("image/svg+xml", b"<svg/>"), "not supported"),
    ("data:image/png," + "iVBORw0KGgo=", "base64"),
    ("data:image/png;base64,@@@@", "not valid base64"),
    ({"type": "base64", "media_type": "image/gif", "data": base64.b64encode(
        encoded("PNG")).decode()}, "not the declared image/gif"),
    ({"type": "file", "file_id": "f"}, "image source"),
])
def test_a_source_that_is_not_an_allowed_image_is_refused(
    source: str | dict[str, str], reason: str
) -> None:
    with pytest.raises(ImageRejected, match=reason):
        run(load_image(source))


def test_truncated_image_data_is_refused() -> None:
    raw = encoded("PNG", size=(64, 64), color=None)[:60]
    with pytest.raises(ImageRejected, match="could not be decoded"):
        normalise_image(raw, "image/png")


def test_an_oversized_data_uri_is_refused_before_decoding() -> None:
    raw = encoded("PNG", size=(200, 200), mode="L", color=None)
    with pytest.raises(ImageRejected, match="larger than 100 bytes"):
        run(load_image(data_uri("image/png", raw), limits=ImageLimits(max_bytes=100)))


def test_an_anthropic_url_source_goes_through_the_same_fetch_rules() -> None:
    async def body(server: ImageServer) -> NormalisedImage:
        with pytest.raises(ImageRejected, match="not a public address"):
            await load_image({"type": "url", "url": server.url("img.png")})
        return await load_image({"type": "url", "url": server.url("img.png")},
                                allow=loopback_only)

    assert run(with_server(body)).width == 6


# ---------------------------------------------------------------------------- messages


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text


class _Image:
    def __init__(self, source: str) -> None:
        self.source = source

    def image_part(self, param: str) -> ImagePart:
        return ImagePart(param, self.source, "low")


PNG_URI = data_uri("image/png", encoded("PNG"))


def conversation(*sources: str) -> list[TemplateMessage]:
    return [
        template_message("system", "Be brief.", "Be brief.", "messages.0"),
        template_message("user", "look\nand", [_Text("look"), *map(_Image, sources),
                                               _Text("and")], "messages.1"),
    ]


def test_template_messages_keep_image_parts_in_order_with_their_paths() -> None:
    messages = conversation(PNG_URI, "https://example.com/a.png")
    assert "parts" not in messages[0]
    assert messages[1]["content"] == "look\nand"
    assert messages[1]["parts"] == [
        "look", ImagePart("messages.1.content.1", PNG_URI, "low"),
        ImagePart("messages.1.content.2", "https://example.com/a.png", "low"), "and"]
    assert needs_vision(messages) == "messages.1.content.1"
    assert needs_vision(messages[:1]) is None


def test_a_deployment_without_vision_refuses_naming_the_first_image_part() -> None:
    with pytest.raises(APIError) as refused:
        require_vision(conversation(PNG_URI), "tiny", vision=False)
    assert refused.value.status == 400
    assert refused.value.param == "messages.1.content.1"
    assert "'tiny' does not support image input" in refused.value.message
    require_vision(conversation(PNG_URI), "tiny", vision=True)
    require_vision(conversation(), "tiny", vision=False)


def test_openai_content_sends_our_re_encoding_never_the_clients_source() -> None:
    gif_uri = data_uri("image/gif", encoded("GIF"))
    messages = conversation(gif_uri)
    assert openai_content(messages[0]) == "Be brief."
    with pytest.raises(ValueError, match="not loaded"):
        openai_content(messages[1])
    loaded = run(admit_images(messages, model="vlm", vision=True))
    content = openai_content(loaded[1])
    assert isinstance(content, list)
    assert [c["type"] for c in content] == ["text", "image_url", "text"]
    image_url = content[1]["image_url"]
    assert image_url["detail"] == "low"
    assert image_url["url"].startswith("data:image/png;base64,")  # the GIF, re-encoded
    image = Image.open(io.BytesIO(base64.b64decode(image_url["url"].split(",", 1)[1])))
    assert image.size == (6, 4)


def test_a_failing_image_is_a_400_naming_its_part() -> None:
    async def body(server: ImageServer) -> APIError:
        messages = conversation(PNG_URI, server.url("img.png"))
        with pytest.raises(APIError) as refused:
            await load_images(messages)
        return refused.value

    err = run(with_server(body))
    assert (err.status, err.param) == (400, "messages.1.content.2")
    assert "not a public address" in err.message


def test_at_most_max_images_per_request() -> None:
    with pytest.raises(APIError) as refused:
        run(load_images(conversation(PNG_URI, PNG_URI, PNG_URI),
                        limits=ImageLimits(max_images=2)))
    assert refused.value.param == "messages.1.content.3"
