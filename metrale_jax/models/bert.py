"""BERT-family encoders (BERT, RoBERTa, XLM-RoBERTa) as Flax NNX models, with the
sequence-classification heads cross-encoders use.

The encoder is transformers' `BertModel`: token + position + token-type embeddings summed and
layer-normed, then post-norm layers (`x = ln(x + attn(x))`, `x = ln(x + ffn(x))`) with
bidirectional self-attention over the real tokens (padding masked) and a GELU feed-forward.
The attention, feed-forward and LayerNorm blocks are M2M100's (`models/m2m100.py`): the same
biased projections, the same scaling, the same float32 statistics.

RoBERTa / XLM-RoBERTa differences handled (`BertConfig.roberta`):
- position ids start at `pad_token_id + 1` and count only real tokens (fairseq's
  `create_position_ids_from_input_ids`), pads get `pad_token_id`;
- one token type (`type_vocab_size` 1: every token type id 0);
- the classification head is `dense -> tanh -> out_proj` on the first token (`<s>`), where
  BERT's is its pooler (`dense -> tanh` on `[CLS]`) then `classifier`.
Not handled: relative position embeddings (`position_embedding_type` other than "absolute"),
which `weights/encoder_reader.py` refuses.

Dimension letters: `B` rows, `S` positions, `E` hidden size, `H` heads, `D` head dim, `F` MLP
size, `V` vocab, `L` layers. Activations in the params dtype; norms, softmax, pooling and the
head's output in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from metrale_jax.models.layers import random_param
from metrale_jax.models.m2m100 import FeedForward, LayerNorm, MultiHeadAttention


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """What the encoder needs from a HF `config.json` (see the module docstring).

    num_labels: the classification head's outputs (0: no head, an embedding model);
    head: "bert" (pooler + classifier) or "roberta" (dense + out_proj), with num_labels."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    hidden_act: str = "gelu"
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    roberta: bool = False
    num_labels: int = 0
    head: str = "bert"

    @property
    def position_offset(self) -> int:
        """The first real token's position id (RoBERTa: pad_token_id + 1; BERT: 0)."""
        return self.pad_token_id + 1 if self.roberta else 0

    @property
    def max_tokens(self) -> int:
        """The longest input the position table holds."""
        return self.max_position_embeddings - self.position_offset


class BertEmbeddings(nnx.Module):
    """`ln(word[ids] + position[pos] + token_type[types])`: ids, types `[B, S]` -> `[B, S, E]`
    (`word: [V, E]`, `position: [P, E]`, `token_type: [TV, E]`)."""

    def __init__(self, cfg: BertConfig, dtype: Any, rngs: nnx.Rngs):
        E = cfg.hidden_size
        self.word = random_param(rngs, (cfg.vocab_size, E), dtype)
        self.position = random_param(rngs, (cfg.max_position_embeddings, E), dtype)
        self.token_type = random_param(rngs, (cfg.type_vocab_size, E), dtype)
        self.norm = LayerNorm(E, cfg.layer_norm_eps, dtype)

    def __call__(self, ids: jax.Array, positions: jax.Array, types: jax.Array) -> jax.Array:
        x = (self.word[...][ids] + self.position[...][positions]
             + self.token_type[...][types])
        return self.norm(x)


