"""Images in request bodies: Anthropic `image` blocks and OpenAI `image_url` parts.

Both become `ImageInput`s carrying the encoded file and where it sat in the body; the
engine decodes and checks them. The proxy never fetches: a URL is refused with a 400, since
a prompt cache cannot key on what a remote server might return next time.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from typing import Any

from engine_bridge.types import ImageInput

from ..errors import ApiError

_NO_FETCH = "this proxy does not fetch images from the network; send the image inline"
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*?);base64,", re.I)


def _decode(data: Any, where: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise ApiError(400, f"{where}: expected base64 image data", param=where)
    try:
        # Whitespace inside base64 is common (wrapped lines) and harmless.
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: not valid base64", param=where) from None


def anthropic_image(block: dict[str, Any], where: str) -> ImageInput:
    """An Anthropic `{"type": "image", "source": {...}}` block at `where`."""
    source = block.get("source")
    if not isinstance(source, dict):
        raise ApiError(400, f"{where}.source: expected an object", param=f"{where}.source")
    kind = source.get("type")
    if kind == "url":
        raise ApiError(
            400,
            f"{where}.source: {_NO_FETCH} (source.type 'base64')",
            param=f"{where}.source.url",
        )
    if kind != "base64":
        raise ApiError(
            400,
            f"{where}.source.type: expected 'base64', got {kind!r}",
            param=f"{where}.source.type",
        )
    media_type = source.get("media_type")
    if not isinstance(media_type, str):
        raise ApiError(
            400, f"{where}.source.media_type: expected a string", param=f"{where}.source.media_type"
        )
    field = f"{where}.source.data"
    return ImageInput(_decode(source.get("data"), field), media_type, field)


def openai_image(part: dict[str, Any], where: str) -> ImageInput:
    """An OpenAI `{"type": "image_url", "image_url": {"url": "data:..."}}` part at `where`."""
    image_url = part.get("image_url")
    field = f"{where}.image_url.url"
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str):
        raise ApiError(400, f"{field}: expected a string", param=field)
    match = _DATA_URL.match(url)
    if match is None:
        if url.lower().startswith(("http://", "https://")):
            raise ApiError(400, f"{field}: {_NO_FETCH} as a data: URL", param=field)
        raise ApiError(
            400, f"{field}: expected a data URL (data:image/png;base64,...)", param=field
        )
    return ImageInput(_decode(url[match.end() :], field), match.group("type") or "", field)


Parts = tuple[str | ImageInput, ...]


def text_and_parts(parts: Sequence[str | ImageInput]) -> tuple[str, Parts | None]:
    """A message's text, and its parts in order when an image is among them (None without
    one: the message is its text alone)."""
    text = "".join(p for p in parts if isinstance(p, str))
    return text, None if all(isinstance(p, str) for p in parts) else tuple(parts)
