"""What one request's images can cost the gateway (`api/images.py`): memory, the event
loop's latency, and the rules that bound them.

The hostile request is the issue's: four 8000x8000 JPEGs and four huge PNGs (solid
colour: the PNGs compress to almost nothing, the decompression bomb), by URL from a real
local HTTP server (four such JPEGs, 1 MB each, do not fit a 4 MiB body as data URIs).
Pillow decodes in C, where tracemalloc sees nothing; so the request is loaded in a fresh
interpreter that reports its peak resident memory (VmHWM) before and after."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import ipaddress
import json
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from PIL import Image, ImageChops

from tokenyard.api.image_fetch import ImageLimits, ImageRejected, IPAddress
from tokenyard.api.images import admit_images, load_images, normalise_image
from tokenyard.errors import APIError
from tokenyard.text.content import ImagePart, TemplateMessage

MiB = 1024 * 1024
#: The issue's bound on what one request may make the process hold.
MEMORY_BOUND = 100 * MiB
#: The issue's request, and the same with the largest PNGs still accepted (4096x3072
#: RGBA: 48 MiB decoded).
REQUESTS = {"bombs": ["big.jpg"] * 4 + ["bomb.png"] * 4,
            "largest": ["big.jpg"] * 4 + ["largest.png"] * 4}


def _encoded(image: Image.Image, fmt: str, **save: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def _uri(media_type: str, data: bytes) -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _request(*sources: str) -> list[TemplateMessage]:
    return [{"role": "user", "content": "look",
             "parts": ["look", *(ImagePart(f"messages.0.content.{i + 1}", source, "auto")
                                 for i, source in enumerate(sources))]}]


def _loopback(address: IPAddress) -> bool:
    return address == ipaddress.ip_address("127.0.0.1")


@contextlib.asynccontextmanager
async def _serving(folder: Path) -> AsyncIterator[str]:
    """`folder`'s files over HTTP on 127.0.0.1: the base URL."""
    app = web.Application()
    app.router.add_static("/", folder)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/"
    finally:
        await runner.cleanup()


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hostile")
    (folder / "small.jpg").write_bytes(_encoded(Image.new("RGB", (64, 64)), "JPEG"))
    (folder / "big.jpg").write_bytes(
        _encoded(Image.new("RGB", (8000, 8000), (200, 40, 90)), "JPEG"))
    (folder / "bomb.png").write_bytes(
        _encoded(Image.new("RGBA", (8000, 8000), (1, 2, 3, 4)), "PNG"))
    (folder / "largest.png").write_bytes(
        _encoded(Image.new("RGBA", (4096, 3072), (9, 8, 7, 6)), "PNG"))
    return folder


def _peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def measure(folder: str, request: str) -> None:
    """Run in a fresh interpreter: load `request`'s images through `admit_images`, and
    print the growth of the peak resident memory and the outcome as JSON."""

    async def run() -> tuple[int, Any]:
        async with _serving(Path(folder)) as base:
            urls = [base + name for name in REQUESTS[request]]
            # Warm up on a small image: Pillow's plugins imported, the decode thread
            # started.
            await admit_images(_request(base + "small.jpg"), model="vlm", vision=True,
                               allow=_loopback)
            before = _peak()
            try:
                loaded = await admit_images(_request(*urls), model="vlm", vision=True,
                                            allow=_loopback)
            except APIError as exc:
                return _peak() - before, {"status": exc.status, "param": exc.param,
                                          "message": exc.message}
            return _peak() - before, [[p.image.width, p.image.height]
                                      for p in loaded[0].get("parts", [])
                                      if isinstance(p, ImagePart) and p.image]

    growth, outcome = asyncio.run(run())
    print(json.dumps({"growth": growth, "outcome": outcome}))


def _measured(folder: Path, request: str) -> dict[str, Any]:
    code = (f"from tests.unit.test_image_memory import measure; "
            f"measure({str(folder)!r}, {request!r})")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, check=False, cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_issues_request_is_refused_at_its_first_bomb_within_the_bound(
    images: Path
) -> None:
    """Before: every image decoded at once at full size, 2 GB and more."""
    result = _measured(images, "bombs")
    assert result["growth"] <= MEMORY_BOUND, result
    assert result["outcome"]["status"] == 400
    assert result["outcome"]["param"] == "messages.0.content.5"  # the first PNG
    assert "8000x8000 RGBA PNG" in result["outcome"]["message"]


