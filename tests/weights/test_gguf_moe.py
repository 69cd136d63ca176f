"""Mixture-of-experts GGUF files as llama.cpp writes them (`qwen3moe`; Mixtral as `llama`
with `llama.expert_count`, Q and K permuted): written with the `gguf` package from a tiny
transformers model, read back to the same config and the same logits as its HF folder."""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from devtools.hf_models import build_hf_model
from devtools.logits import stacked_logits
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.gguf_reader import read_gguf
from metrale_jax.weights.hf_config import read_hf_config
from metrale_jax.weights.safetensors_reader import read_safetensors
from tests.weights.test_gguf_reader import llamacpp_permute

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "mixtral": "llama"}
LAYER = {"input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight",
         "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight",
         "self_attn.o_proj.weight": "attn_output.weight",
         "self_attn.q_norm.weight": "attn_q_norm.weight",
         "self_attn.k_norm.weight": "attn_k_norm.weight"}
ROUTER = {"qwen3_moe": "mlp.gate.weight", "mixtral": "block_sparse_moe.gate.weight"}
EXPERTS = {"qwen3_moe": ("mlp.experts.{j}.", "gate_proj", "up_proj", "down_proj"),
           "mixtral": ("block_sparse_moe.experts.{j}.", "w1", "w3", "w2")}


def write_moe_gguf(path, arch: str, cfg, tensors: dict[str, np.ndarray], expert_type: Q) -> None:
    """The HF tensors as llama.cpp's converter writes them: stacked `ffn_*_exps [X, out, in]`
    (in `expert_type`), the router `ffn_gate_inp`, Mixtral's Q/K rows permuted."""
    a = GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(path), a)
    for key, value in {"block_count": cfg.num_layers, "context_length": 256,
                       "embedding_length": cfg.hidden_size,
                       "feed_forward_length": cfg.intermediate_size,
                       "attention.head_count": cfg.num_heads,
                       "attention.head_count_kv": cfg.num_kv_heads,
                       "attention.key_length": cfg.head_dim,
                       "attention.value_length": cfg.head_dim,
                       "expert_count": cfg.num_experts,
                       "expert_used_count": cfg.experts_per_token,
                       "expert_feed_forward_length": cfg.moe_intermediate_size}.items():
        w.add_uint32(f"{a}.{key}", value)
    w.add_float32(f"{a}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{a}.vocab_size", cfg.vocab_size)
    if arch == "qwen3_moe":  # the tiny model's norm_topk_prob is False; llama.cpp's key
        w.add_bool(f"{a}.expert_weights_norm", cfg.norm_topk_prob)
    w.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", tensors["model.norm.weight"])
    w.add_tensor("output.weight", tensors["lm_head.weight"])
    prefix, gate, up, down = EXPERTS[arch]
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for hf, ours in LAYER.items():
            if p + hf not in tensors:
                continue
            value = tensors[p + hf]
            if arch == "mixtral" and "q_proj" in hf:
                value = llamacpp_permute(value, cfg.num_heads)
            elif arch == "mixtral" and "k_proj" in hf:
                value = llamacpp_permute(value, cfg.num_kv_heads)
            w.add_tensor(f"blk.{i}.{ours}", value)
        w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", tensors[p + ROUTER[arch]])
        for proj, name in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"),
                           (down, "ffn_down_exps")):
            stacked = np.stack([tensors[p + prefix.format(j=j) + proj + ".weight"]
                                for j in range(cfg.num_experts)])
            if expert_type == Q.F32:
                w.add_tensor(f"blk.{i}.{name}.weight", stacked)
            else:
                w.add_tensor(f"blk.{i}.{name}.weight", gguf.quants.quantize(stacked,
                             expert_type), raw_dtype=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_gguf_loads_to_the_hf_folders_logits(arch, tmp_path):
    build_hf_model(arch, tmp_path)
    cfg = read_hf_config(tmp_path)
    tensors = read_safetensors(tmp_path)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(1, 21))
    ref = stacked_logits(*assemble_params(cfg, tensors, tmp_path), ids)
    for expert_type in (Q.F32, Q.Q8_0):
        path = tmp_path / f"{expert_type.name}.gguf"
        write_moe_gguf(path, arch, cfg, tensors, expert_type)
        gcfg, gtensors, _ = read_gguf(path)
        assert gcfg.architecture == arch
        fields = ("num_experts", "experts_per_token", "moe_intermediate_size",
                  "norm_topk_prob", "qk_norm")
        assert ({f: getattr(gcfg, f) for f in fields}
                == {f: getattr(cfg, f) for f in fields})
        gcfg = dataclasses.replace(gcfg, bos_token_id=cfg.bos_token_id,
                                   eos_token_ids=cfg.eos_token_ids)
        ours = stacked_logits(*assemble_params(gcfg, gtensors, path), ids)
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        if expert_type == Q.F32:  # the same float32 weights: the same logits
            assert err <= 1e-6, f"{arch}: {err:.2e}"
        else:  # Q8_0 experts: within a few Q8_0 steps
            assert err <= 2e-2, f"{arch} Q8_0 experts: {err:.2e}"


def test_moe_checkpoint_orbax_round_trip(tmp_path):
    """A Mixtral HF folder (tokenizer included) -> orbax -> the same config and params."""
    import jax

    from devtools.hf_models import build_tiny_checkpoint
    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import load_orbax, save_orbax

    ckpt = load_checkpoint(build_tiny_checkpoint(tmp_path / "hf", "mixtral"))
    assert ckpt.config.is_moe
    save_orbax(ckpt, tmp_path / "native")
    back = load_orbax(tmp_path / "native")
    assert back.config == ckpt.config
    for x, y in zip(jax.tree.leaves(ckpt.params), jax.tree.leaves(back.params), strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
