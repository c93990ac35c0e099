"""Decoding and re-encoding an image for the gateway's image input (`api/images.py`),
within bounded memory and CPU.

- formats: PNG, JPEG, GIF (its first frame) and WebP, decoded only by those Pillow
  plugins; at most `ImageLimits.max_bytes` encoded, `max_side` pixels a side and
  `max_pixels` in all, checked from the header before any pixel is decoded;
- bounded work (`ImageLimits` says how much): what one decode may take in memory
  (`max_decode_bytes`, from the header: large JPEGs decode at a reduced scale, other
  formats decode in full), a file's structure (blocks, JPEG scans and metadata, checked
  before Pillow parses it), and decodes run on a few threads shared by the process;
- what comes out is our re-encoding (JPEG stays JPEG, anything else becomes PNG), scaled
  down to fit `output_side` a side, EXIF orientation applied and metadata dropped.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

from PIL import Image, ImageOps, JpegImagePlugin, PngImagePlugin, UnidentifiedImageError

from tokenyard.api.image_fetch import DEFAULT_LIMITS, ImageLimits, ImageRejected, MiB
from tokenyard.text.content import NormalisedImage, NormalisedType

#: Media type → the Pillow format that decodes it; nothing else is ever opened.
MEDIA_TYPES: dict[str, str] = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/gif": "GIF",
    "image/webp": "WEBP",
}
_FORMAT_TYPES = {fmt: media for media, fmt in MEDIA_TYPES.items()}


# ---------------------------------------------------------------------------- media types

_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)


def sniff_media_type(data: bytes) -> str | None:
    """The image type `data` starts like (PNG, JPEG, GIF, WebP), or None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    for signature, media_type in _SIGNATURES:
        if data.startswith(signature):
            return media_type
    return None


# ---------------------------------------------------------------------------- decoding

#: Decodes running at once in this process, whichever requests they belong to: with
#: each request's images loading one after another, the memory all decodes hold is at
#: most this many times `ImageLimits.max_decode_bytes` (plus their scaled copies), and
#: images never take more than half the cores. A decode abandoned by its request (a
#: client that went away) keeps its thread until it ends, so it still counts.
DECODE_THREADS = max(1, min(2, (os.cpu_count() or 1) // 2))
_DECODER = ThreadPoolExecutor(max_workers=DECODE_THREADS, thread_name_prefix="image-decode")

#: Most scans a JPEG may have: each scan of a progressive JPEG walks every block of the
#: image again, so thousands of tiny scans are a CPU bomb (libjpeg's own encoders write
#: at most about ten).
MAX_JPEG_SCANS = 64
#: Most bytes of metadata (APPn and COM segments) before a JPEG's first scan; Pillow
#: keeps them all, and an ICC profile is joined into one more copy.
MAX_JPEG_METADATA = 4 * MiB
#: Most blocks (JPEG segments before the first scan, PNG chunks, GIF extension blocks
#: before the first frame) a file may have: Pillow parses them in Python, so a 20 MiB
#: file of empty blocks costs seconds of CPU; real files have tens, or a few thousand
#: chunks of image data.
MAX_BLOCKS = 16384
#: Source bytes, in the working mode, that `_downscaled` converts and resamples at once.
_STRIP_BYTES = 2 * MiB
#: Bicubic (Pillow's antialiased one, as its thumbnails use) reaches 2 source pixels
#: either side, times the reduction factor.
_BICUBIC_SUPPORT = 2.0

# PNG text chunks are dropped from what goes on, but Pillow keeps up to 64 MiB of them
# (decompressed) while it reads the file; 4 MiB is plenty for real metadata. Pillow is
# only used here in this process.
PngImagePlugin.MAX_TEXT_MEMORY = 4 * MiB

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_PROGRESSIVE = frozenset({0xC2, 0xC6, 0xCA, 0xCE})


def _pixel_bytes(mode: str) -> int:
    """Bytes a pixel of `mode` takes in a Pillow image (RGB is stored in 4 too)."""
    if mode in ("1", "L", "P"):
        return 1
    return 2 if mode.startswith("I;16") else 4


def _mib(n: float) -> str:
    return f"{n / MiB:.0f} MiB"


def _too_many_blocks(kind: str) -> ImageRejected:
    return ImageRejected(f"the {kind} is made of more than {MAX_BLOCKS} blocks.")


def _jpeg_buffered(data: bytes) -> bool:
    """Whether libjpeg buffers the whole image's coefficients to decode `data`: when it
    is progressive, or its first scan does not hold every component. The markers up to
    the first scan are walked segment by segment (an EXIF thumbnail's own markers sit
    inside its APP1 and are skipped with it; stray bytes between segments are skipped,
    as libjpeg does); then the scans are counted (in entropy-coded data a 0xFF byte is
    always stuffed, so 0xFFDA is a marker). ImageRejected for more than `MAX_BLOCKS`
    segments, `MAX_JPEG_METADATA` of metadata or `MAX_JPEG_SCANS` scans."""
    pos, components, progressive, metadata = 2, 0, False, 0
    for _ in range(MAX_BLOCKS):
        if pos < 0 or pos + 4 > len(data):
            raise ImageRejected("the JPEG has no image data.")
        if data[pos] != 0xFF:
            pos = data.find(b"\xff", pos)
            continue
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD8:  # no length
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2:pos + 4], "big")
        if marker in _SOF and pos + 9 < len(data):
            components, progressive = data[pos + 9], marker in _PROGRESSIVE
        elif 0xE0 <= marker <= 0xEF or marker == 0xFE:
            metadata += length
            if metadata > MAX_JPEG_METADATA:
                raise ImageRejected(f"the JPEG carries more than {_mib(MAX_JPEG_METADATA)} "
                                    "of metadata.")
        elif marker == 0xDA and pos + 4 < len(data):
            scans = 1 + data.count(b"\xff\xda", pos + 2)
            if scans > MAX_JPEG_SCANS:
                raise ImageRejected(f"the JPEG has {scans} scans; at most {MAX_JPEG_SCANS} "
                                    "are accepted.")
            return progressive or data[pos + 4] < components
        pos += 2 + length
    raise _too_many_blocks("JPEG")


