"""`Family`: what one model family declares, and the helpers family modules share.

A family module (`llama.py`, `gemma2.py`, ...) holds one `FAMILY = Family(...)`: the names it
is known by (HF `model_type`, GGUF `general.architecture`), the fixed `ModelConfig` switches
of its layer graph, how its checkpoint-dependent switches are read from a `config.json` or
GGUF metadata, its GGUF tensor names where they differ from Llama's, and its cache kinds. The
generic readers (`weights/hf_config.py`, `weights/gguf_names.py`) read the fields every family
shares (widths, heads, RoPE, token ids) and merge the family's on top.

Reading hooks return `ModelConfig` fields as plain values (the form `ModelConfig.to_dict`
writes), so this package never imports `metrale_jax.config` (which imports it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from metrale_jax.errors import CheckpointError, UnsupportedModelError

ModelKind = Literal["decoder", "encoder_decoder", "vision_language"]
"""decoder: a decoder-only language model (the paged ragged steps run it whole);
encoder_decoder: a translation model (an encoder run once per source, a paged decoder);
vision_language: a vision tower and projector in front of a decoder family's text model."""

CacheKind = Literal["full", "sliding", "cross"]
"""full: paged KV over every position; sliding: layers that attend within a window
(`ModelConfig.sliding_window` / `sliding_layers`); cross: cross-attention keys and values of
an encoder's output, computed once per source."""

class GgufMetadata:
    """A GGUF file's metadata (`meta`: key -> plain value) read with llama.cpp's conventions:
    `key(name)` is `{arch}.{name}`; a missing optional key takes its default, a missing
    required one or a malformed value is a `CheckpointError` naming `path`."""

    def __init__(self, meta: Mapping[str, Any], arch: str, path: Path):
        self.meta, self.arch, self.path = meta, arch, path

    def key(self, name: str) -> str:
        """The full key of the architecture's field `name`: `{arch}.{name}`."""
        return f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        """Whether the file sets `{arch}.{name}`."""
        return self.key(name) in self.meta

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        """The value of the full key `key` (one value: per-layer lists are refused)."""
        if key not in self.meta:
            if required:
                raise CheckpointError(f"{self.path}: GGUF metadata has no {key!r}")
            return default
        value = self.meta[key]
        if isinstance(value, list):
            raise UnsupportedModelError(
                f"{self.path}: per-layer values for {key!r} are not supported (got a list)")
        return value

    def integer(self, name: str, default: int | None = None) -> int:
        """`{arch}.{name}` as an int; required when `default` is None."""
        key = self.key(name)
        value = self.get(key, default, required=default is None)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is not an integer: "
                                  f"{value!r}") from None

    def number(self, name: str, default: float) -> float:
        """`{arch}.{name}` as a float, `default` when absent."""
        key = self.key(name)
        value = self.get(key, default)
        try:
            return float(value)
        except (TypeError, ValueError):
            raise CheckpointError(f"{self.path}: GGUF metadata {key!r} is not a number: "
                                  f"{value!r}") from None


HfSwitches = Callable[[Mapping[str, Any], int], dict[str, Any]]
"""(parsed config.json, L) -> the family's checkpoint-dependent `ModelConfig` fields."""
GgufSwitches = Callable[[GgufMetadata, Mapping[str, Any]], dict[str, Any]]
"""(the file's metadata, the shared fields read so far) -> the family's `ModelConfig` fields
(they override the shared ones: e.g. Gemma's activation and norm epsilon default)."""


def no_switches(*_: Any) -> dict[str, Any]:
    """A reading hook for a family with nothing checkpoint-dependent to read."""
    return {}


def layer_windows(window: Any, layer_types: Any) -> dict[str, Any]:
    """transformers' per-layer attention kinds as `sliding_window` / `sliding_layers`: a
    window only when `layer_types` (one "sliding_attention" / "full_attention" per layer)
    has a sliding layer and `window` is set; else full attention everywhere."""
    if layer_types and "sliding_attention" in layer_types and window:
        return {"sliding_window": int(window),
                "sliding_layers": tuple(t == "sliding_attention" for t in layer_types)}
    return {"sliding_window": None, "sliding_layers": ()}


