"""Images in chat requests: a vision-language model's prompt (LLaVA: a CLIP or SigLIP tower).

A chat's `image_url` content parts (also `image` / `input_image`) go where
`metrale_jax.LLM.chat` sends them (`metrale_jax.vision.prompt`): each becomes an
`{"type": "image"}` part for the chat template, which writes the model's placeholder (`<image>`)
in its place; the rendered prompt is tokenized and each placeholder expanded into the run of
`tokens_per_image` tokens the image's features fill. The images themselves (data: URLs, or
http(s) URLs from `--allowed-media-domains` hosts) are fetched, decoded and preprocessed in
the runtime's worker threads (`ModelRuntime.media_pool`, one job per image, side by side),
never on the event loop, under the server's `ImageLimits` (`--max-images`,
`--max-image-bytes`, `--max-image-pixels`, `--media-fetch-timeout`). Every bad image is a 400
whose `param` names its content part (`messages[i].content[j]`).

A text-only model refuses image parts (400: the model takes no images).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.http.errors import UnavailableError
from serving.http.protocol import ChatCompletionRequest, image_parts


def refuse_images(req: ChatCompletionRequest, model_name: str) -> None:
    """A 400 naming the first image part, for a model that takes no images."""
    parts = image_parts(req.messages)
    if parts:
        raise InvalidParameterError(f"model {model_name!r} takes no images: it is a text-only "
                                    "model", param=parts[0])


async def chat_prompt(rt: Any, req: ChatCompletionRequest,
                      **render: Any) -> tuple[list[int], tuple[Any, ...]]:
    """(prompt ids with each image's placeholder run, its `PromptImage`s) of a chat on a
    vision-language model; `render`: the chat template's arguments. The images are loaded in
    worker threads, side by side; an error is the first bad image's, in the request's order."""
    from metrale_jax.vision.media import check_image_count
    from metrale_jax.vision.prompt import expand_placeholders, split_image_parts
    messages, refs = split_image_parts(req.template_messages(images=True), text_parts=True)
    ids = rt.encode_chat(messages, **render)
    ids, offsets = expand_placeholders(ids, rt.vision, len(refs))
    if not refs:
        return ids, ()
    limits = rt.image_limits
    if len(refs) > limits.max_images:  # named at the first image over the limit
        check_image_count(len(refs), limits, param=refs[limits.max_images].param)
    loop = asyncio.get_running_loop()
    pool = rt.media_pool()
    try:
        jobs = [loop.run_in_executor(pool, load_images, rt, [ref], [offset])
                for ref, offset in zip(refs, offsets, strict=True)]
    except RuntimeError as e:  # the pool shut down: the server is stopping
        raise UnavailableError("the server is shutting down", code="draining",
                               retry_after=5) from e
    done = await asyncio.gather(*jobs, return_exceptions=True)
    for result in done:  # the first bad image in the request's order
        if isinstance(result, BaseException):
            raise result
    return ids, tuple(image for result in done for image in result)


def load_images(rt: Any, refs: Sequence[Any], offsets: Sequence[int]) -> tuple[Any, ...]:
    """The `PromptImage`s of `refs` (`vision.prompt.ImageRef`) at their placeholder `offsets`:
    fetched, decoded and preprocessed (blocking). Errors name the image's content part."""
    from metrale_jax.vision.prompt import load_refs, prompt_images
    images, digests = load_refs(refs, rt.image_limits)
    out: list[Any] = []
    for ref, image, offset, digest in zip(refs, images, offsets, digests, strict=True):
        try:
            out += prompt_images([image], [offset], [digest], rt.image_processor, rt.vision)
        except InvalidParameterError as e:
            raise InvalidParameterError(f"{ref.param}: {e.message}", param=ref.param) from e
    return tuple(out)


def tokenize_chat(rt: Any, req: ChatCompletionRequest, add_generation_prompt: bool,
                  add_special_tokens: bool) -> list[int]:
    """POST /tokenize's ids of a chat on a vision-language model: each image part as its
    placeholder run (the images are not loaded: only their number matters)."""
    from metrale_jax.vision.prompt import expand_placeholders, split_image_parts
    messages, refs = split_image_parts(req.template_messages(images=True), text_parts=True)
    text = rt.render_chat(messages, add_generation_prompt=add_generation_prompt)
    ids = rt.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return expand_placeholders(ids, rt.vision, len(refs))[0]


__all__ = ["chat_prompt", "load_images", "refuse_images", "tokenize_chat"]
