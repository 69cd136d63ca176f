"""LLaVA: a vision tower (CLIP or SigLIP) and a projector in front of a decoder family's text
model (`VisionConfig`, its config reading and its tensor names).

transformers' `LlavaForConditionalGeneration`: `config.json` with `model_type` "llava", a
`text_config` (read by its own decoder family: `text_config`) and a `vision_config`
(`VisionConfig.from_hf_llava`). The `ModelConfig` is the text model's with `vision` set; the
Flax modules are `models.vision`, the reader `weights.llava_reader`. Kept free of JAX so
`metrale_jax.config` can hold one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from metrale_jax.errors import CheckpointError, UnsupportedModelError
from metrale_jax.families.family import Family

FAMILY = Family(
    name="llava",
    summary="LLaVA: a CLIP / SigLIP tower and projector before a decoder family",
    hf_model_types=("llava",),
    kind="vision_language",
    cache=("full", "sliding"),
)

TEXT_MODEL_TYPE = "llama"
"""The text model's family when `text_config` names none (the original LLaVA 1.5)."""

# Tensor names: the text model's prefixes -> the decoder-only names; the vision tower's and
# the projector's prefixes (the longest first). Checkpoints spell them with or without a
# leading `model.`, the text model as the hub's `language_model.model.*` or as
# `model.language_model.*`.
TEXT_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "model."), ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."))
VISION_PREFIXES: tuple[str, ...] = ("model.vision_tower.vision_model.",
                                    "vision_tower.vision_model.", "model.vision_tower.",
                                    "vision_tower.")
PROJECTOR_PREFIXES: tuple[str, ...] = ("model.multi_modal_projector.", "multi_modal_projector.")

