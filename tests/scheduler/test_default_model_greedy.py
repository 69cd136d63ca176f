"""The default model through the whole stack: 48 greedy tokens equal transformers' generate.

Prompt lengths 1, 15, 16, 17 (around the smallest bucket) and one longer than the largest
prefill bucket (chunked prefill); transformers runs the same GGUF dequantized to float32.
"""

from __future__ import annotations

import pytest
import torch

from metrale_jax import SamplingParams

LENGTHS = (1, 15, 16, 17, 150)


pytestmark = pytest.mark.xdist_group("default-model")  # shares the session's default LLM


@pytest.fixture(scope="module")
def pair(default_llm, default_transformers):
    return default_llm, default_transformers


def _prompt(llm, n: int) -> list[int]:
    text = ("The history of the printing press begins in the fifteenth century, when "
            "Johannes Gutenberg combined movable metal type, oil-based ink and a screw press. ")
    ids = llm.tokenizer.encode(text * 8, add_special_tokens=False)
    assert len(ids) >= n
    return ids[:n]


def test_greedy_48_tokens_equal_transformers(pair):
    llm, ref = pair
    prompts = [_prompt(llm, n) for n in LENGTHS]
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    ours = llm.generate(prompts, params)  # all together: batching must not change tokens
    for ids, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            want = ref.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48,
                                do_sample=False, pad_token_id=2)[0, len(ids):].tolist()
        assert list(got.token_ids) == want, f"prompt of {len(ids)} tokens"


def test_chat_answers_in_words(pair):
    llm, _ = pair
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0))
    assert "Paris" in out.text
    assert out.finish_reason in ("stop", "length")


def test_default_model_json_schema_output_is_valid(pair):
    """The real model under a JSON schema: its answer parses and validates."""
    import json

    import jsonschema

    from metrale_jax.scheduler.constraints import Constraint
    llm, _ = pair
    schema = {"type": "object", "properties": {
        "city": {"type": "string"}, "country": {"type": "string"},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["city", "country", "population_millions"], "additionalProperties": False}
    params = SamplingParams(max_tokens=60, temperature=0,
                            constraint=Constraint.from_schema(schema, name="city"))
    out = llm.chat([{"role": "user", "content": "Describe Paris as JSON."}], params)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
