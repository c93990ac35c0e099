"""Image input at the gateway: an image part's source checked, fetched, decoded and
re-encoded before it may go to a vision deployment.

A source is an http(s) URL or a base64 data URI (OpenAI's `image_url.url`; Anthropic's
base64 and url sources become one of these). The rules:

- decoding and re-encoding (formats, bounded memory and work, what goes on: never the
  client's bytes or URL) is `api/image_decode.py`'s; a request's re-encodings total at
  most `max_total_bytes`;
- URLs are fetched by `api/image_fetch.py`, under its address policy and resolver.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol, runtime_checkable

from pydantic import Discriminator

from tokenyard.api.errors import schema_error
from tokenyard.api.image_decode import (
    _DECODER,
    DECODE_THREADS,
    MAX_BLOCKS,
    MAX_JPEG_METADATA,
    MAX_JPEG_SCANS,
    MEDIA_TYPES,
    _normalise,
    normalise_image,
    sniff_media_type,
)
from tokenyard.api.image_fetch import (
    DEFAULT_LIMITS,
    MAX_URL_CHARS,
    AddressPolicy,
    ImageLimits,
    ImageRejected,
    Resolver,
    check_url,
    fetch_image_bytes,
    is_public_address,
    system_resolver,
)
from tokenyard.errors import INVALID_VALUE, APIError, invalid_request
from tokenyard.text.content import (
    ImagePart,
    NormalisedImage,
    TemplateMessage,
    image_parts,
    require_vision,
)

__all__ = [
    "DECODE_THREADS",
    "MAX_BLOCKS",
    "MAX_JPEG_METADATA",
    "MAX_JPEG_SCANS",
    "MEDIA_TYPES",
    "ImageInput",
    "admit_images",
    "anthropic_source_uri",
    "image_error",
    "load_image",
    "load_images",
    "normalise_image",
    "only_from_user",
    "parse_data_uri",
    "sniff_media_type",
    "source_problem",
    "template_message",
    "text_or_image",
]


# ---------------------------------------------------------------------------- data URIs

def parse_data_uri(uri: str, max_bytes: int = DEFAULT_LIMITS.max_bytes) -> tuple[str, bytes]:
    """(media type, bytes) of a ``data:image/...;base64,...`` URI whose bytes start like
    the image type it declares; ImageRejected otherwise."""
    head, comma, payload = uri.partition(",")
    if not comma or not head.startswith("data:") or len(head) > MAX_URL_CHARS:
        raise ImageRejected("an image data URI looks like 'data:image/png;base64,...'.")
    media_type, *params = (p.strip().lower() for p in head[len("data:"):].split(";"))
    if media_type not in MEDIA_TYPES:
        raise ImageRejected(
            f"image type {media_type or '(none)'!r} is not supported; send one of "
            f"{', '.join(MEDIA_TYPES)}."
        )
    if "base64" not in params:
        raise ImageRejected("image data URIs must be base64-encoded (';base64,').")
    if len(payload) // 4 * 3 > max_bytes:
        raise ImageRejected(f"the image is larger than {max_bytes} bytes.")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRejected("the image data is not valid base64.") from exc
    found = sniff_media_type(data)
    if found is None:
        raise ImageRejected("the image data is not a PNG, JPEG, GIF or WebP image.")
    if found != media_type:
        raise ImageRejected(f"the image data is {found}, not the declared {media_type}.")
    return media_type, data


def source_problem(source: str) -> str | None:
    """Why `source` (an image URL or data URI) is refused before any fetch, or None.

    For the request schemas: cheap checks only (syntax, scheme, declared type, base64,
    the bytes' signature); decoding and fetching wait until a vision deployment is chosen."""
    try:
        if source.startswith("data:"):
            parse_data_uri(source)
        else:
            check_url(source)
    except ImageRejected as exc:
        return str(exc)
    return None


def anthropic_source_uri(source: dict[str, Any]) -> str:
    """Anthropic's ``{"type": "base64", "media_type", "data"}`` or ``{"type": "url",
    "url"}`` as the data URI or URL it stands for."""
    kind = source.get("type")
    if kind == "base64":
        return f"data:{source.get('media_type')};base64,{source.get('data')}"
    if kind == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise ImageRejected("an image source is {'type': 'base64', ...} or {'type': 'url', ...}.")



async def load_image(
    source: str | dict[str, Any],
    *,
    allow: AddressPolicy = is_public_address,
    resolve: Resolver = system_resolver,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> NormalisedImage:
    """One image from a URL, a data URI or an Anthropic source dict, fetched (URLs, under
    `allow` and `resolve`), then decoded and re-encoded by one of the `DECODE_THREADS`
    threads, off the event loop (Pillow's codecs release the GIL); ImageRejected."""
    uri = anthropic_source_uri(source) if isinstance(source, dict) else source
    declared: str | None = None
    if uri.startswith("data:"):
        declared, data = parse_data_uri(uri, limits.max_bytes)
    else:
        data = await fetch_image_bytes(uri, allow=allow, resolve=resolve, limits=limits)
    owned = [data]  # the decode takes the only reference: freed as soon as decoded
    del data
    return await asyncio.wrap_future(_DECODER.submit(_normalise, owned, declared, limits))


# ---------------------------------------------------------------------------- messages


def text_or_image(image_type: str) -> Discriminator:
    """The discriminator of a dialect's content-part union: tag "Image" for parts of
    `image_type`, "Text" for any other (the text model then names the types it refuses).
    Capitalised tags stay out of the parameter paths of validation errors."""

    def kind(data: Any) -> str:
        found = data.get("type") if isinstance(data, dict) else getattr(data, "type", None)
        return "Image" if found == image_type else "Text"

    return Discriminator(kind)


@runtime_checkable
class ImageInput(Protocol):
    """A dialect's image part or block: it knows its source."""

    def image_part(self, param: str) -> ImagePart: ...


def only_from_user(role: str, content: object, what: str) -> None:
    """A schema error naming the first image part of a message that is not the user's
    (`what`: how the dialect calls its image parts)."""
    if role == "user" or not isinstance(content, list):
        return
    for i, part in enumerate(content):
        if isinstance(part, ImageInput):
            raise schema_error(INVALID_VALUE, f"content.{i}.type",
                               f"{what} are only allowed in 'user' messages, not in "
                               f"'{role}' messages.")


def template_message(role: str, text: str, content: object, param: str) -> TemplateMessage:
    """A template message of `role` and `text`; when `content` (the client's list of
    parts) holds an image part, with `parts` in order: text parts as strings, image parts
    as `ImagePart`s named "<param>.content.<i>" (`param`: the message's own path)."""
    message: TemplateMessage = {"role": role, "content": text}
    if isinstance(content, list) and any(isinstance(p, ImageInput) for p in content):
        message["parts"] = [
            p.image_part(f"{param}.content.{i}") if isinstance(p, ImageInput) else str(p.text)
            for i, p in enumerate(content)
        ]
    return message


def image_error(part: ImagePart, reason: str) -> APIError:
    """400 naming the image part that broke a rule."""
    return invalid_request(f"Invalid image in '{part.param}': {reason}", param=part.param,
                           code=INVALID_VALUE)


async def load_images(
    messages: Sequence[TemplateMessage],
    *,
    allow: AddressPolicy = is_public_address,
    resolve: Resolver = system_resolver,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> list[TemplateMessage]:
    """`messages` with every image part loaded, for a vision deployment; an APIError
    (400) naming the first part that broke a rule.

    The parts load one after another, not at once: a request then holds one fetched
    image and one decode at a time, and its re-encodings, at most
    `limits.max_total_bytes` in all (see `ImageLimits`), whatever number of images it
    sends."""
    pending = image_parts(messages)
    if len(pending) > limits.max_images:
        raise image_error(pending[limits.max_images],
                          f"at most {limits.max_images} images are accepted per request.")
    loaded: dict[int, ImagePart] = {}
    total = 0
    for part in pending:
        try:
            image = await load_image(part.source, allow=allow, resolve=resolve, limits=limits)
        except ImageRejected as exc:
            raise image_error(part, str(exc)) from None
        total += len(image.data)
        if total > limits.max_total_bytes:
            raise image_error(
                part, f"the request's images come to more than {limits.max_total_bytes} "
                f"bytes once re-encoded (at most {limits.output_side} pixels a side); send "
                "fewer or smaller images.")
        loaded[id(part)] = replace(part, image=image)
    out: list[TemplateMessage] = []
    for message in messages:
        parts = message.get("parts")
        if parts is None:
            out.append(message)
            continue
        out.append({**message,
                    "parts": [p if isinstance(p, str) else loaded[id(p)] for p in parts]})
    return out


async def admit_images(
    messages: Sequence[TemplateMessage],
    *,
    model: str,
    vision: bool,
    allow: AddressPolicy = is_public_address,
    resolve: Resolver = system_resolver,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> list[TemplateMessage]:
    """The messages a deployment (`model`, with or without `vision`) gets: text-only ones
    as they are; with images, a 400 naming the first image part when it has no vision,
    else every image loaded (`load_images`)."""
    require_vision(messages, model, vision)
    if not image_parts(messages):
        return list(messages)
    return await load_images(messages, allow=allow, resolve=resolve, limits=limits)