def _check_png_chunks(data: bytes) -> None:
    """ImageRejected for a PNG of more than `MAX_BLOCKS` chunks (Pillow reads each in
    Python, checksum and all)."""
    pos = 8
    for _ in range(MAX_BLOCKS):
        if pos + 8 > len(data) or data[pos + 4:pos + 8] == b"IEND":
            return
        pos += 12 + int.from_bytes(data[pos:pos + 4], "big")
    raise _too_many_blocks("PNG")


def _check_gif_blocks(data: bytes) -> None:
    """ImageRejected for a GIF with more than `MAX_BLOCKS` extension sub-blocks before
    its first frame (Pillow reads each in Python as it opens the file; the frame's own
    data is read by its C decoder)."""
    pos = 13
    if len(data) > 10 and data[10] & 0x80:  # a global colour table
        pos += 3 << ((data[10] & 7) + 1)
    blocks = 0
    while pos + 1 < len(data) and data[pos] == 0x21:  # an extension
        pos += 2
        while pos < len(data):
            blocks += 1
            if blocks > MAX_BLOCKS:
                raise _too_many_blocks("GIF")
            size = data[pos]
            pos += 1 + size
            if size == 0:
                break


def _coefficient_bytes(image: JpegImagePlugin.JpegImageFile) -> int:
    """What libjpeg holds to decode a buffered JPEG: every DCT coefficient of the image
    at full size (2 bytes each, 64 per 8x8 block of each component), whatever the scale
    it outputs at."""
    width, height = image.size
    factors = [(h, v) for _, h, v, _ in image.layer] or [(1, 1)]
    h_max = max(h for h, _ in factors) or 1
    v_max = max(v for _, v in factors) or 1
    blocks = sum(-(-width * h // (8 * h_max)) * -(-height * v // (8 * v_max))
                 for h, v in factors)
    return blocks * 64 * 2


def _jpeg_scale(image: Image.Image, target: tuple[int, int], budget: int) -> int:
    """The largest of libjpeg's scales 1, 2, 4, 8 that still decodes at least `target`,
    or a larger one when that does not fit `budget` bytes of pixels."""
    width, height = image.size
    bands = _pixel_bytes(image.mode)
    scale = 1
    for s in (2, 4, 8):
        if s <= min(width, height) and width // s >= target[0] and height // s >= target[1]:
            scale = s
    while scale < 8 and scale * 2 <= min(width, height) and \
            -(-width // scale) * -(-height // scale) * bands > budget:
        scale *= 2
    return scale


def _fit(size: tuple[int, int], side: int) -> tuple[int, int]:
    """`size` scaled to fit a `side` x `side` square, aspect kept (never enlarged)."""
    width, height = size
    if max(width, height) <= side:
        return size
    ratio = side / max(width, height)
    return max(1, round(width * ratio)), max(1, round(height * ratio))


def _working_mode(image: Image.Image) -> str:
    """The mode an image is scaled in: Pillow resamples palette and bilevel images by
    nearest neighbour only, so they become RGB(A) or L first."""
    if image.mode in ("L", "LA", "RGB", "RGBA") and "transparency" not in image.info:
        return image.mode
    if image.mode == "1":
        return "L"
    has_alpha = "A" in image.mode or "a" in image.mode or "transparency" in image.info
    return "RGBA" if has_alpha else "RGB"


def _downscaled(image: Image.Image, size: tuple[int, int]) -> Image.Image:
    """`image` resampled (bicubic) to `size`, a strip of rows at a time.

    Pillow's resize of the whole image would hold, beside it, a converted or (with
    alpha) premultiplied copy of it, and an intermediate as wide as the output and as
    tall as the source; by strips those are a strip's size. Each strip is cropped with
    the rows the filter reads beyond it, so the result is the whole-image resize's (to
    within rounding)."""
    mode = _working_mode(image)
    width, height = image.size
    out_width, out_height = size
    scale = height / out_height
    margin = math.ceil(_BICUBIC_SUPPORT * scale) + 1
    rows = max(1, int(_STRIP_BYTES // (4 * width * scale)))
    out = Image.new(mode, size)
    for top in range(0, out_height, rows):
        bottom = min(out_height, top + rows)
        y0, y1 = top * scale, bottom * scale
        src_top = max(0, math.floor(y0) - margin)
        src_bottom = min(height, math.ceil(y1) + margin)
        strip = image.crop((0, src_top, width, src_bottom))
        if strip.mode != mode:
            strip = strip.convert(mode)
        out.paste(strip.resize((out_width, bottom - top), Image.Resampling.BICUBIC,
                               box=(0, y0 - src_top, width, y1 - src_top)), (0, top))
    out.info = {k: v for k, v in image.info.items() if k != "transparency"}
    return out


def _prepare_decode(image: Image.Image, buffered: bool | None, size: int,
                    limits: ImageLimits) -> None:
    """Refuse an image whose decode would take more than `limits.max_decode_bytes`,
    before any pixel is decoded; set a JPEG to decode at a reduced scale when it is to be
    scaled down anyway. `buffered`: for a JPEG, whether libjpeg buffers its coefficients
    (`_jpeg_buffered`), else None; `size`: the file's, in bytes."""
    width, height = image.size
    budget = limits.max_decode_bytes
    fmt = image.format
    if isinstance(image, JpegImagePlugin.JpegImageFile) and buffered is not None:
        coefficients = _coefficient_bytes(image) if buffered else 0
        scale = _jpeg_scale(image, _fit((width, height), limits.output_side),
                            budget - coefficients)
        if scale > 1:
            image.draft(None, (width // scale, height // scale))
        cost = coefficients + image.width * image.height * _pixel_bytes(image.mode)
        if cost > budget:
            kind = "progressive (or multi-scan) " if buffered else ""
            raise ImageRejected(
                f"the image is a {width}x{height} {kind}JPEG, which takes "
                f"{_mib(cost)} to decode; one image may take at most {_mib(budget)}: "
                "send it smaller or as a baseline JPEG.")
        return
    if fmt == "WEBP":
        # libwebp decodes into two RGBA canvases, and Pillow copies the file once and the
        # frame twice more.
        per_pixel, extra = 16, size
    else:
        # A palette or bilevel image is scaled as RGB(A) or L: its pixels cost (memory
        # by strips, CPU for all of them) what they cost in that mode.
        per_pixel = max(_pixel_bytes(image.mode), _pixel_bytes(_working_mode(image)))
        extra = 0
    cost = width * height * per_pixel + extra
    if cost > budget:
        raise ImageRejected(
            f"the image is a {width}x{height} {image.mode} {fmt}, which takes {_mib(cost)}"
            f" to decode; one image may take at most {_mib(budget)}, so at most "
            f"{(budget - extra) // per_pixel} pixels in all for this kind of image: send "
            "it smaller (or as a JPEG).")


def _encode(image: Image.Image, source_format: str) -> tuple[NormalisedType, bytes]:
    out = io.BytesIO()
    if source_format == "JPEG":
        image.convert("RGB").save(out, format="JPEG", quality=90)
        return "image/jpeg", out.getvalue()
    if image.mode not in ("1", "L", "LA", "P", "RGB", "RGBA"):
        image = image.convert("RGBA")
    image.save(out, format="PNG", optimize=False)
    return "image/png", out.getvalue()


def _decoded(owned: list[bytes], declared: str | None, limits: ImageLimits
             ) -> tuple[Image.Image, str]:
    """(the image to re-encode, its source format): the bytes taken out of `owned`,
    decoded (first frame) under the rules of `normalise_image`, scaled down when larger
    than `limits.output_side` and turned upright. Nothing else holds the bytes, so they
    are freed once decoded, and the full-size decode once scaled."""
    data = owned.pop()
    if len(data) > limits.max_bytes:
        raise ImageRejected(f"the image is larger than {limits.max_bytes} bytes.")
    # What Pillow parses in Python as it opens a file, and a JPEG's metadata, which it
    # keeps, are checked first.
    sniffed = sniff_media_type(data)
    buffered = _jpeg_buffered(data) if sniffed == "image/jpeg" else None
    if sniffed == "image/png":
        _check_png_chunks(data)
    elif sniffed == "image/gif":
        _check_gif_blocks(data)
    source = io.BytesIO(data)  # shares the bytes, until closed
    with Image.open(source, formats=list(MEDIA_TYPES.values())) as image:
        fmt = str(image.format)
        media_type = _FORMAT_TYPES[fmt]
        if declared is not None and declared != media_type:
            raise ImageRejected(f"the image data is {media_type}, not the declared {declared}.")
        width, height = image.size
        if max(width, height) > limits.max_side or width * height > limits.max_pixels:
            raise ImageRejected(
                f"the image is {width}x{height} pixels; at most {limits.max_side} a side "
                f"and {limits.max_pixels} in all are accepted."
            )
        image.seek(0)
        _prepare_decode(image, buffered, len(data), limits)
        del data
        image.load()
        source.close()
        target = _fit((width, height), limits.output_side)
        upright: Image.Image = image
        if max(image.size) > max(target):
            upright = _downscaled(image, target)
            image.close()
    ImageOps.exif_transpose(upright, in_place=True)
    return upright, fmt


def _normalise(owned: list[bytes], declared: str | None, limits: ImageLimits
               ) -> NormalisedImage:
    """`normalise_image` of the bytes in `owned`, which it takes out (`_decoded`)."""
    try:
        with warnings.catch_warnings():
            # Pillow's own decompression-bomb guard stays on, its warning an error.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            upright, fmt = _decoded(owned, declared, limits)
        encoded_type, encoded = _encode(upright, fmt)
        return NormalisedImage(encoded_type, encoded, upright.width, upright.height)
    except ImageRejected:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageRejected(f"the image declares too many pixels ({exc}).") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRejected(
            f"the image data could not be decoded as PNG, JPEG, GIF or WebP ({exc})."
        ) from None


def normalise_image(
    data: bytes, declared: str | None = None, limits: ImageLimits = DEFAULT_LIMITS
) -> NormalisedImage:
    """`data` decoded (first frame), scaled down to fit `limits.output_side` and
    re-encoded; ImageRejected for bytes over the cap, another format than `declared`, a
    format not allowed, too many pixels, or a decode over `limits.max_decode_bytes`
    (both checked from the header, before decoding: a small file declaring a huge size
    is refused)."""
    return _normalise([data], declared, limits)
