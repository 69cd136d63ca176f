"""A checkpoint's `generation_config.json` sampling fields become the server's request
defaults (as vLLM's `--generation-config auto`): a field the request leaves out takes the
model's value, a field it sets wins; a checkpoint without them changes nothing."""

from __future__ import annotations

import json

from devtools.hf_models import build_tiny_checkpoint
from metrale_jax.weights.checkpoint import load_checkpoint
from serving.http.protocol import ChatCompletionRequest, CompletionRequest

GENERATION = {"do_sample": True, "temperature": 0.25, "top_k": 7, "top_p": 0.8,
              "repetition_penalty": 1.1, "eos_token_id": [2], "max_length": 99}


def test_generation_config_sampling_fields_are_the_request_defaults(tmp_path):
    folder = build_tiny_checkpoint(tmp_path / "tiny")
    plain = load_checkpoint(folder).sampling_defaults
    assert plain == {}  # save_pretrained wrote token ids only
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    defaults = load_checkpoint(folder).sampling_defaults
    assert defaults == {"temperature": 0.25, "top_k": 7, "top_p": 0.8,
                        "repetition_penalty": 1.1}
    messages = [{"role": "user", "content": "hi"}]
    unset = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    params = unset.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == (
        0.25, 7, 0.8, 1.1)
    given = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "temperature": 0.9, "top_k": 3})
    params = given.sampling_params(None, None, defaults)
    assert (params.temperature, params.top_k, params.top_p) == (0.9, 3, 0.8)
    completion = CompletionRequest.model_validate({"model": "m", "prompt": "x"})
    assert completion.sampling_params(None, None, defaults).temperature == 0.25
    assert completion.sampling_params(None, None, plain).temperature == 1.0