TOWERS: dict[str, str] = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}
"""transformers' vision `model_type` -> our tower kind."""
ACTIVATIONS: tuple[str, ...] = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu",
                                "silu")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style vision encoder: a ViT tower (CLIP or SigLIP), the hidden states of one or
    more of its layers, and a two-layer projector into the text model's embedding space.

    tower: "clip" (class token, pre-LayerNorm, patch conv without bias) or "siglip" (no class
        token, patch conv with bias). hidden_size / intermediate_size / num_layers /
        num_heads: the tower's; image_size, patch_size: a square image of image_size pixels
        cut into (image_size / patch_size)^2 patches. feature_layers: the tower layers whose
        outputs feed the projector (concatenated; -1 is the last layer's output, -2 the one
        before, 0 the embeddings); select_strategy: "default" drops the class token, "full"
        keeps every position. text_hidden_size: the projector's output E. image_token_id:
        the placeholder token each image's features replace, `tokens_per_image` of them.
    """

    tower: Literal["clip", "siglip"]
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    text_hidden_size: int
    image_token_id: int
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    feature_layers: tuple[int, ...] = (-2,)
    select_strategy: Literal["default", "full"] = "default"
    projector_act: str = "gelu"
    projector_bias: bool = True
    num_channels: int = 3

    def __post_init__(self) -> None:
        if self.tower not in ("clip", "siglip"):
            raise UnsupportedModelError(f"vision tower {self.tower!r} is not supported")
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"vision hidden_size {self.hidden_size} is not divisible by "
                                  f"{self.num_heads} heads")
        if self.image_size % self.patch_size:
            raise CheckpointError(f"image_size {self.image_size} is not a multiple of "
                                  f"patch_size {self.patch_size}")
        for act in (self.hidden_act, self.projector_act):
            if act not in ACTIVATIONS:
                raise UnsupportedModelError(f"activation {act!r} is not supported "
                                            f"(supported: {', '.join(ACTIVATIONS)})")
        if self.select_strategy not in ("default", "full"):
            raise UnsupportedModelError(
                f"vision_feature_select_strategy {self.select_strategy!r} is not supported")
        if self.select_strategy == "default" and self.tower != "clip":
            raise UnsupportedModelError("vision_feature_select_strategy 'default' drops a "
                                        "class token, which a SigLIP tower has not")
        for layer in self.feature_layers:
            if not -(self.num_layers + 1) <= layer <= self.num_layers:
                raise CheckpointError(f"vision_feature_layer {layer} is outside the tower's "
                                      f"{self.num_layers} layers")

    @property
    def head_dim(self) -> int:
        """The tower's attention head dim: hidden_size // num_heads."""
        return self.hidden_size // self.num_heads

    @property
    def num_patches(self) -> int:
        """Patches per image: (image_size // patch_size) ** 2."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        """The tower's sequence length: the patches, plus the class token for CLIP."""
        return self.num_patches + (1 if self.tower == "clip" else 0)

    @property
    def tokens_per_image(self) -> int:
        """How many placeholder tokens (and feature rows) each image takes in the prompt."""
        drop = 1 if self.select_strategy == "default" else 0
        return self.num_positions - drop

    @classmethod
    def from_hf_llava(cls, config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        """Builds the config from a parsed LLaVA `config.json` (its `vision_config` and the
        projector's fields); raises `UnsupportedModelError` / `CheckpointError`."""
        vision = config.get("vision_config") or {}
        kind = TOWERS.get(vision.get("model_type", "clip_vision_model"))
        if kind is None:
            raise UnsupportedModelError(
                f"vision tower {vision.get('model_type')!r} is not supported (supported: "
                f"{', '.join(TOWERS)})")
        layers = config.get("vision_feature_layer", -2)
        layers = tuple(int(x) for x in layers) if isinstance(layers, list) else (int(layers),)

        def size(value: Any) -> int:
            if isinstance(value, (list, tuple)):
                if len(set(value)) != 1:
                    raise UnsupportedModelError(f"non-square vision size {value} is not "
                                                "supported")
                value = value[0]
            return int(value)

        defaults = {"clip": (1e-5, "quick_gelu"), "siglip": (1e-6, "gelu_pytorch_tanh")}[kind]
        try:
            return cls(
                tower=kind, hidden_size=int(vision.get("hidden_size", 1024)),
                intermediate_size=int(vision.get("intermediate_size", 4096)),
                num_layers=int(vision.get("num_hidden_layers", 24)),
                num_heads=int(vision.get("num_attention_heads", 16)),
                image_size=size(vision.get("image_size", 336)),
                patch_size=size(vision.get("patch_size", 14)),
                text_hidden_size=text_hidden_size,
                image_token_id=int(config.get("image_token_index",
                                              config.get("image_token_id", 32000))),
                layer_norm_eps=float(vision.get("layer_norm_eps", defaults[0])),
                hidden_act=str(vision.get("hidden_act", defaults[1])),
                feature_layers=layers,
                select_strategy=config.get("vision_feature_select_strategy", "default"),
                projector_act=str(config.get("projector_hidden_act", "gelu")),
                projector_bias=bool(config.get("multimodal_projector_bias", True)),
                num_channels=int(vision.get("num_channels", 3)),
            )
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"vision config has a bad value: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that `from_dict` reads back."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VisionConfig:
        """Reads what `to_dict` wrote."""
        d = dict(d)
        d["feature_layers"] = tuple(d.get("feature_layers") or (-2,))
        return cls(**d)


def text_config(config: dict[str, Any], path: Path) -> dict[str, Any]:
    """The text model's `config.json` fields inside a LLaVA config (its `text_config`, with
    the family defaulting to Llama and the outer `tie_word_embeddings` carried in)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{path}: a LLaVA config needs a text_config")
    text = dict(text)
    text.setdefault("model_type", TEXT_MODEL_TYPE)
    if "tie_word_embeddings" in config and "tie_word_embeddings" not in text:
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    return text


def vision_config(config: dict[str, Any], text_hidden_size: int, text_vocab_size: int,
                  path: Path) -> VisionConfig:
    """The `VisionConfig` of a LLaVA `config.json` whose text model has E =
    `text_hidden_size` and V = `text_vocab_size`; its image token must be a text token."""
    vision = VisionConfig.from_hf_llava(config, text_hidden_size)
    if not 0 <= vision.image_token_id < text_vocab_size:
        raise CheckpointError(f"{path}: image_token_index {vision.image_token_id} is outside "
                              f"the vocabulary ({text_vocab_size})")
    return vision


__all__ = ["ACTIVATIONS", "FAMILY", "PROJECTOR_PREFIXES", "TEXT_MODEL_TYPE", "TEXT_PREFIXES",
           "TOWERS", "VISION_PREFIXES", "VisionConfig", "text_config", "vision_config"]
