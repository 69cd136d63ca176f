"""Tests of `metrale_jax.weights.gguf_reader.read_gguf`.

Three kinds of evidence:
- the default model (a real llama.cpp file) read by us equals transformers' own GGUF loading;
- tiny GGUFs written here the way llama.cpp's converter writes them (its tensor names from
  `gguf.get_tensor_name_map`, its Q/K row permutation, Gemma's `norm + 1`) in every supported
  tensor type come back as the HF tensors and config they were made from;
- broken files raise `CheckpointError` naming the file.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES

from metrale_jax.config import ModelConfig, RopeScaling
from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.weights.gguf_names import config_from_metadata
from metrale_jax.weights.gguf_reader import read_gguf, unpermute_rows

ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1,
             Q.Q4_K, Q.Q5_K, Q.Q6_K]
# gguf-py has no quantizer for the K types: we write random valid blocks instead.
K_TYPES = {Q.Q4_K, Q.Q5_K, Q.Q6_K}
# Max |dequantized - original| as a fraction of max |original|, for types gguf-py quantizes.
# (Q4_0 and Q5_0 clip the block's extreme value by one step: 1/8 and 1/16 of it.)
TOLERANCE = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 0.01, Q.Q5_0: 0.07,
             Q.Q5_1: 0.035, Q.Q4_0: 0.13, Q.Q4_1: 0.07}
ARCH_ENUM = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma": gguf.MODEL_ARCH.GEMMA,
             "gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
             "phi3": gguf.MODEL_ARCH.PHI3}


# ----------------------------------------------------------------------------------------------
# Writing tiny GGUFs the way llama.cpp's convert_hf_to_gguf.py does.

@dataclasses.dataclass(frozen=True)
class Spec:
    """A tiny model; row lengths are multiples of 256 so every type (K quants too) applies."""

    arch: str
    L: int = 2
    E: int = 256
    F: int = 512
    H: int = 4
    K: int = 2
    D: int = 64
    V: int = 96
    tied: bool = True
    bias: bool = False

    @property
    def gemma(self) -> bool:
        return self.arch in ("gemma", "gemma2", "gemma3")


SPECS = {
    "llama": Spec("llama", tied=False),
    "llama_bias": Spec("llama", bias=True),  # q/k biases are permuted too
    "qwen2": Spec("qwen2", bias=True),
    "qwen3": Spec("qwen3", H=8, K=2, D=64),  # H*D = 512 != E
    "gemma": Spec("gemma", H=2, K=1, D=256),  # Gemma 2B-like: MQA, H*D != E
    "gemma2": Spec("gemma2", L=3, H=4, K=2, D=128),
    "gemma3": Spec("gemma3", L=6, H=4, K=1, D=256),  # 270M-like: MQA, D 256, 5 local : 1
    "phi3": Spec("phi3", tied=False),  # fused attn_qkv and ffn_up (gate, then up)
}


def hf_shapes(s: Spec) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of the tiny model."""
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (s.V, s.E),
                                          "model.norm.weight": (s.E,)}
    if not s.tied:
        shapes["lm_head.weight"] = (s.V, s.E)
    for i in range(s.L):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (s.E,),
                   p + "post_attention_layernorm.weight": (s.E,),
                   p + "self_attn.q_proj.weight": (s.H * s.D, s.E),
                   p + "self_attn.k_proj.weight": (s.K * s.D, s.E),
                   p + "self_attn.v_proj.weight": (s.K * s.D, s.E),
                   p + "self_attn.o_proj.weight": (s.E, s.H * s.D),
                   p + "mlp.gate_proj.weight": (s.F, s.E),
                   p + "mlp.up_proj.weight": (s.F, s.E),
                   p + "mlp.down_proj.weight": (s.E, s.F)}
        if s.arch == "phi3":  # HF's fused tensors, as llama.cpp keeps them
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                         "mlp.gate_proj", "mlp.up_proj"):
                del shapes[p + name + ".weight"]
            shapes |= {p + "self_attn.qkv_proj.weight": ((s.H + 2 * s.K) * s.D, s.E),
                       p + "mlp.gate_up_proj.weight": (2 * s.F, s.E)}
        if s.bias:
            shapes |= {p + "self_attn.q_proj.bias": (s.H * s.D,),
                       p + "self_attn.k_proj.bias": (s.K * s.D,),
                       p + "self_attn.v_proj.bias": (s.K * s.D,)}
        if s.arch in ("qwen3", "gemma3"):
            shapes |= {p + "self_attn.q_norm.weight": (s.D,), p + "self_attn.k_norm.weight": (s.D,)}
        if s.arch in ("gemma2", "gemma3"):
            shapes |= {p + "pre_feedforward_layernorm.weight": (s.E,),
                       p + "post_feedforward_layernorm.weight": (s.E,)}
    return shapes


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def random_kquant(rows: int, cols: int, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """`[rows, bytes]` of random K-quant blocks with small finite f16 super-block scales."""
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for off in ([size - 2] if qtype == Q.Q6_K else [0, 2]):  # d (and dmin) fields
        scale = rng.uniform(1e-3, 1e-2, size=(rows, cols // block)).astype(np.float16)
        b[..., off:off + 2] = scale.view(np.uint8).reshape(rows, cols // block, 2)
    return b.reshape(rows, -1)


def encode(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(payload in HF row order, its exact float32 value). Quantization acts within rows, so
    permuting the payload's rows commutes with dequantizing it."""
    if qtype == Q.F32:
        return w, w
    if qtype == Q.F16:
        h = w.astype(np.float16)
        return h, h.astype(np.float32)
    if qtype not in ALL_TYPES:  # a type the reader must refuse: zero bytes will do
        block, size = GGML_QUANT_SIZES[qtype]
        return np.zeros((w.shape[0], w.shape[1] // block * size), np.uint8), w
    payload = (random_kquant(*w.shape, qtype, rng) if qtype in K_TYPES
               else gguf.quants.quantize(w, qtype))
    return payload, gguf.quants.dequantize(payload, qtype).reshape(w.shape)


def gguf_name(hf: str, s: Spec) -> str:
    """llama.cpp's name for HF parameter `hf`, from gguf-py's own mapping table."""
    base, suffix = hf.rsplit(".", 1)
    name = gguf.get_tensor_name_map(ARCH_ENUM[s.arch], s.L).get_name(base)
    assert name is not None, hf
    return f"{name}.{suffix}"


def build(s: Spec, types: dict[str, Q] | Q | None = None, seed: int = 0,
          ) -> tuple[dict[str, np.ndarray], dict[str, Q]]:
    """Random HF tensors: (original float32, type per tensor).

    1-D tensors are F32 (as llama.cpp keeps them); 2-D ones take `types` (one type for all, a
    dict, or None: cycle through ALL_TYPES)."""
    rng = np.random.default_rng(seed)
    original, chosen = {}, {}
    for n, (name, shape) in enumerate(hf_shapes(s).items()):
        w = rng.standard_normal(shape).astype(np.float32) * 0.1
        if len(shape) == 1 and "norm" in name and not s.gemma:
            w += 1.0
        qtype = Q.F32
        if len(shape) == 2:
            if isinstance(types, dict):
                qtype = types.get(name, Q.F32)
            else:
                qtype = ALL_TYPES[n % len(ALL_TYPES)] if types is None else types
        chosen[name] = qtype
        original[name] = w
    return original, chosen


def write_gguf(path: Path, s: Spec, original: dict[str, np.ndarray], chosen: dict[str, Q],
               *, seed: int = 0, meta: dict | None = None, skip: tuple[str, ...] = (),
               extra: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Writes the model as llama.cpp would; returns the exact HF values a reader must return.

    `meta` overrides metadata (None deletes a key), `skip` leaves tensors out, `extra` adds
    F32 tensors under GGUF names."""
    rng = np.random.default_rng(seed + 1)
    a = s.arch
    kv: dict[str, object] = {
        f"{a}.block_count": s.L, f"{a}.context_length": 4096, f"{a}.embedding_length": s.E,
        f"{a}.feed_forward_length": s.F, f"{a}.attention.head_count": s.H,
        f"{a}.attention.head_count_kv": s.K,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6 if s.gemma else 1e-5,
    }
    if a == "llama":
        kv |= {f"{a}.rope.freq_base": 500000.0, f"{a}.rope.dimension_count": s.D,
               f"{a}.vocab_size": s.V}
    if a in ("qwen2", "qwen3"):
        kv |= {f"{a}.rope.freq_base": 1000000.0}
    if a in ("qwen3", "gemma", "gemma2", "gemma3"):
        kv |= {f"{a}.attention.key_length": s.D, f"{a}.attention.value_length": s.D}
    if a == "gemma2":
        kv |= {f"{a}.attn_logit_softcapping": 50.0, f"{a}.final_logit_softcapping": 30.0,
               f"{a}.attention.sliding_window": 4096}
    if a == "gemma3":
        kv |= {f"{a}.rope.freq_base": 1000000.0, f"{a}.attention.sliding_window": 512}
    kv |= {"tokenizer.ggml.model": "gpt2",
           "tokenizer.ggml.tokens": [f"tok{i}" for i in range(s.V)],
           "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    kv |= meta or {}

    w = gguf.GGUFWriter(str(path), a if (meta or {}).get("general.architecture") is None
                        else str(meta["general.architecture"]))
    for key, value in kv.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)

    exact: dict[str, np.ndarray] = {}
    for name, value in original.items():
        payload, exact[name] = encode(value, chosen[name], rng)
        if name in skip:
            continue
        if a == "llama" and ".q_proj." in name:
            payload = llamacpp_permute(payload, s.H)
        elif a == "llama" and ".k_proj." in name:
            payload = llamacpp_permute(payload, s.K)
        if s.gemma and name.endswith("norm.weight"):
            payload = payload + np.float32(1.0)
        if payload.dtype == np.uint8:
            w.add_tensor(gguf_name(name, s), payload, raw_dtype=chosen[name])
        else:
            w.add_tensor(gguf_name(name, s), payload)
    for name, value in (extra or {}).items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return exact


def expected_config(s: Spec) -> ModelConfig:
    """The config a reader must build for `write_gguf(spec)`, written out by hand."""
    gemma = s.gemma
    return ModelConfig(
        architecture=s.arch, vocab_size=s.V, hidden_size=s.E, intermediate_size=s.F,
        num_layers=s.L, num_heads=s.H, num_kv_heads=s.K, head_dim=s.D,
        rms_norm_eps=1e-6 if gemma else 1e-5,
        rope_theta={"llama": 500000.0, "qwen2": 1e6, "qwen3": 1e6, "gemma3": 1e6}.get(
            s.arch, 10000.0),
        rope_local_theta=10000.0 if s.arch == "gemma3" else None,
        max_position_embeddings=4096, tie_word_embeddings=s.tied,
        hidden_act="gelu_tanh" if gemma else "silu", attention_bias=s.bias,
        qk_norm=s.arch in ("qwen3", "gemma3"), norm_weight_offset=gemma, embed_scale=gemma,
        post_norms=s.arch in ("gemma2", "gemma3"),
        attn_logit_softcap=50.0 if s.arch == "gemma2" else None,
        final_logit_softcap=30.0 if s.arch == "gemma2" else None,
        sliding_window={"gemma2": 4096, "gemma3": 512}.get(s.arch),
        sliding_layers=(tuple(i % 2 == 0 for i in range(s.L)) if s.arch == "gemma2" else
                        tuple((i + 1) % 6 != 0 for i in range(s.L)) if s.arch == "gemma3"
                        else ()),
        query_pre_attn_scalar=float(s.D) if s.arch in ("gemma2", "gemma3") else None,
        bos_token_id=1, eos_token_ids=(2,))


def make(tmp_path: Path, key: str = "llama", types: dict[str, Q] | Q | None = None,
         name: str = "tiny.gguf", **kw) -> tuple[Path, Spec, dict, dict, dict]:
    s = SPECS[key]
    original, chosen = build(s, types)
    path = tmp_path / name
    exact = write_gguf(path, s, original, chosen, **kw)
    return path, s, original, exact, chosen


def assert_tensors(got: dict[str, np.ndarray], exact: dict[str, np.ndarray], s: Spec) -> None:
    assert set(got) == set(exact)
    for name, want in exact.items():
        assert got[name].dtype == np.float32, name
        assert got[name].shape == want.shape, name
        if s.gemma and name.endswith("norm.weight"):  # (w + 1) - 1 in float32
            np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_array_equal(got[name], want, err_msg=name)


# ----------------------------------------------------------------------------------------------
# The default model against transformers' GGUF loader.

@pytest.fixture(scope="module")
def default_both(default_gguf_path, default_transformers):
    """(ours, transformers' config dict, transformers' tensors) for the default model:
    transformers' tensors are those of the "default-model" group's shared model
    (`default_transformers`, loaded from the GGUF once per run), without the tied head."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = read_gguf(default_gguf_path)
    hf_config = load_gguf_checkpoint(str(default_gguf_path))["config"]
    model = default_transformers
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return ours, hf_config, {k: v.numpy() for k, v in model.state_dict().items()
                             if k != "lm_head.weight"}


# With the tests that share `default_transformers` (tests/conftest.py), on one worker.
@pytest.mark.xdist_group("default-model")
@pytest.mark.default_model
def test_default_model_tensors_equal_transformers(default_both, default_gguf_path):
    (_, ours, _), _, theirs = default_both
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(default_gguf_path).tensors}
    assert set(ours) == set(theirs)
    assert "lm_head.weight" not in ours
    assert ours["model.embed_tokens.weight"].shape == (49152, 576)
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)
    f32 = 0
    for name, want in theirs.items():
        assert ours[name].dtype == np.float32 and ours[name].shape == want.shape, name
        # Same gguf kernels on the same bytes (ours in row chunks, then un-permuted): equal
        # bit for bit, the F32 norms and the Q4_1/Q8_0 matrices alike.
        f32 += name.endswith("norm.weight")
        np.testing.assert_array_equal(ours[name], want, err_msg=name)
    assert f32 == 61 == sum(t == Q.F32 for t in types.values())


@pytest.mark.xdist_group("default-model")
@pytest.mark.default_model
def test_default_model_config_equals_transformers(default_both):
    (cfg, _, meta), hf, _ = default_both
    assert cfg.architecture == "llama"
    assert cfg.vocab_size == hf["vocab_size"] == 49152
    assert cfg.num_layers == hf["num_hidden_layers"] == 30
    assert cfg.hidden_size == hf["hidden_size"] == 576
    assert cfg.intermediate_size == hf["intermediate_size"]
    assert cfg.num_heads == hf["num_attention_heads"] == 9
    assert cfg.num_kv_heads == hf["num_key_value_heads"] == 3
    assert cfg.head_dim == hf["head_dim"] == 64
    assert math.isclose(cfg.rms_norm_eps, hf["rms_norm_eps"], rel_tol=1e-6)
    assert cfg.rms_norm_eps == 1e-5  # float32 1e-5 read as the decimal HF's config.json has
    assert cfg.rope_theta == hf["rope_theta"] == 100000.0
    assert cfg.tie_word_embeddings is hf["tie_word_embeddings"] is True
    assert cfg.max_position_embeddings == hf["max_position_embeddings"]
    assert cfg.bos_token_id == hf["bos_token_id"] and cfg.eos_token_ids == (hf["eos_token_id"],)
    assert cfg.rope_scaling is None and not cfg.attention_bias
    # Metadata: every key-value field, as plain values the tokenizer layer can use.
    assert len(meta) == 33
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert type(meta["tokenizer.ggml.token_type"][0]) is int
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert "{% for message in messages %}" in meta["tokenizer.chat_template"]


# ----------------------------------------------------------------------------------------------
# Round trips through tiny files.

@pytest.mark.parametrize("key", list(SPECS))
def test_round_trip_each_architecture(tmp_path, key):
    path, s, _, exact, chosen = make(tmp_path, key)
    assert len(set(chosen.values())) >= 8  # the cycle covers most types in every arch
    cfg, got, meta = read_gguf(path)
    assert cfg == expected_config(s)
    assert_tensors(got, exact, s)
    assert meta["general.architecture"] == s.arch
    assert meta["tokenizer.ggml.tokens"] == [f"tok{i}" for i in range(s.V)]
    assert meta[f"{s.arch}.block_count"] == s.L


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_round_trip_each_type(tmp_path, qtype):
    """Every 2-D tensor in one type, through the llama permutation."""
    path, s, original, exact, _ = make(tmp_path, "llama", types=qtype)
    _, got, _ = read_gguf(path)
    assert_tensors(got, exact, s)
    if qtype in TOLERANCE:  # and the values are the originals up to quantization error
        for name, w in original.items():
            err = np.abs(got[name] - w).max()
            assert err <= TOLERANCE[qtype] * np.abs(w).max(), (name, err)
    else:
        assert qtype in K_TYPES  # written as random blocks: only the exact check applies


def test_unpermute_inverts_llamacpp_permute():
    rng = np.random.default_rng(3)
    for n_head, d in [(1, 4), (3, 64), (9, 64), (8, 128)]:
        w = rng.standard_normal((n_head * d, 5)).astype(np.float32)
        assert not np.array_equal(llamacpp_permute(w, n_head), w)
        np.testing.assert_array_equal(unpermute_rows(llamacpp_permute(w, n_head), n_head), w)
        b = w[:, 0].copy()
        np.testing.assert_array_equal(unpermute_rows(llamacpp_permute(b, n_head), n_head), b)


def converter_rope_freqs(theta: float, dim: int, factor: float, low: float, high: float,
                         old_len: int = 8192) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type llama3."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl, high_wl = old_len / low, old_len / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / float(freq)
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(("factor", "low", "high"), [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0),
                                                      (16.0, 2.0, 8.0)])
def test_llama3_rope_freqs_become_rope_scaling(tmp_path, factor, low, high):
    table = converter_rope_freqs(500000.0, 64, factor, low, high)
    assert len(np.unique(table)) > 1 and table.max() == factor
    path, *_ = make(tmp_path, types=Q.F16, extra={"rope_freqs.weight": table})
    cfg, got, _ = read_gguf(path)
    assert cfg.rope_scaling == RopeScaling("llama3", factor=factor, low_freq_factor=low,
                                           high_freq_factor=high,
                                           original_max_position_embeddings=8192)
    assert not any("rope" in n for n in got)


def test_custom_rope_freqs_are_refused(tmp_path):
    table = np.linspace(1.0, 3.0, 32, dtype=np.float32)[::-1].copy()
    path, *_ = make(tmp_path, types=Q.F16, extra={"rope_freqs.weight": table})
    with pytest.raises(UnsupportedModelError, match="rope_freqs") as e:
        read_gguf(path)
    assert str(path) in str(e.value)


def test_linear_rope_scaling(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16, meta={"llama.rope.scaling.type": "linear",
                                                 "llama.rope.scaling.factor": 2.0})
    assert read_gguf(path)[0].rope_scaling == RopeScaling("linear", factor=2.0)


def test_yarn_rope_scaling_and_unknown_types(tmp_path):
    """YaRN from metadata, its attention factor as llama.cpp computes it (attn_factor times
    0.1 ln(factor) + 1); a type we do not implement is refused by name."""
    path, *_ = make(tmp_path, types=Q.F16, meta={
        "llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 1024,
        "llama.rope.scaling.yarn_beta_fast": 16.0})
    assert read_gguf(path)[0].rope_scaling == RopeScaling(
        "yarn", factor=4.0, original_max_position_embeddings=1024, beta_fast=16.0,
        attention_factor=0.1 * math.log(4.0) + 1.0)
    path, *_ = make(tmp_path, types=Q.F16, name="odd.gguf",
                    meta={"llama.rope.scaling.type": "xpos"})
    with pytest.raises(UnsupportedModelError, match="RoPE scaling type 'xpos'"):
        read_gguf(path)


def test_vocab_size_from_token_list_and_progress(tmp_path):
    path, s, *_ = make(tmp_path, types=Q.F16, meta={"llama.vocab_size": None})
    calls = []
    cfg, got, _ = read_gguf(path, progress=lambda done, total: calls.append((done, total)))
    assert cfg.vocab_size == s.V
    assert calls[-1] == (len(got), len(got)) and len(calls) == len(got)


@pytest.mark.parametrize(("layers", "qpas"), [(42, 256.0), (46, 144.0)])
def test_gemma2_query_scale_follows_llamacpp(layers, qpas):
    """llama.cpp scales by head_dim (256) except for the 46-layer 27B: hidden/heads = 144."""
    meta = {"general.architecture": "gemma2", "gemma2.block_count": layers,
            "gemma2.embedding_length": 4608, "gemma2.feed_forward_length": 36864,
            "gemma2.attention.head_count": 32, "gemma2.attention.head_count_kv": 16,
            "gemma2.attention.key_length": 128 if layers == 46 else 256,
            "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.eot_token_id": 107}
    shapes = {"token_embd.weight": (256000, 4608)}
    cfg = config_from_metadata(meta, shapes, Path("x.gguf"))
    assert cfg.query_pre_attn_scalar == qpas
    assert cfg.eos_token_ids == (1, 107) and cfg.vocab_size == 256000
    assert cfg.sliding_window == 4096 and cfg.layer_is_sliding[:3] == (True, False, True)


# ----------------------------------------------------------------------------------------------
# Bad files.

def raises_naming(path: Path, exc: type[Exception] = CheckpointError, match: str = ""):
    with pytest.raises(exc, match=match) as e:
        read_gguf(path)
    assert str(path) in str(e.value), str(e.value)
    return str(e.value)


def test_missing_file(tmp_path):
    raises_naming(tmp_path / "nope.gguf", match="no such file")


def test_bad_magic_and_empty_file(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + path.read_bytes()[4:])
    raises_naming(bad, match="not a GGUF")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    raises_naming(empty, match="not a GGUF")


@pytest.mark.parametrize("cut", ["half", "header", "last_byte"])
def test_truncated_file(tmp_path, cut):
    path, *_ = make(tmp_path, types=Q.Q8_0)
    data = path.read_bytes()
    last = max(t.data_offset + t.n_bytes for t in gguf.GGUFReader(path).tensors)
    size = {"half": len(data) // 2, "header": 200, "last_byte": last - 1}[cut]
    short = tmp_path / f"short_{cut}.gguf"
    short.write_bytes(data[:size])
    raises_naming(short, match="truncated")


@pytest.mark.default_model
def test_truncated_default_model(tmp_path, default_gguf_path):
    short = tmp_path / "smol_cut.gguf"
    with default_gguf_path.open("rb") as f:
        short.write_bytes(f.read(1 << 20))  # ends inside the vocabulary
    raises_naming(short, match="truncated")
    big = tmp_path / "smol_half.gguf"
    shutil.copyfile(default_gguf_path, big)
    with big.open("r+b") as f:
        f.truncate(default_gguf_path.stat().st_size // 2)
    raises_naming(big, match="truncated")


def test_unknown_architecture(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16, meta={"general.architecture": "mamba"})
    msg = raises_naming(path, UnsupportedModelError, match="architecture 'mamba'")
    assert "llama" in msg  # says what is supported


def test_wrong_shape(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16, meta={"llama.attention.head_count": 8})
    raises_naming(path, match=r"blk\.0\.attn_q\.weight.*shape")


def test_missing_tensor(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16, skip=("model.layers.1.mlp.up_proj.weight",))
    raises_naming(path, match="model.layers.1.mlp.up_proj.weight")


def test_missing_metadata(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16, meta={"llama.block_count": None})
    raises_naming(path, match="llama.block_count")


def test_unsupported_tensor_type(tmp_path):
    name = "model.layers.0.mlp.gate_proj.weight"
    path, *_ = make(tmp_path, types={name: Q.Q2_K})  # Q2_K: dequantizable by gguf, not by us
    msg = raises_naming(path, UnsupportedModelError, match="Q2_K")
    assert "blk.0.ffn_gate.weight" in msg


def test_unknown_tensor(tmp_path):
    path, *_ = make(tmp_path, types=Q.F16,
                    extra={"blk.0.ffn_gate_exps.weight": np.zeros((2, 4), np.float32)})
    raises_naming(path, UnsupportedModelError, match="mixture-of-experts")
    path2, *_ = make(tmp_path, types=Q.F16, name="extra.gguf",
                     extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    raises_naming(path2, UnsupportedModelError, match="blk.0.mystery.weight")
