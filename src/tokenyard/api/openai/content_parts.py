"""The content parts of an OpenAI chat message: text, or an image by URL or data URI.

Audio, file and refusal parts are refused with a 400 that names them; an image's source
is checked here without a fetch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Tag, field_validator, model_validator

from tokenyard.api.errors import schema_error
from tokenyard.api.images import source_problem, text_or_image
from tokenyard.api.schemas import TEXT_PART_SEPARATOR, RequestModel
from tokenyard.errors import INVALID_VALUE, UNSUPPORTED_VALUE
from tokenyard.text.content import Detail, ImagePart

_UNSUPPORTED_PARTS = {
    "input_audio": "Audio",
    "file": "File",
    "refusal": "Refusal",
}


class TextContentPart(RequestModel):
    """``{"type": "text", "text": ...}``."""

    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _reject_non_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            kind = data.get("type")
            if isinstance(kind, str) and kind in _UNSUPPORTED_PARTS:
                raise schema_error(
                    UNSUPPORTED_VALUE,
                    "type",
                    f"{_UNSUPPORTED_PARTS[kind]} content parts ('{kind}') are not supported "
                    "by this server yet; send text and image parts only.",
                )
        return data


class ImageURL(RequestModel):
    """`image_url`: an http(s) URL or a base64 data URI, checked here without a fetch
    (`api/images.source_problem`); fetched and decoded only for a vision deployment."""

    url: str
    detail: Detail | None = None

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        problem = source_problem(url)
        if problem is not None:
            raise schema_error(INVALID_VALUE, None, problem)
        return url


class ImageContentPart(RequestModel):
    """``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}``."""

    type: Literal["image_url"]
    image_url: ImageURL

    def image_part(self, param: str) -> ImagePart:
        """This part as the template message's `ImagePart`, named `param`."""
        return ImagePart(param, self.image_url.url, self.image_url.detail)


#: A content part: image parts by their type; anything else is validated as text.
ContentPartParam = Annotated[
    Annotated[TextContentPart, Tag("Text")] | Annotated[ImageContentPart, Tag("Image")],
    text_or_image("image_url"),
]


def join_text(content: str | list[ContentPartParam] | None) -> str:
    """A message's text as one string (text parts joined by TEXT_PART_SEPARATOR)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return TEXT_PART_SEPARATOR.join(
        part.text for part in content if isinstance(part, TextContentPart)
    )
