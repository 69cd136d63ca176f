"""The LLaVA vision encoder (CLIP or SigLIP tower and projector) against transformers.

Tiny random `LlavaForConditionalGeneration` models (devtools/llava_models.py), float32: our
`VisionEncoder`, loaded from the saved folder, must give `get_image_features`' output within
1e-4 relative, for CLIP with LLaVA-1.5's choices (layer -2, class token dropped), CLIP with
two feature layers, and SigLIP (LLaVA-Interleave's: the last layer, every position).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale_jax.errors import CheckpointError

CASES = {
    "clip": ("clip", "llama", None),
    "clip-two-layers": ("clip", "qwen2", {"vision_feature_layer": [-3, -1]}),
    "siglip": ("siglip", "qwen2", None),
}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(our vision graphdef and params, the model config, the transformers model)."""
    from devtools.llava_models import build_llava_folder
    tower, text, overrides = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"llava-{request.param}")
    hf = build_llava_folder(folder, tower, text, llava_overrides=overrides)
    return folder, hf


def _load(folder):
    import json

    from metrale_jax.weights.hf_config import llava_model_config
    from metrale_jax.weights.llava_reader import assemble_vision, split_tensors
    from metrale_jax.weights.safetensors_reader import read_safetensors
    cfg = llava_model_config(json.loads((folder / "config.json").read_text()), folder)
    _, vision = split_tensors(read_safetensors(folder))
    graphdef, params = assemble_vision(cfg.vision, vision, folder)
    return cfg, graphdef, params, vision


def test_image_features_match_transformers(pair):
    from metrale_jax.models.vision import encode_images
    folder, hf = pair
    cfg, graphdef, params, _ = _load(folder)
    v = cfg.vision
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((3, v.num_channels, v.image_size, v.image_size)
                                 ).astype(np.float32)
    ours = np.asarray(encode_images(graphdef, params, pixels))
    with torch.no_grad():
        out = hf.model.get_image_features(
            pixel_values=torch.from_numpy(pixels),
            vision_feature_layer=hf.config.vision_feature_layer,
            vision_feature_select_strategy=hf.config.vision_feature_select_strategy)
    ref = np.stack([t.numpy() for t in out.pooler_output])
    assert ours.shape == ref.shape == (3, v.tokens_per_image, cfg.hidden_size)
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= 1e-4, f"image features: max relative error {err:.2e}"


def test_config_and_token_count(pair):
    folder, hf = pair
    cfg, _, _, _ = _load(folder)
    v = cfg.vision
    assert v.image_token_id == hf.config.image_token_index
    assert cfg.hidden_size == hf.config.text_config.hidden_size
    assert v.tokens_per_image == 16  # 16 patches (CLIP drops its class token)
    assert v.feature_layers == tuple(np.atleast_1d(hf.config.vision_feature_layer).tolist())


def test_missing_or_misshapen_vision_tensor(pair):
    from metrale_jax.weights.llava_reader import assemble_vision
    folder, _ = pair
    cfg, _, _, vision = _load(folder)
    name = "vision.encoder.layers.1.mlp.fc1.weight"
    missing = {k: v for k, v in vision.items() if k != name}
    with pytest.raises(CheckpointError, match="fc1.weight.*missing"):
        assemble_vision(cfg.vision, missing, folder)
    bad = dict(vision)
    bad[name] = bad[name][:, :-1]
    with pytest.raises(CheckpointError, match="fc1.weight"):
        assemble_vision(cfg.vision, bad, folder)
