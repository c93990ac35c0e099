"""A chat message's content beyond text: image parts, as plain values.

A template message keeps its text in `content` (what a local chat template renders) and,
only when the client sent images, every part in order under `parts`: strings and
`ImagePart`s. An `ImagePart` names the request parameter it came from and what the client
sent; once `api/images.py` has fetched, decoded and re-encoded it, it also holds our
`NormalisedImage`. Only that re-encoding ever leaves the gateway (`openai_content`), never
the client's bytes or URL. The embedded engine has no vision: `needs_vision` tells routing
that a request must go to a deployment that has it.

No Pillow, no HTTP, no pydantic here: plain data that any layer below `api/` may read.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, NotRequired, TypedDict

from tokenyard.errors import UNSUPPORTED_VALUE, APIError, invalid_request

#: The formats our re-encoding produces (PNG for images with transparency or few colours,
#: JPEG for photographs).
NormalisedType = Literal["image/png", "image/jpeg"]
#: OpenAI's `image_url.detail`: a hint for the vision model, passed on as given.
Detail = Literal["auto", "low", "high"]


@dataclass(frozen=True)
class NormalisedImage:
    """An image decoded and re-encoded by the gateway: `data` is `media_type`'s bytes."""

    media_type: NormalisedType
    data: bytes
    width: int
    height: int

    def data_uri(self) -> str:
        """``data:<media type>;base64,<data>``: how the image goes upstream."""
        return f"data:{self.media_type};base64,{base64.b64encode(self.data).decode('ascii')}"


@dataclass(frozen=True)
class ImagePart:
    """One image content part: where it was in the request (`param`, e.g.
    "messages.0.content.1"), what the client sent (`source`: an http(s) URL or a data URI,
    never sent on), OpenAI's `detail` hint, and our re-encoding once loaded."""

    param: str
    source: str
    detail: Detail | None = None
    image: NormalisedImage | None = None


ContentPart = str | ImagePart


class TemplateMessage(TypedDict):
    """A chat-template message: `role` and its text as one string (`content`); `parts`,
    present only when the message has an image, holds every part in the client's order."""

    role: str
    content: str
    parts: NotRequired[list[ContentPart]]


def image_parts(messages: Sequence[TemplateMessage]) -> list[ImagePart]:
    """Every image part of the conversation, in order."""
    return [p for m in messages for p in m.get("parts", ()) if isinstance(p, ImagePart)]


def needs_vision(messages: Sequence[TemplateMessage]) -> str | None:
    """The parameter path of the first image part (a deployment without `vision` must
    refuse the request naming it), or None when the conversation is text only."""
    images = image_parts(messages)
    return images[0].param if images else None


def vision_unsupported(model: str, param: str) -> APIError:
    """400 for an image part sent to a model without vision, naming the part."""
    return invalid_request(
        f"Invalid content type. image_url is only supported by certain models; "
        f"'{model}' does not support image input.",
        param=param, code=UNSUPPORTED_VALUE,
    )


def require_vision(messages: Sequence[TemplateMessage], model: str, vision: bool) -> None:
    """Raise `vision_unsupported` when the conversation has an image part and the
    deployment (`model`) has no `vision`."""
    param = needs_vision(messages)
    if param is not None and not vision:
        raise vision_unsupported(model, param)


def openai_content(message: TemplateMessage) -> str | list[dict[str, Any]]:
    """The message's `content` for an OpenAI-compatible upstream: its text, or, with
    images, the parts in order with each image as our re-encoding in a data URI.

    Raises ValueError for an image that was never loaded: the client's source is never
    forwarded."""
    parts = message.get("parts")
    if not parts:
        return message["content"]
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, str):
            out.append({"type": "text", "text": part})
            continue
        if part.image is None:
            raise ValueError(f"{part.param}: the image was not loaded")
        image_url: dict[str, Any] = {"url": part.image.data_uri()}
        if part.detail is not None:
            image_url["detail"] = part.detail
        out.append({"type": "image_url", "image_url": image_url})
    return out