class BertLayer(nnx.Module):
    """Post-norm encoder layer: `x = ln(x + attn(x))`, then `x = ln(x + ffn(x))`."""

    def __init__(self, cfg: BertConfig, dtype: Any, rngs: nnx.Rngs):
        E, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.attention = MultiHeadAttention(E, cfg.num_attention_heads, dtype, rngs)
        self.attention_norm = LayerNorm(E, eps, dtype)
        self.ffn = FeedForward(E, cfg.intermediate_size, cfg.hidden_act, dtype, rngs)
        self.ffn_norm = LayerNorm(E, eps, dtype)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x `[B, S, E]`, mask `[B, S]` bool (True: a real token) -> `[B, S, E]`."""
        k, v = self.attention.key_value(x)
        x = self.attention_norm(
            x + self.attention.attend(self.attention.query(x), [k], [v], [mask[:, None, :]]))
        return self.ffn_norm(x + self.ffn(x))


class ClassificationHead(nnx.Module):
    """`out(tanh(first @ dense + dense_bias)) `: the first token's state `[B, E]` -> logits
    `[B, num_labels]` float32 (BERT's pooler + classifier, RoBERTa's dense + out_proj: the
    same arithmetic, different tensor names). `dense: [E, E]`, `out: [E, num_labels]`."""

    def __init__(self, cfg: BertConfig, dtype: Any, rngs: nnx.Rngs):
        E, n = cfg.hidden_size, cfg.num_labels
        self.dense = random_param(rngs, (E, E), dtype)
        self.dense_bias = nnx.Param(jnp.zeros((E,), dtype))
        self.out = random_param(rngs, (E, n), dtype)
        self.out_bias = nnx.Param(jnp.zeros((n,), dtype))

    def __call__(self, first: jax.Array) -> jax.Array:
        h = jnp.tanh(first @ self.dense[...] + self.dense_bias[...])
        return (h @ self.out[...] + self.out_bias[...]).astype(jnp.float32)


class BertEncoder(nnx.Module):
    """The encoder (and its classification head when `cfg.num_labels` > 0).

    Params (`nnx.to_pure_dict` keys): `embeddings`, `layers` (a list of `BertLayer`),
    `head` (only with labels)."""

    def __init__(self, cfg: BertConfig, dtype: Any = jnp.float32, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings = BertEmbeddings(cfg, dtype, rngs)
        self.layers = nnx.List([BertLayer(cfg, dtype, rngs)
                                for _ in range(cfg.num_hidden_layers)])
        if cfg.num_labels:
            self.head = ClassificationHead(cfg, dtype, rngs)

    def positions(self, ids: jax.Array, mask: jax.Array) -> jax.Array:
        """Position ids `[B, S] int32`: BERT's 0 .. S-1; RoBERTa's count of real tokens from
        pad_token_id + 1 (pads: pad_token_id)."""
        cfg = self.cfg
        if cfg.roberta:
            m = mask.astype(jnp.int32)
            return jnp.cumsum(m, axis=1) * m + cfg.pad_token_id
        S = ids.shape[1]
        pos = jnp.minimum(jnp.arange(S, dtype=jnp.int32), cfg.max_position_embeddings - 1)
        return jnp.broadcast_to(pos, ids.shape)

    def __call__(self, ids: jax.Array, types: jax.Array, lens: jax.Array) -> jax.Array:
        """The last hidden states `[B, S, E]` of ids, types `[B, S] int32` (right-padded),
        lens `[B] int32` (each row's real tokens; rows past them are masked)."""
        mask = jnp.arange(ids.shape[1])[None, :] < lens[:, None]
        x = self.embeddings(ids, self.positions(ids, mask), types)
        for layer in self.layers:
            x = layer(x, mask)
        return x

    def classify(self, hidden: jax.Array) -> jax.Array:
        """The head's logits `[B, num_labels]` float32 from the hidden states `[B, S, E]`."""
        return self.head(hidden[:, 0])


def abstract_bert(cfg: BertConfig, dtype: Any = jnp.float32) -> tuple[nnx.GraphDef, nnx.State]:
    """The graphdef and a params pytree of `jax.ShapeDtypeStruct`s, allocating nothing."""
    model = nnx.eval_shape(lambda: BertEncoder(cfg, dtype, rngs=nnx.Rngs(0)))
    return nnx.split(model)


__all__ = ["BertConfig", "BertEmbeddings", "BertEncoder", "BertLayer", "ClassificationHead",
           "abstract_bert"]
