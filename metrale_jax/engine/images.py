"""The host side of a vision-language model's image feature pool.

A request's images are encoded once, all together, when the first prompt piece of its row
is scheduled (after a prefix shared from the cache: only the images after it): the vision
program writes each image's `[T_img, E]` features into a slot of the pool
(`DecodeState.images`, `[slots * T_img, E]`), and every piece of the prompt reads them at its
placeholder positions (`ChunkInputs.image_rows`). A row's slots are free again once its
prompt is prefilled (the pages hold what the features gave) or the row is released; a
preempted request is encoded again when it is fed again. A row holds all its remaining
images or none, so rows never wait on each other's slots.
"""

from __future__ import annotations

import numpy as np

from metrale_jax.errors import InvalidParameterError
from metrale_jax.vision.prompt import PromptImage


class ImagePool:
    """Which pool slot holds which row's images, and the free ones.

    slots: I, images held at once; tokens_per_image: T_img (features per image).
    """

    def __init__(self, slots: int, tokens_per_image: int):
        self.slots = slots
        self.tokens_per_image = tokens_per_image
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[int, dict[int, int]] = {}  # row -> {image offset: slot}

    @property
    def free_slots(self) -> int:
        """Slots no row holds."""
        return len(self._free)

    def missing(self, row: int, images: tuple[PromptImage, ...]) -> list[PromptImage]:
        """The images of `images` whose features row `row` does not hold yet."""
        held = self._held.get(row, {})
        return [im for im in images if im.offset not in held]

    def assign(self, row: int, image: PromptImage) -> int:
        """A free slot for row `row`'s `image`; `InvalidParameterError` when none is free
        (the batching loop checks `free_slots` first)."""
        if not self._free:
            raise InvalidParameterError(f"no free image slot ({self.slots} in all)",
                                        param="messages")
        slot = self._free.pop()
        self._held.setdefault(row, {})[image.offset] = slot
        return slot

    def release(self, row: int) -> None:
        """Row `row`'s slots are free again."""
        for slot in self._held.pop(row, {}).values():
            self._free.append(slot)

    def release_all(self) -> None:
        """Every slot is free."""
        for row in list(self._held):
            self.release(row)

    def rows_for(self, row: int, start: int, length: int,
                 images: tuple[PromptImage, ...]) -> np.ndarray:
        """`[length] int32`: for the row's prompt positions `start ..`, the pool row of each
        placeholder token's feature (slot * T_img + its index in its image), else -1."""
        T = self.tokens_per_image
        out = np.full(length, -1, np.int32)
        held = self._held.get(row, {})
        positions = np.arange(start, start + length)
        for im in images:
            inside = (positions >= im.offset) & (positions < im.offset + T)
            if inside.any():
                out[inside] = held[im.offset] * T + positions[inside] - im.offset
        return out


def remaining_images(images: tuple[PromptImage, ...], start: int,
                     tokens_per_image: int) -> tuple[PromptImage, ...]:
    """The images whose placeholder runs end after prompt position `start` (those a row fed
    from `start` on still reads)."""
    return tuple(im for im in images if im.offset + tokens_per_image > start)


def find_image_offsets(ids: list[int] | tuple[int, ...], image_token_id: int,
                       tokens_per_image: int) -> list[int]:
    """The start of each run of `tokens_per_image` placeholder tokens in `ids`;
    `InvalidParameterError` when a run has another length."""
    offsets, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] != image_token_id:
            i += 1
            continue
        j = i
        while j < n and ids[j] == image_token_id:
            j += 1
        run = j - i
        if run % tokens_per_image:
            raise InvalidParameterError(
                f"the prompt has a run of {run} image placeholder tokens at position {i}; "
                f"each image takes {tokens_per_image}", param="messages")
        offsets += range(i, j, tokens_per_image)
        i = j
    return offsets


__all__ = ["ImagePool", "find_image_offsets", "remaining_images"]