def hf_layer_windows(cfg: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """`layer_windows` of a config.json's own `sliding_window` and `layer_types` (Llama,
    Gemma: a window only where the config lists sliding layers)."""
    return layer_windows(cfg.get("sliding_window"), cfg.get("layer_types"))


# The GGUF expert tensors (stacked `[X, out, in]`) -> the canonical per-layer names.
GGUF_EXPERT_TENSORS: dict[str, str] = {
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}


def gguf_expert_fields(meta: GgufMetadata, fields: Mapping[str, Any],
                       norm_default: bool) -> dict[str, Any]:
    """The MoE fields of a GGUF file (llama.cpp's keys); `expert_feed_forward_length`
    falls back to `feed_forward_length` (llama.cpp's Mixtral files)."""
    return {"num_experts": meta.integer("expert_count"),
            "experts_per_token": meta.integer("expert_used_count"),
            "moe_intermediate_size": meta.integer("expert_feed_forward_length",
                                                  fields["intermediate_size"]),
            "norm_topk_prob": bool(meta.get(meta.key("expert_weights_norm"), norm_default))}



@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    """Everything Metrale-JAX knows about one model family, declared in its own module (one
    object per family: compared by identity).

    name: `ModelConfig.architecture` of its models (for a vision-language family, which wraps
        a decoder family's text model, only the registry key). summary: one line for people.
    hf_model_types / gguf_architectures: the `config.json` `model_type`s and GGUF
        `general.architecture`s read as this family (empty: no such checkpoints).
    kind: see `ModelKind`. cache: the cache kinds its models may use (see `CacheKind`).
    graph: the `ModelConfig` switches every model of the family has (its layer graph:
        `qk_norm`, `norm_weight_offset`, `embed_scale`, `post_norms`, ...).
    hf_defaults: defaults of `config.json` fields that differ from transformers' usual
        (`tie_word_embeddings`, `attention_bias`).
    hf_switches / gguf_switches: read the checkpoint-dependent switches (sliding windows,
        soft-caps, query scale); see `HfSwitches`, `GgufSwitches`.
    gguf_layer_tensors: GGUF per-layer tensor suffix -> HF suffix where the family differs
        from the shared table (`weights/gguf_names.LAYER_TENSORS`).
    gguf_head_dim_from_rope: the head dim falls back to `rope.dimension_count` (llama.cpp's
        Llama converter) before `E // H`. gguf_permuted_qk: llama.cpp permuted the rows of
        the Q and K projections (its Llama converter); the reader undoes it.
    chat_template: the Jinja chat template of a checkpoint that carries none (a base model's
        GGUF: the family's own turn format, as llama.cpp picks one by name); None: such a
        checkpoint has no chat template (chat requests are refused, completions work).
    hf_rope_aliases: `rope_type` names the family's configs use for a type of another name
        (Phi-3's "su" and "yarn" are LongRoPE, as its transformers config says).
    fused_projections: checkpoints hold q/k/v as one `self_attn.qkv_proj` `[(H + 2K) * D, E]`
        and gate/up as one `mlp.gate_up_proj` `[2F, E]` (Phi-3; GGUF `attn_qkv`, `ffn_up`);
        the loader splits them (`weights/assemble.unfuse_projections`).

    Not declared here: sharding axes (they sit beside the param shapes in `models/`: every
    decoder family shares `models/layers`' table, M2M100 and the vision tower have theirs),
    and tool/reasoning parsers (detected from the chat template's source; the template comes
    with the checkpoint, the family's only where the checkpoint has none).
    """

    name: str
    summary: str
    hf_model_types: tuple[str, ...] = ()
    gguf_architectures: tuple[str, ...] = ()
    kind: ModelKind = "decoder"
    cache: tuple[CacheKind, ...] = ("full",)
    graph: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    hf_switches: HfSwitches = no_switches
    gguf_switches: GgufSwitches = no_switches
    gguf_layer_tensors: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_head_dim_from_rope: bool = False
    gguf_permuted_qk: bool = False
    chat_template: str | None = None
    hf_rope_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    fused_projections: bool = False


__all__ = ["GGUF_EXPERT_TENSORS", "CacheKind", "Family", "GgufMetadata", "GgufSwitches",
           "HfSwitches", "ModelKind", "gguf_expert_fields", "hf_layer_windows",
           "layer_windows", "no_switches"]
