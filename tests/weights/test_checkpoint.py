"""Loading checkpoints by name or path, the orbax round trip, and the errors for bad files."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from devtools.hf_models import build_tiny_checkpoint
from metrale_jax.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from metrale_jax.weights.checkpoint import load_checkpoint, resolve
from metrale_jax.weights.orbax_store import load_orbax, save_orbax


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _leaves_equal(a, b) -> None:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_hf_folder_loads_with_tokenizer_and_template(hf_folder):
    ckpt = load_checkpoint(hf_folder)
    assert ckpt.format == "hf" and ckpt.config.architecture == "qwen2"
    ids = ckpt.tokenizer.encode("quick brown fox", add_special_tokens=False)
    assert ckpt.tokenizer.decode(ids) == "quick brown fox"
    assert "assistant" in ckpt.chat_template


def test_orbax_round_trip_is_bit_identical(hf_folder, tmp_path):
    ckpt = load_checkpoint(hf_folder)
    save_orbax(ckpt, tmp_path / "native")
    back = load_orbax(tmp_path / "native")
    assert back.config == ckpt.config
    _leaves_equal(ckpt.params, back.params)
    text = "Metrale serves language models"
    assert back.tokenizer.encode(text) == ckpt.tokenizer.encode(text)
    assert back.chat_template == ckpt.chat_template
    assert resolve(tmp_path / "native")[1] == "orbax"


def test_orbax_bfloat16_round_trip(hf_folder, tmp_path):
    ckpt = load_checkpoint(hf_folder, "bfloat16")
    save_orbax(ckpt, tmp_path / "bf16")
    back = load_checkpoint(tmp_path / "bf16")
    assert back.dtype == "bfloat16"
    _leaves_equal(ckpt.params, back.params)


def test_orbax_refuses_existing_destination(hf_folder, tmp_path):
    ckpt = load_checkpoint(hf_folder)
    (tmp_path / "taken").mkdir()
    with pytest.raises(CheckpointError, match="already exists"):
        save_orbax(ckpt, tmp_path / "taken")


def test_unknown_path_is_model_not_found(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found"):
        resolve(tmp_path / "nope")


def test_folder_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        resolve(tmp_path)


def test_unknown_architecture(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="falcon"):
        load_checkpoint(folder)


def test_wrong_shape_names_the_tensor(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mlp\..*_proj\.weight.*shape"):
        load_checkpoint(folder)


def test_missing_shard(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors.*missing"):
        load_checkpoint(folder)


def test_truncated_safetensors(hf_folder, tmp_path):
    folder = _copy(hf_folder, tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(folder)


def test_missing_tensor(hf_folder, tmp_path):
    from safetensors.numpy import load_file, save_file
    folder = _copy(hf_folder, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_checkpoint(folder)
