"""Chat messages with images -> a vision-language model's prompt ids and `PromptImage`s.

OpenAI-style content parts (`{"type": "image_url", "image_url": {"url": ...}}`, also
`{"type": "image", ...}` / `"input_image"`) become `{"type": "image"}` parts for the chat
template, which writes the model's image placeholder (`<image>` for LLaVA) where each one
was; the rendered prompt is tokenized and each placeholder token is expanded into the
`tokens_per_image` run the model's features fill, as transformers' `LlavaProcessor` does.
The images are fetched (`media.load_image_url`) and preprocessed (`ImageProcessor`) here, so
the HTTP server and `LLM.chat` share one path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from metrale_jax.errors import InvalidParameterError
from metrale_jax.families.llava import VisionConfig
from metrale_jax.vision.media import check_image_count, image_digest, load_image_url

IMAGE_PART_TYPES = ("image_url", "image", "input_image")
"""Content part types that carry an image."""


@dataclasses.dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt: `offset`, the prompt position of its first placeholder token,
    and `length`, how many there are (the model's `T_img`); `pixels [C, H, W] float32`, the
    image processor's output; `digest`, a hex hash of the image's content (it keys the
    prefix cache's pages)."""

    offset: int
    length: int
    pixels: np.ndarray
    digest: str


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image part of a chat: where it is (`url`: a data URL or http(s) URL; or `image`: a
    PIL image given directly in Python) and `param`, its place for error messages
    (`messages[i].content[j]`)."""

    param: str
    url: str | None = None
    image: Any = None


def split_image_parts(messages: Sequence[dict[str, Any]], *, text_parts: bool = False
                      ) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """(the messages for the chat template, each image part replaced by `{"type": "image"}`;
    the images in order). Raises `InvalidParameterError` for a malformed image part.

    text_parts: string contents become `[{"type": "text", "text": ...}]` (a vision-language
    model's template, as llava-hf's, reads only content parts: it would drop a string)."""
    out, refs = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str) and text_parts:
            out.append({**message, "content": [{"type": "text", "text": content}]})
            continue
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            param = f"messages[{i}].content[{j}]"
            value = part.get("image_url", part.get("image"))
            if isinstance(value, dict):
                value = value.get("url")
            if isinstance(value, str) and value:
                refs.append(ImageRef(param, url=value))
            elif value is not None and hasattr(value, "convert"):  # a PIL image
                refs.append(ImageRef(param, image=value))
            else:
                raise InvalidParameterError(f"{param}: an image part needs image_url.url (a "
                                            "data: URL or an http(s) URL)", param=param)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, refs


def expand_placeholders(ids: Sequence[int], vision: VisionConfig, count: int
                        ) -> tuple[list[int], list[int]]:
    """(ids with each image placeholder token repeated `tokens_per_image` times, the offset
    of each run). `count` images must match the placeholders the template wrote (a
    placeholder typed in the text counts too): `InvalidParameterError` otherwise."""
    token, T = vision.image_token_id, vision.tokens_per_image
    found = [k for k, t in enumerate(ids) if t == token]
    if len(found) != count:
        raise InvalidParameterError(
            f"the chat template wrote {len(found)} image placeholders for {count} images "
            "(the text must not contain the image token itself)", param="messages")
    out, offsets = [], []
    for t in ids:
        if t == token:
            offsets.append(len(out))
            out += [token] * T
        else:
            out.append(int(t))
    return out, offsets


def prompt_images(images: Sequence[Any], offsets: Sequence[int], digests: Sequence[str],
                  processor: Callable[[Any], np.ndarray],
                  vision: VisionConfig) -> tuple[PromptImage, ...]:
    """The `PromptImage`s of decoded PIL `images` at their placeholder `offsets`, with their
    content `digests`: each preprocessed by `processor` (`[C, H, W] float32`)."""
    out = []
    for image, offset, digest in zip(images, offsets, digests, strict=True):
        pixels = np.asarray(processor(image), np.float32)
        out.append(PromptImage(int(offset), vision.tokens_per_image, pixels, digest))
    return tuple(out)


def load_refs(refs: Sequence[ImageRef], limits: Any) -> tuple[list[Any], list[str]]:
    """Fetches and decodes every image (blocking: the HTTP server calls this in a thread);
    returns (PIL images, content digests). Raises `InvalidParameterError` naming the part."""
    check_image_count(len(refs), limits)
    images, digests = [], []
    for ref in refs:
        if ref.url is not None:
            image, data = load_image_url(ref.url, limits, param=ref.param)
            digest = image_digest(data)
        else:
            image = ref.image
            w, h = image.size
            if limits.max_pixels is not None and w * h > limits.max_pixels:
                raise InvalidParameterError(
                    f"{ref.param}: the image has {w}x{h} = {w * h} pixels, more than the "
                    f"{limits.max_pixels} allowed", param=ref.param)
            digest = image_digest(np.asarray(image.convert("RGB")).tobytes()
                                  + repr(image.size).encode())
        images.append(image)
        digests.append(digest)
    return images, digests


__all__ = ["IMAGE_PART_TYPES", "ImageRef", "PromptImage", "expand_placeholders", "load_refs",
           "prompt_images", "split_image_parts"]
