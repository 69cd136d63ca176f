"""Configuration dataclasses: `ModelConfig` (the architecture) and `EngineConfig` (the shapes).

Both are frozen: a config is a value, hashable, and safe to close over in jit-compiled code.
`ModelConfig` covers every family Metrale-JAX implements; the per-family switches are plain
fields so that one set of blocks in `metrale_jax.models` serves them all. Which family sets
which switch, and how each is read from a checkpoint, is declared in `metrale_jax.families`
(whose registry also says which architectures exist).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from metrale_jax.errors import CheckpointError, InvalidParameterError
from metrale_jax.families.llava import VisionConfig
from metrale_jax.families.m2m100 import M2M100Config, decoder_fields
from metrale_jax.families.registry import ARCHITECTURES

QUANTIZATIONS: tuple[str, ...] = ("int8", "int8-all", "int4")
"""Weight quantization modes (`ModelConfig.quantization`; see `models/quant.py`)."""

INT4_BLOCK = 32
"""Inputs per block of an int4 weight (`models/quant4.py`)."""


def check_int4_inputs(k: int) -> None:
    """Raises `InvalidParameterError` unless `k` inputs split into int4 blocks of 32."""
    if k % INT4_BLOCK:
        raise InvalidParameterError(
            f"int4 quantization needs each linear layer's inputs to be a multiple of "
            f"{INT4_BLOCK} (this model has a layer with {k})", param="quantization")


ROPE_KINDS: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
"""The RoPE scalings Metrale-JAX applies (transformers' `rope_type`s of Llama, Qwen, Phi)."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers' `rope_scaling` / `rope_parameters` describe it
    (how each is applied, and the paged cache's choices: docs/architecture.md, "RoPE").

    kind: "default" (no scaling: only a `partial_rotary_factor` below 1), "linear"
    (frequencies divided by `factor`), "dynamic" (NTK: a larger base; fixed here at the base
    transformers computes for `factor` x the model's positions, as vLLM does, since cached
    keys cannot be re-rotated), "llama3" (Llama 3.1's smooth per-frequency scaling between
    `low_freq_factor` and `high_freq_factor` wavelengths of
    `original_max_position_embeddings`), "yarn" (YaRN: a ramp between interpolated and
    extrapolated frequencies over the `beta_fast` .. `beta_slow` rotations of
    `original_max_position_embeddings`, `truncate`d to whole dimensions), "longrope"
    (Phi-3's per-frequency divisors: `long_factor` when `long_context`, else `short_factor`;
    the engine sets `long_context` for its own context: `models/transformer.rope_for_context`).

    attention_factor: cos and sin are multiplied by it (YaRN's mscale, LongRoPE's
    sqrt(1 + ln s / ln L)), resolved when the checkpoint is read. partial_rotary_factor: the
    fraction of each head's `D` dimensions rotated (the first ones; Phi-4-mini 0.75).
    """

    kind: Literal["default", "linear", "dynamic", "llama3", "yarn", "longrope"]
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    long_context: bool = False
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise CheckpointError(f"RoPE scaling type {self.kind!r} is not supported "
                                  f"(supported: {', '.join(ROPE_KINDS)})")
        if self.kind == "longrope" and (not self.short_factor or
                                        len(self.short_factor) != len(self.long_factor)):
            raise CheckpointError("longrope RoPE scaling needs short_factor and long_factor "
                                  "lists of the same length (one per rotated frequency)")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise CheckpointError(f"partial_rotary_factor must be in (0, 1], not "
                                  f"{self.partial_rotary_factor}")

    @classmethod
    def from_dict(cls, d: dict) -> RopeScaling:
        """Reads what `dataclasses.asdict` wrote (the factor lists as tuples); a dict saved
        before the yarn / longrope fields existed (kind linear or llama3) loads as it was."""
        d = dict(d)
        for name in ("short_factor", "long_factor"):
            d[name] = tuple(float(x) for x in d.get(name) or ())
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The architecture of one decoder-only transformer.

    Dimension letters (see DESIGN.md): `V` vocab_size, `E` hidden_size, `F` intermediate_size,
    `L` num_layers, `H` num_heads, `K` num_kv_heads, `D` head_dim.

    architecture: the family's name (`metrale_jax.families.ARCHITECTURES`).

    Family switches (which family sets which: `metrale_jax.families`):
        attention_bias: q/k/v projections carry a bias (Qwen2).
        qk_norm: RMSNorm over `D` on queries and keys before RoPE (Qwen3).
        norm_weight_offset: RMSNorm scales by `1 + weight` (Gemma, Gemma 2).
        embed_scale: embeddings multiplied by sqrt(E) (Gemma, Gemma 2).
        post_norms: extra norms after attention and after the MLP (Gemma 2).
        attn_logit_softcap / final_logit_softcap: `cap * tanh(x / cap)` (Gemma 2).
        sliding_window / sliding_layers: per-layer local attention (Gemma 2 alternates,
            Mistral uses it on every layer); `sliding_layers[i]` says whether layer i is local.
        query_pre_attn_scalar: attention scale is its -1/2 power instead of D^-1/2 (Gemma 2).
        rope_local_theta: the RoPE base of the sliding-window layers, which take no
            `rope_scaling` (Gemma 3: 10,000 locally, `rope_theta` 1,000,000 globally); None:
            every layer rotates by `rope_theta` and `rope_scaling`.
        encoder_decoder: for an encoder-decoder translation model ("m2m_100": M2M100 /
            NLLB-200), its full `families.m2m100.M2M100Config`; the other fields then describe
            its decoder (the part the engine's paged steps run: L decoder layers of H heads,
            K = H, the decoder FFN as `intermediate_size`). None for decoder-only models.
        vision: for a vision-language model (LLaVA), its vision encoder's
            `VisionConfig`; the other fields describe the text model. None for text only.

    Mixture of experts (Qwen3-MoE, Mixtral; `models/moe.py`), X = num_experts:
        num_experts: X experts per layer, every layer's MLP routed (0: a dense model).
        experts_per_token: k, the experts each token is routed to (top-k of the router).
        moe_intermediate_size: F of each expert (Mixtral: `intermediate_size`).
        norm_topk_prob: the k routing weights renormalized to sum to 1 (Mixtral always;
            Qwen3-MoE as its config says); else the softmax over all X experts, kept.

    Storage:
        quantization: None (float weights), "int8" (the linear layers' weights int8 with
            per-output-channel scales), "int8-all" (the embedding and LM head too; see
            `models/quant.py`) or "int4" (the linear layers 4-bit in blocks of 32 inputs with
            float16 scales and minimums, llama.cpp's Q4_1; the embedding and LM head int8;
            see `models/quant4.py`). Decoder-only models.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_local_theta: float | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu", "gelu_tanh"] = "silu"
    attention_bias: bool = False
    qk_norm: bool = False
    norm_weight_offset: bool = False
    embed_scale: bool = False
    post_norms: bool = False
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    query_pre_attn_scalar: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    encoder_decoder: M2M100Config | None = None
    vision: VisionConfig | None = None
    quantization: str | None = None
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise CheckpointError(f"unknown architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"model config: {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"model config: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}")
        rope = self.rope_scaling
        if rope is not None and rope.kind == "longrope" and len(rope.short_factor) != int(
                self.head_dim * rope.partial_rotary_factor) // 2:
            raise CheckpointError(
                f"model config: longrope has {len(rope.short_factor)} factors per set, but "
                f"the heads rotate {int(self.head_dim * rope.partial_rotary_factor) // 2} "
                "frequencies")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise CheckpointError("model config: sliding_layers must have one entry per layer")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise CheckpointError(f"model config: quantization must be one of {QUANTIZATIONS} "
                                  f"or None, not {self.quantization!r}")
        if self.quantization and self.encoder_decoder is not None:
            raise InvalidParameterError("weight quantization is for decoder-only models; this "
                                        "is an encoder-decoder (translation) model",
                                        param="quantization")
        if self.num_experts:
            self._check_experts()
        if self.quantization == "int4":
            for k in (self.hidden_size, self.intermediate_size,
                      self.num_heads * self.head_dim):
                check_int4_inputs(k)

    def _check_experts(self) -> None:
        """The mixture-of-experts fields agree (`CheckpointError`), and the weight format
        has expert products (`InvalidParameterError` for int4)."""
        if self.num_experts < 0 or not 1 <= self.experts_per_token <= self.num_experts:
            raise CheckpointError(
                f"model config: experts_per_token={self.experts_per_token} must be between 1 "
                f"and num_experts={self.num_experts}")
        if self.moe_intermediate_size <= 0:
            raise CheckpointError("model config: moe_intermediate_size must be positive")
        if self.quantization == "int4":
            raise InvalidParameterError(
                "int4 quantization is not supported for mixture-of-experts models (their "
                "expert weights have no int4 grouped product); use int8 or int8-all",
                param="quantization")

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model: every layer's MLP is `num_experts` experts."""
        return self.num_experts > 0

    @classmethod
    def for_m2m100(cls, m2m: M2M100Config) -> ModelConfig:
        """The engine's config of an M2M100 / NLLB model: architecture "m2m_100", the fields
        describing the decoder (L decoder layers, H heads, K = H, D, the decoder FFN), and
        `m2m` as `encoder_decoder` (`families.m2m100.decoder_fields`)."""
        return cls(**decoder_fields(m2m))

    @property
    def is_encoder_decoder(self) -> bool:
        """True for an encoder-decoder (translation) model: see `encoder_decoder`."""
        return self.encoder_decoder is not None

    @property
    def attention_scale(self) -> float:
        """The factor applied to q·k before softmax."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return 1.0 / math.sqrt(base)

    @property
    def layer_is_sliding(self) -> tuple[bool, ...]:
        """One flag per layer: True where the layer attends within `sliding_window` only."""
        if self.sliding_window is None:
            return (False,) * self.num_layers
        return self.sliding_layers or (True,) * self.num_layers

    def to_dict(self) -> dict:
        """A JSON-ready dict that `from_dict` reads back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Reads what `to_dict` wrote."""
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling.from_dict(d["rope_scaling"])
        d["sliding_layers"] = tuple(d.get("sliding_layers") or ())
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        if d.get("encoder_decoder") is not None:
            d["encoder_decoder"] = M2M100Config.from_dict(d["encoder_decoder"])
        if d.get("vision") is not None:
            d["vision"] = VisionConfig.from_dict(d["vision"])
        return cls(**d)


DTypeName = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = ("float32", "bfloat16")
# The KV cache's dtypes: a float one, or int8 rows with per-(token, head) scales
# (`models/kv_quant.py`).
KV_CACHE_DTYPES: tuple[str, ...] = (*DTYPES, "int8")


def check_dtype(name: str) -> str:
    """Returns `name` if it is a supported compute dtype, else raises `InvalidParameterError`."""
    if name not in DTYPES:
        raise InvalidParameterError(f"dtype must be one of {DTYPES}, got {name!r}", param="dtype")
    return name