def test_the_largest_images_accepted_load_within_the_bound(images: Path) -> None:
    """The JPEGs are decoded at a quarter scale (2000x2000: the half scale would not
    fit the decode budget), the PNGs in full, then scaled to 2048 a side by strips."""
    result = _measured(images, "largest")
    assert result["growth"] <= MEMORY_BOUND, result
    assert result["outcome"] == [[2000, 2000]] * 4 + [[2048, 1536]] * 4


def test_the_event_loop_keeps_running_while_images_decode(images: Path) -> None:
    """Decoding happens in a worker thread and Pillow's codecs release the GIL: a task
    sleeping 1 ms at a time never waits much longer (the issue: other requests stalled
    by at most ~50 ms; 100 ms here, for a loaded test machine)."""

    async def body() -> tuple[float, list[TemplateMessage]]:
        worst = 0.0
        done = asyncio.Event()

        async def tick() -> None:
            nonlocal worst
            while not done.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.001)
                worst = max(worst, time.perf_counter() - start)

        async with _serving(images) as base:
            messages = _request(*(base + name for name in REQUESTS["largest"]))
            ticker = asyncio.create_task(tick())
            await asyncio.sleep(0.01)
            try:
                loaded = await admit_images(messages, model="vlm", vision=True,
                                            allow=_loopback)
            finally:
                done.set()
                await ticker
        return worst, loaded

    worst, loaded = asyncio.run(body())
    assert len(loaded[0].get("parts", [])) == 9
    assert worst < 0.1, f"the event loop stalled {worst * 1000:.0f} ms"


# ---------------------------------------------------------------------------- the rules


def test_what_goes_on_fits_2048_a_side_resampled_as_a_whole_image_would_be() -> None:
    """Scaling is done by strips of rows (to bound its memory); the result is the
    whole-image resize's, to within rounding (compared premultiplied by alpha, as
    Pillow resamples: a rounding step there is larger once divided by a small alpha)."""
    source = Image.effect_noise((3000, 1000), 60).convert("RGB")
    source.putalpha(Image.linear_gradient("L").resize((3000, 1000)))
    image = normalise_image(_encoded(source, "PNG"), "image/png")
    assert (image.media_type, image.width, image.height) == ("image/png", 2048, 683)
    sent = Image.open(io.BytesIO(image.data))
    expected = source.resize((2048, 683), Image.Resampling.BICUBIC)
    assert sent.mode == "RGBA"
    assert max(ImageChops.difference(sent.convert("RGBa"), expected.convert("RGBa"))
               .tobytes()) <= 2


def test_a_palette_image_is_scaled_in_colour_not_by_nearest_neighbour() -> None:
    stripes = Image.new("P", (4096, 100))
    stripes.putpalette([0, 0, 0, 255, 255, 255])
    stripes.putdata([x % 2 for _ in range(100) for x in range(4096)])
    image = normalise_image(_encoded(stripes, "GIF"), "image/gif")
    grey = Image.open(io.BytesIO(image.data)).convert("L").getpixel((1000, 25))
    assert image.width == 2048
    assert isinstance(grey, int) and 100 < grey < 155  # a blend of black and white


def test_exif_orientation_is_applied_to_a_scaled_down_image() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    exif[0x010F] = "SecretCam"
    raw = _encoded(Image.new("RGB", (4000, 2000), (0, 90, 200)), "JPEG", exif=exif.tobytes())
    image = normalise_image(raw, "image/jpeg")
    assert (image.width, image.height) == (1024, 2048)
    assert b"SecretCam" not in image.data


def test_a_progressive_jpeg_is_refused_when_its_coefficients_do_not_fit() -> None:
    """libjpeg holds every coefficient of a progressive JPEG at full size whatever the
    scale it decodes at: 187 MiB for 8000x8000 at 4:2:0."""
    big = Image.new("RGB", (8000, 8000), (5, 5, 5))
    with pytest.raises(ImageRejected, match=r"8000x8000 progressive .*187 MiB.*48 MiB"):
        normalise_image(_encoded(big, "JPEG", progressive=True), "image/jpeg")
    photo = _encoded(Image.new("RGB", (4000, 3000), (5, 5, 5)), "JPEG", progressive=True)
    image = normalise_image(photo, "image/jpeg")
    assert (image.width, image.height) == (2000, 1500)  # the 1/2 scale fits beside them


def test_a_jpeg_with_too_many_scans_is_refused_before_decoding() -> None:
    raw = _encoded(Image.new("RGB", (64, 64)), "JPEG", progressive=True)
    empty_scan = b"\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00"
    with pytest.raises(ImageRejected, match="scans; at most 64"):
        normalise_image(raw[:-2] + empty_scan * 100 + raw[-2:], "image/jpeg")


