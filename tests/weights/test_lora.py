"""PEFT LoRA adapters read into per-layer arrays: the same update as PEFT's, and clear refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from devtools.hf_models import build_hf_model, save_tiny_tokenizer
from metrale_jax.weights.checkpoint import load_checkpoint
from metrale_jax.weights.lora import MODULES, LoraError, load_peft_adapter

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lora-base")
    model = build_hf_model("llama", folder)
    save_tiny_tokenizer(folder)
    return folder, model, load_checkpoint(folder).config


def make_adapter(model, folder, targets, r=8, alpha=16, seed=0, **extra):
    """A PEFT adapter with non-zero B (PEFT initialises B to zeros), saved to `folder`."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                        init_lora_weights=False, **extra)
    peft_model = get_peft_model(model, config).eval()
    peft_model.save_pretrained(folder)
    return peft_model


def _peft_delta(peft_model, layer: int, module: str, x: torch.Tensor) -> np.ndarray:
    block = peft_model.base_model.model.model.layers[layer]
    lin = getattr(block.self_attn if module in ATTN else block.mlp, module)
    with torch.no_grad():
        return (lin(x) - lin.base_layer(x)).numpy()


@pytest.mark.parametrize("targets, r, rslora", [(ATTN, 8, False), (MLP, 1, False),
                                                (ATTN + MLP, 16, True)])
def test_the_update_is_peft_s(base, tmp_path, targets, r, rslora):
    _folder, model, cfg = base
    peft_model = make_adapter(model, tmp_path, targets, r=r, alpha=2 * r + 3, use_rslora=rslora)
    try:
        adapter = load_peft_adapter(tmp_path, cfg, name="mine")
        assert adapter.name == "mine" and adapter.rank == r
        assert adapter.targets == tuple(m for m in MODULES if m in targets)
        expect = (2 * r + 3) / (np.sqrt(r) if rslora else r)
        assert adapter.scale == pytest.approx(expect)
        rng = np.random.default_rng(0)
        for module in adapter.targets:
            a, b = adapter.weights[module]
            assert a.shape[0] == b.shape[0] == cfg.num_layers
            for layer in range(cfg.num_layers):
                x = rng.standard_normal((5, a.shape[1])).astype(np.float32)
                ours = adapter.scale * (x @ a[layer] @ b[layer])
                theirs = _peft_delta(peft_model, layer, module, torch.from_numpy(x))
                assert np.abs(theirs).max() > 1e-3  # a real update, not PEFT's zero B
                # float32 rounding of sums of terms up to |theirs|: relative to the largest
                np.testing.assert_allclose(ours, theirs, rtol=1e-4,
                                           atol=1e-5 * np.abs(theirs).max())
    finally:
        peft_model.unload()


def _edit_config(folder, **fields):
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    config.update(fields)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("fields, needle", [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "biases"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"r": 0}, "positive integer"),
    ({"peft_type": "IA3"}, "only LoRA"),
])
def test_what_cannot_be_served_is_refused_by_name(base, tmp_path, fields, needle):
    _folder, model, cfg = base
    make_adapter(model, tmp_path, ATTN).unload()
    _edit_config(tmp_path, **fields)
    with pytest.raises(LoraError, match=needle):
        load_peft_adapter(tmp_path, cfg)


def test_an_adapter_for_another_model_names_the_module(base, tmp_path):
    _folder, _, cfg = base
    other = build_hf_model("llama", tmp_path / "other", overrides={"intermediate_size": 96})
    make_adapter(other, tmp_path / "adapter", MLP).unload()
    with pytest.raises(LoraError, match="gate_proj of layer 0.*another model"):
        load_peft_adapter(tmp_path / "adapter", cfg)


def test_missing_files_rank_limit_and_foreign_modules(base, tmp_path):
    folder, model, cfg = base
    with pytest.raises(LoraError, match="no adapter folder"):
        load_peft_adapter(tmp_path / "nowhere", cfg)
    with pytest.raises(LoraError, match="no adapter_config.json"):
        load_peft_adapter(folder, cfg)  # a model folder, not an adapter
    make_adapter(model, tmp_path / "big", ATTN, r=16).unload()
    with pytest.raises(LoraError, match="rank 16 exceeds .* 8"):
        load_peft_adapter(tmp_path / "big", cfg, max_rank=8)
    make_adapter(model, tmp_path / "embed", ["q_proj", "embed_tokens"]).unload()
    with pytest.raises(LoraError, match="embed_tokens"):
        load_peft_adapter(tmp_path / "embed", cfg)
    (tmp_path / "big" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoraError, match="cannot be read"):
        load_peft_adapter(tmp_path / "big", cfg)


def test_metrale_models_lists_an_adapter_folder(base, tmp_path):
    from metrale_jax.weights.catalog import list_checkpoints
    _, model, _ = base
    make_adapter(model, tmp_path / "sql", ATTN, r=4).unload()
    (info,) = list_checkpoints(tmp_path)
    assert info.format == "lora" and info.error is None
    assert info.architecture.startswith("lora r=4 of")
    L, E, H, K, D = 3, 64, 4, 2, 16  # devtools/hf_models.py's tiny shapes
    assert info.num_params == L * 4 * (E + H * D + E + K * D + E + K * D + H * D + E)
    assert info.dtype == "F32" and info.size_bytes > 0
