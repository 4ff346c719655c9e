"""Images of multimodal prompt rows in verl's schema: an `images` column beside the chat `prompt`, whose user messages
mark where each image goes with `<image>` (in order). An image is encoded bytes (`{"bytes": ..., "path": ...}` as
parquet stores an image feature, or raw bytes) or a path to an image file. Each row's images are decoded to RGB and,
with its prompt, run through the checkpoint's own processor from transformers (`AutoProcessor`: the chat template
with image parts, each image's placeholder tokens, pixel values), before any device work. A bad image is a one-line
`DataError` naming the file, the row and the image's index: undecodable, zero-size, or more of them in a row than
`max_images`, or a count that does not match the row's `<image>` marks."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hfjax.data.records import DataError, RowRef

IMAGE_MARK = "<image>"  # where verl's schema puts an image in a message's text


def decode_images(value: Any, ref: RowRef, max_images: int, field: str = "images") -> list[Any]:
    """The row's images (`value`: a list of encoded images, see the module docstring; None: none) as RGB PIL images,
    checked: decodable, non-empty, at most `max_images`."""
    from PIL import Image, UnidentifiedImageError

    if value is None:
        return []
    if isinstance(value, np.ndarray):
        value = list(value)
    if not isinstance(value, list | tuple):
        raise ref.error(field, "a list of images (encoded bytes, {'bytes': ...} or paths)", value)
    if len(value) > max_images:
        raise DataError(f"{ref}: field '{field}': {len(value)} images, more than max_images {max_images}")
    images = []
    for i, item in enumerate(value):
        where = f"{ref}: field '{field}' image {i}"
        data, path = _bytes_or_path(item)
        if data is None and path is None:
            raise DataError(f"{where}: expected encoded bytes, {{'bytes': ...}} or a path, got {type(item).__name__}")
        if data is not None and not data:
            raise DataError(f"{where}: a zero-size image (0 bytes)")
        try:
            image = Image.open(io.BytesIO(data) if data is not None else Path(path))
            image.load()
        except (OSError, UnidentifiedImageError, ValueError) as exc:
            raise DataError(f"{where}: cannot decode it as an image ({exc})") from exc
        if image.width == 0 or image.height == 0:
            raise DataError(f"{where}: a zero-size image ({image.width} x {image.height})")
        images.append(image.convert("RGB"))
    return images


def _bytes_or_path(item: Any) -> tuple[bytes | None, str | None]:
    if isinstance(item, dict):
        data, path = item.get("bytes"), item.get("path")
        if data is not None:
            return bytes(data), None
        return None, (str(path) if path else None)
    if isinstance(item, bytes | bytearray):
        return bytes(item), None
    if isinstance(item, str | Path):
        return None, str(item)
    return None, None


def image_messages(messages: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """The messages with each `<image>` mark of a text turned into an image part ({"type": "image"}, the text
    around it into text parts), as processors' chat templates take them; and how many marks there were."""
    out, marks = [], 0
    for message in messages:
        content = message["content"]
        if not isinstance(content, str) or IMAGE_MARK not in content:
            out.append(dict(message))
            continue
        parts: list[dict[str, Any]] = []
        for i, text in enumerate(content.split(IMAGE_MARK)):
            if i:
                parts.append({"type": "image"})
                marks += 1
            if text:
                parts.append({"type": "text", "text": text})
        out.append({**message, "content": parts})
    return out, marks


def process_prompt(
    processor: Any, messages: Sequence[dict[str, Any]], images: list[Any], ref: RowRef
) -> tuple[str, np.ndarray, np.ndarray]:
    """(rendered text, token ids [length] int32 with each image's placeholder tokens, pixel values [images,
    channels, height, width] float32) of one row by `processor`; the row's `<image>` marks must match its images."""
    parts, marks = image_messages(messages)
    if marks != len(images):
        raise DataError(f"{ref}: the prompt marks {marks} images with {IMAGE_MARK!r} but the row has {len(images)}")
    try:
        text = processor.apply_chat_template(parts, add_generation_prompt=True, tokenize=False)
        out = processor(text=[text], images=[images] if images else None, return_tensors="np")
    except Exception as exc:  # processors and jinja raise various types
        raise DataError(f"{ref}: the checkpoint's processor failed on this prompt ({exc})") from exc
    ids = np.asarray(out["input_ids"][0], np.int32)
    pixels = np.asarray(out["pixel_values"], np.float32) if images else np.zeros((0,), np.float32)
    return text, ids, pixels