def test_a_jpeg_with_megabytes_of_metadata_is_refused() -> None:
    raw = _encoded(Image.new("RGB", (64, 64)), "JPEG", icc_profile=b"\0" * (5 * MiB))
    with pytest.raises(ImageRejected, match="more than 4 MiB of metadata"):
        normalise_image(raw, "image/jpeg")


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return (struct.pack(">I", len(body)) + kind + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF))


def _gif_blocks(raw: bytes) -> int:
    """Where a GIF's blocks start: after its header and global colour table."""
    return 13 + (3 << ((raw[10] & 7) + 1) if raw[10] & 0x80 else 0)


@pytest.mark.parametrize(("fmt", "media_type", "splice"), [
    # empty chunks after IHDR (200,000 of them: 0.5 s of CPU in Pillow's chunk loop)
    ("PNG", "image/png", lambda raw, n: raw[:33] + _png_chunk(b"abCd", b"") * n + raw[33:]),
    # empty COM segments after SOI
    ("JPEG", "image/jpeg", lambda raw, n: raw[:2] + b"\xff\xfe\x00\x02" * n + raw[2:]),
    # a comment extension of one-byte sub-blocks before the first frame
    ("GIF", "image/gif", lambda raw, n: raw[:_gif_blocks(raw)] + b"!\xfe" + b"\x01a" * n
     + b"\x00" + raw[_gif_blocks(raw):]),
])
def test_a_file_of_many_empty_blocks_is_refused_before_pillow_parses_them(
    fmt: str, media_type: str, splice: Callable[[bytes, int], bytes]
) -> None:
    raw = _encoded(Image.new("L", (8, 8)), fmt)
    assert normalise_image(splice(raw, 100), media_type).width == 8
    with pytest.raises(ImageRejected, match="made of more than 16384 blocks"):
        normalise_image(splice(raw, 200_000), media_type)


def test_a_png_with_megabytes_of_compressed_text_is_refused() -> None:
    """Pillow keeps a PNG's text chunks decompressed, by default up to 64 MiB of them:
    a few kilobytes of zTXt each inflating to 1 MiB."""
    inflating = zlib.compress(b"a" * (MiB - 64), 9)
    text = b"".join(_png_chunk(b"zTXt", b"k%d\0\0" % i + inflating) for i in range(8))
    png = _encoded(Image.new("RGB", (8, 8)), "PNG")
    with pytest.raises(ImageRejected, match="text chunks"):
        normalise_image(png[:33] + text + png[33:], "image/png")  # after IHDR


@pytest.mark.parametrize(("size", "mode", "fmt", "media_type"), [
    ((4096, 3073), "RGBA", "PNG", "image/png"),
    ((4096, 3073), "P", "GIF", "image/gif"),  # scaled as RGB: 4 bytes a pixel
    ((2048, 1536), "RGB", "WEBP", "image/webp"),  # libwebp: 16 bytes a pixel
])
def test_a_fully_decoded_image_over_the_decode_budget_is_refused(
    size: tuple[int, int], mode: str, fmt: str, media_type: str
) -> None:
    raw = _encoded(Image.new(mode, size), fmt)
    with pytest.raises(ImageRejected, match=f"{size[0]}x{size[1]} {mode} {fmt}, which takes "
                                            r"\d+ MiB to decode; .* at most 48 MiB"):
        normalise_image(raw, media_type)


def test_the_decode_budget_is_a_limit() -> None:
    raw = _encoded(Image.new("L", (3000, 3000)), "PNG")
    assert normalise_image(raw, "image/png").width == 2048
    with pytest.raises(ImageRejected, match="at most 8 MiB, so at most 8388608 pixels"):
        normalise_image(raw, "image/png", ImageLimits(max_decode_bytes=8 * MiB))


def test_a_requests_images_are_capped_in_all_once_re_encoded() -> None:
    noise = _uri("image/png", _encoded(Image.effect_noise((300, 300), 80), "PNG"))
    messages = _request(noise, noise, noise)
    one = len(normalise_image(base64.b64decode(noise.split(",")[1]), "image/png").data)
    with pytest.raises(APIError) as refused:
        asyncio.run(load_images(messages, limits=ImageLimits(max_total_bytes=2 * one + 1)))
    assert refused.value.param == "messages.0.content.3"
    assert "more than" in refused.value.message and "once re-encoded" in refused.value.message
