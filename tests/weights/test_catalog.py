"""`metrale_jax.weights.catalog`: checkpoints described from their headers, checked against
the readers that load them (gguf's own GGUFReader, the loaded params)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from metrale_jax.weights.catalog import describe, list_checkpoints


def write_small_gguf(path: Path) -> None:
    """A GGUF with every kind of metadata value the header parser must skip, a Q8_0, an F16
    and an F32 tensor, and a rope_freqs buffer (not a parameter)."""
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_string("general.name", "small")
    w.add_uint32("qwen2.block_count", 2)
    w.add_float32("qwen2.rope.freq_base", 1e6)
    w.add_bool("flag", True)
    w.add_uint64("big", 1 << 40)
    w.add_float64("precise", 0.5)
    w.add_array("tokenizer.ggml.tokens", [f"tök{i}" for i in range(300)])
    w.add_array("tokenizer.ggml.scores", [float(i) for i in range(300)])
    w.add_array("tokenizer.ggml.token_type", [1] * 300)
    w.add_array("empty", [])
    rng = np.random.default_rng(0)
    q8 = gguf.quants.quantize(rng.standard_normal((64, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("token_embd.weight", rng.standard_normal((300, 64)).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.add_tensor("rope_freqs.weight", np.ones(16, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_header_agrees_with_gguf_reader(tmp_path):
    path = tmp_path / "small.gguf"
    write_small_gguf(path)
    info = describe(path)
    reader = gguf.GGUFReader(path)
    expected = sum(int(t.n_elements) for t in reader.tensors if t.name != "rope_freqs.weight")
    assert (info.format, info.architecture, info.error) == ("gguf", "qwen2", None)
    assert info.num_params == expected == 64 * 64 + 300 * 64 + 64
    assert info.dtype == "F16"  # the type holding most parameters
    assert info.size_bytes == path.stat().st_size


def test_default_model(default_gguf):
    info = describe(default_gguf)
    reader = gguf.GGUFReader(default_gguf)
    assert info.default and info.architecture == "llama" and info.dtype == "Q4_1"
    assert info.num_params == sum(int(t.n_elements) for t in reader.tensors
                                  if t.name != "rope_freqs.weight")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> Path:
    from devtools.hf_models import build_tiny_checkpoint
    return build_tiny_checkpoint(tmp_path_factory.mktemp("catalog") / "tiny-llama")


def test_hf_and_orbax_counts_equal_the_loaded_params(tiny_hf, tmp_path):
    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import save_orbax
    ckpt = load_checkpoint(tiny_hf)
    hf = describe(tiny_hf)
    assert (hf.format, hf.architecture, hf.dtype, hf.error) == ("hf", "llama", "F32", None)
    assert hf.num_params == ckpt.num_params
    native = save_orbax(ckpt, tmp_path / "native")
    orbax = describe(native)
    assert (orbax.format, orbax.architecture, orbax.dtype) == ("orbax", "llama", "float32")
    assert orbax.num_params == ckpt.num_params
    assert orbax.size_bytes == sum(p.stat().st_size for p in native.rglob("*") if p.is_file())


def test_a_quantized_orbax_checkpoint_counts_its_float_params(tiny_hf, tmp_path):
    """An int4 checkpoint stores packed codes and block scales: the listing still counts the
    model's parameters, and its dtype names the quantization."""
    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import save_orbax
    float_params = load_checkpoint(tiny_hf).num_params
    info = describe(save_orbax(load_checkpoint(tiny_hf, quantization="int4"), tmp_path / "q4"))
    assert (info.format, info.dtype, info.num_params) == ("orbax", "float32, int4", float_params)


def test_listing_keeps_going_past_bad_entries(tmp_path):
    write_small_gguf(tmp_path / "good.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "README.md").write_text("ignored")
    (tmp_path / "half.partial").write_bytes(b"ignored")
    (tmp_path / "broken-hf").mkdir()
    (tmp_path / "broken-hf" / "config.json").write_text("{not json")
    infos = {i.name: i for i in list_checkpoints(tmp_path)}
    assert sorted(infos) == ["bad.gguf", "broken-hf", "good.gguf", "notes.txt"]
    assert infos["good.gguf"].error is None
    assert infos["bad.gguf"].format == "gguf" and infos["bad.gguf"].error.startswith(
        "cannot read")
    assert infos["broken-hf"].format == "hf" and infos["broken-hf"].error
    assert infos["notes.txt"].format is None and "not a .gguf file" in infos["notes.txt"].error
    assert list_checkpoints(tmp_path / "missing") == []
    assert infos["good.gguf"].num_params == 64 * 64 + 300 * 64 + 64


def _cache_repo(cache: Path, repo: str, files: dict[str, Path], commit: str) -> None:
    """Lays `files` (name -> source file) out as huggingface_hub's cache does: content in
    `blobs/`, `snapshots/COMMIT/NAME` linking to it, `refs/main` naming the commit."""
    import hashlib
    import os
    root = cache / ("models--" + repo.replace("/", "--"))
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        data = src.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(os.path.relpath(blob, snap))


def test_hub_cache_models_are_listed_with_why_one_would_not_load(tmp_path):
    import json

    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax.weights.catalog import list_hub_cache
    tiny = build_tiny_checkpoint(tmp_path / "tiny")
    cache = tmp_path / "hub"
    files = {p.name: p for p in tiny.iterdir() if p.is_file()}
    _cache_repo(cache, "org/tiny-llama", files, "a" * 40)
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert"}))
    _cache_repo(cache, "org/a-bert", {"config.json": bert / "config.json",
                                      "model.safetensors": tiny / "model.safetensors"},
                "b" * 40)
    infos = {i.name: i for i in list_hub_cache(cache)}
    assert set(infos) == {"org/tiny-llama", "org/a-bert"}
    llama = infos["org/tiny-llama"]
    assert (llama.format, llama.architecture, llama.error) == ("hf", "llama", None)
    assert llama.num_params and llama.size_bytes > 0
    assert infos["org/a-bert"].error == "not served: architecture 'bert'"
    assert list_hub_cache(tmp_path / "no-cache") == []
