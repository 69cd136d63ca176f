"""Chat messages with image parts -> template messages and placeholder runs."""

from __future__ import annotations

import pytest

from metrale_jax.errors import InvalidParameterError
from metrale_jax.families.llava import VisionConfig
from metrale_jax.vision.prompt import expand_placeholders, split_image_parts

VISION = VisionConfig(tower="clip", hidden_size=32, intermediate_size=64, num_layers=2,
                      num_heads=4, image_size=28, patch_size=7, text_hidden_size=64,
                      image_token_id=9)


def test_image_parts_become_template_parts_in_order():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
            {"type": "text", "text": "and"},
            {"type": "input_image", "image_url": "https://example.org/cat.png"}]}]
    out, refs = split_image_parts(messages)
    assert out[0] == messages[0]  # strings stay strings by default
    assert out[1]["content"] == [{"type": "image"}, {"type": "text", "text": "and"},
                                 {"type": "image"}]
    assert [(r.param, r.url) for r in refs] == [
        ("messages[1].content[0]", "data:image/png;base64,AAAA"),
        ("messages[1].content[2]", "https://example.org/cat.png")]
    wrapped, _ = split_image_parts(messages, text_parts=True)
    # a vision model's template (llava-hf's) reads only parts: a string would be dropped
    assert wrapped[0]["content"] == [{"type": "text", "text": "Be brief."}]


def test_a_malformed_image_part_is_named():
    with pytest.raises(InvalidParameterError, match=r"messages\[0\].content\[1\]"):
        split_image_parts([{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {}}]}])


def test_placeholders_expand_to_runs_and_must_match_the_images():
    T = VISION.tokens_per_image
    ids, offsets = expand_placeholders([1, 9, 2, 9, 3], VISION, 2)
    assert ids == [1] + [9] * T + [2] + [9] * T + [3]
    assert offsets == [1, 2 + T]
    with pytest.raises(InvalidParameterError, match="2 image placeholders for 1 images"):
        expand_placeholders([1, 9, 2, 9, 3], VISION, 1)
