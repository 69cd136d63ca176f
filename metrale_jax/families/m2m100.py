"""M2M100 / NLLB-200: an encoder-decoder translation model (`M2M100Config`, its fields).

Its encoder runs once per source; its decoder runs in the engine's paged steps, with
cross-attention to the encoder's output. `ModelConfig.for_m2m100` describes the decoder
(`decoder_fields`) and holds the whole `M2M100Config` as `encoder_decoder`. The Flax modules
are `models.m2m100`; the reader `weights.m2m100_reader`; its tokenizer (FLORES-200 language
codes) `text.nllb`. Kept free of JAX so `metrale_jax.config` can hold one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families.family import Family

ACTIVATIONS: tuple[str, ...] = ("relu", "gelu", "gelu_new", "gelu_pytorch_tanh", "silu", "swish")

FAMILY = Family(
    name="m2m_100",
    summary="M2M100 / NLLB-200: encoder-decoder translation",
    hf_model_types=("m2m_100",),
    kind="encoder_decoder",
    cache=("full", "cross"),
)


@dataclasses.dataclass(frozen=True)
class M2M100Config:
    """The architecture of one M2M100 / NLLB-200 model (transformers' `M2M100Config` fields).

    The encoder and the decoder have their own depth, head count and FFN width; the head dim
    of each is `d_model // heads`. Token ids: `pad_token_id` (also the padding index of the
    position embeddings), `bos_token_id`, `eos_token_id`, and `decoder_start_token_id` (the
    first decoder input, `</s>` for NLLB).
    """

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_position_embeddings: int = 1024
    pad_token_id: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 2
    decoder_start_token_id: int = 2
    scale_embedding: bool = True
    activation_function: str = "relu"
    layer_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        for heads in (self.encoder_attention_heads, self.decoder_attention_heads):
            if heads <= 0 or self.d_model % heads:
                raise CheckpointError(
                    f"d_model {self.d_model} is not divisible by {heads} attention heads")
        if self.activation_function not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation_function {self.activation_function!r} is not supported "
                f"(supported: {', '.join(ACTIVATIONS)})")

    @property
    def encoder_head_dim(self) -> int:
        """D of the encoder's attention: `d_model // encoder_attention_heads`."""
        return self.d_model // self.encoder_attention_heads

    @property
    def decoder_head_dim(self) -> int:
        """D of the decoder's attention: `d_model // decoder_attention_heads`."""
        return self.d_model // self.decoder_attention_heads

    @property
    def embed_scale(self) -> float:
        """The factor token embeddings are multiplied by: sqrt(d_model), or 1."""
        return math.sqrt(self.d_model) if self.scale_embedding else 1.0

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> M2M100Config:
        """Builds the config from a parsed Hugging Face `config.json` dict.

        Raises `UnsupportedModelError` for another `model_type` (NLLB-MoE is not this
        architecture) and `CheckpointError` for a missing or malformed field.
        """
        model_type = config.get("model_type", "m2m_100")
        if model_type not in FAMILY.hf_model_types:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not an M2M100/NLLB model (expected "
                f"{', '.join(FAMILY.hf_model_types)})")
        if config.get("normalize_before") is False:
            raise UnsupportedModelError("post-norm M2M100 layers (normalize_before=false) "
                                        "are not supported")

        def first(value: Any) -> int:
            return int(value[0] if isinstance(value, list) else value)

        try:
            return cls(
                vocab_size=int(config["vocab_size"]),
                d_model=int(config["d_model"]),
                encoder_layers=int(config["encoder_layers"]),
                decoder_layers=int(config["decoder_layers"]),
                encoder_attention_heads=int(config["encoder_attention_heads"]),
                decoder_attention_heads=int(config["decoder_attention_heads"]),
                encoder_ffn_dim=int(config["encoder_ffn_dim"]),
                decoder_ffn_dim=int(config["decoder_ffn_dim"]),
                max_position_embeddings=int(config.get("max_position_embeddings", 1024)),
                pad_token_id=first(config.get("pad_token_id", 1)),
                bos_token_id=first(config.get("bos_token_id", 0)),
                eos_token_id=first(config.get("eos_token_id", 2)),
                decoder_start_token_id=first(config.get("decoder_start_token_id", 2)),
                scale_embedding=bool(config.get("scale_embedding", True)),
                activation_function=str(config.get("activation_function", "relu")),
                layer_norm_eps=float(config.get("layer_norm_eps", 1e-5)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
            )
        except KeyError as e:
            raise CheckpointError(f"config is missing the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"config has a bad value: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_dict` reads back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> M2M100Config:
        """Reads what `to_dict` wrote."""
        return cls(**d)


def decoder_fields(m2m: M2M100Config) -> dict[str, Any]:
    """`ModelConfig` fields of an M2M100 model (`ModelConfig.for_m2m100`): architecture
    "m2m_100", the fields describing the decoder (L decoder layers, H heads, K = H, D, the
    decoder FFN as F), and `m2m` itself as `encoder_decoder`."""
    H = m2m.decoder_attention_heads
    return dict(
        architecture=FAMILY.name, vocab_size=m2m.vocab_size, hidden_size=m2m.d_model,
        intermediate_size=m2m.decoder_ffn_dim, num_layers=m2m.decoder_layers,
        num_heads=H, num_kv_heads=H, head_dim=m2m.decoder_head_dim,
        rms_norm_eps=m2m.layer_norm_eps,
        max_position_embeddings=m2m.max_position_embeddings,
        tie_word_embeddings=m2m.tie_word_embeddings, bos_token_id=m2m.bos_token_id,
        eos_token_ids=(m2m.eos_token_id,), encoder_decoder=m2m)


__all__ = ["ACTIVATIONS", "FAMILY", "M2M100Config", "decoder_fields"]
