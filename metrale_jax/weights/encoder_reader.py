"""Reads a BERT-family encoder folder (BERT, RoBERTa, XLM-RoBERTa) as sentence-transformers
lays it out, or a bare Hugging Face folder: the model's config and params
(`models/bert.py`), its tokenizer, and how its vectors are pooled.

sentence-transformers' files read:
- `modules.json`: the module list; Transformer (its path holds the HF files), Pooling,
  Normalize. Any other module (Dense, LayerNorm, ...) is refused.
- `<pooling path>/config.json`: `pooling_mode_cls_token`, `_max_tokens`, `_mean_tokens`,
  `_mean_sqrt_len_tokens`, `_lasttoken` (several: concatenated in sentence-transformers'
  order); `include_prompt` is ignored.
- `sentence_bert_config.json`: `max_seq_length` (the input limit) and `do_lower_case`.
- `config_sentence_transformers.json` (and `config.json`): `matryoshka_dimensions`; its
  `default_prompt_name` prompt goes before every text.
Without `modules.json` a `*Model` folder is mean-pooled and not normalized (what
`SentenceTransformer(folder)` builds for a bare encoder), and its limit is the tokenizer's
`model_max_length` capped by `max_position_embeddings` (as sentence-transformers caps it),
less RoBERTa's position offset. A `*ForSequenceClassification` folder is a cross-encoder
scored as `CrossEncoder.predict` scores: through the activation its config names
(`sentence_transformers.activation_fn`: Sigmoid, Identity or Tanh), else sigmoid, its
default for one label (more labels are refused).

Tensor names: transformers' (`embeddings.word_embeddings.weight`,
`encoder.layer.{i}.attention.self.query.weight`, ...), bare as sentence-transformers saves
them or under `bert.` / `roberta.`; old `gamma` / `beta` LayerNorm names too.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from metrale_jax.errors import CheckpointError
from metrale_jax.models.bert import BertConfig, BertEncoder, abstract_bert
from metrale_jax.weights.safetensors_reader import read_safetensors

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")
ROBERTA_TYPES = ("roberta", "xlm-roberta")
POOLING_MODES = (("pooling_mode_cls_token", "cls"), ("pooling_mode_max_tokens", "max"),
                 ("pooling_mode_mean_tokens", "mean"),
                 ("pooling_mode_mean_sqrt_len_tokens", "mean_sqrt_len"),
                 ("pooling_mode_lasttoken", "last"))
"""sentence-transformers' pooling flags, in the order its Pooling concatenates them."""
ST_POOLING_NAMES = {"cls": "cls", "mean": "mean", "max": "max", "lasttoken": "last",
                    "mean_sqrt_len_tokens": "mean_sqrt_len"}
NAME_PREFIXES = ("bert.", "roberta.", "model.")


@dataclasses.dataclass(frozen=True)
class EncoderSetup:
    """How an encoder folder is served: the HF files' folder, the model config, the pooling
    modes (empty for a cross-encoder), normalize, the input limit in tokens (special tokens
    included), lowercasing, matryoshka, and whether the tokenizer hands the model token types
    (`token_types`: False when `tokenizer_config.json`'s `model_input_names` leaves them
    out, as transformers then passes none: every type 0); prompt: the text put before every
    input text (`config_sentence_transformers.json`'s `default_prompt_name`, as `encode`
    does when given no prompt); activation: a cross-encoder's score of its logit, "sigmoid",
    "identity" or "tanh"."""

    model_folder: Path
    config: BertConfig
    pooling: tuple[str, ...]
    normalize: bool
    max_tokens: int
    lowercase: bool = False
    matryoshka: bool = False
    token_types: bool = True
    prompt: str = ""
    activation: str = "sigmoid"

    @property
    def cross_encoder(self) -> bool:
        """A sequence-classification model (pair scores), not an embedder."""
        return self.config.num_labels > 0


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read ({e})") from None


def _is_encoder_config(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return (cfg.get("model_type") in ENCODER_TYPES
            or any(a.startswith(("Bert", "Roberta", "XLMRoberta")) for a in archs))


def _transformer_folder(folder: Path) -> Path:
    """The folder of the HF files: modules.json's Transformer path, else `folder`."""
    modules = folder / "modules.json"
    if modules.is_file():
        for m in _json(modules):
            if str(m.get("type", "")).endswith(".Transformer"):
                return folder / m.get("path", "")
    return folder


def is_encoder_folder(path: Path | str) -> bool:
    """True when `path` is a folder of a BERT / RoBERTa / XLM-RoBERTa model (config
    `model_type`, or architectures Bert* / Roberta* / XLMRoberta*)."""
    path = Path(path)
    if not path.is_dir():
        return False
    config = _transformer_folder(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return _is_encoder_config(json.loads(config.read_text()))
    except (OSError, json.JSONDecodeError):
        return False


def read_bert_config(raw: dict, source: Path) -> BertConfig:
    """A `BertConfig` from a HF `config.json` dict (refusing relative positions)."""
    if not _is_encoder_config(raw):
        raise CheckpointError(f"{source}: not a BERT-family config")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"{source}: position_embedding_type "
                              f"{raw['position_embedding_type']!r} is not supported")
    archs = raw.get("architectures") or []
    classifier = any(a.endswith("ForSequenceClassification") for a in archs)
    roberta = raw.get("model_type") in ROBERTA_TYPES or any(
        a.startswith(("Roberta", "XLMRoberta")) for a in archs)
    num_labels = 0
    if classifier:
        num_labels = int(raw.get("num_labels") or len(raw.get("id2label") or {}) or 2)
    try:
        return BertConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            hidden_act=str(raw.get("hidden_act", "gelu")),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            pad_token_id=int(raw.get("pad_token_id", 1 if roberta else 0) or 0),
            roberta=roberta, num_labels=num_labels, head="roberta" if roberta else "bert")
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: missing or bad field ({e})") from None


def _pooling(folder: Path) -> tuple[tuple[str, ...], bool, Path | None]:
    """(pooling modes, normalize, sentence_bert_config folder) from modules.json."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return ("mean",), False, None
    pooling: tuple[str, ...] = ()
    normalize, st_folder = False, None
    for m in _json(modules):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        sub = folder / m.get("path", "")
        if kind == "Transformer":
            st_folder = sub
        elif kind == "Pooling":
            cfg = _json(sub / "config.json")
            if "pooling_mode" in cfg and isinstance(cfg["pooling_mode"], str):
                name = cfg["pooling_mode"]
                if name not in ST_POOLING_NAMES:
                    raise CheckpointError(f"{sub}: pooling mode {name!r} is not supported")
                pooling = (ST_POOLING_NAMES[name],)
            else:
                pooling = tuple(mode for key, mode in POOLING_MODES if cfg.get(key))
            if not pooling or cfg.get("pooling_mode_weightedmean_tokens"):
                raise CheckpointError(f"{sub}/config.json: no supported pooling mode")
        elif kind == "Normalize":
            normalize = True
        else:
            raise CheckpointError(f"{modules}: module {m.get('type')!r} is not supported")
    if not pooling:
        raise CheckpointError(f"{modules}: no Pooling module")
    return pooling, normalize, st_folder


ACTIVATIONS = {"Sigmoid": "sigmoid", "Identity": "identity", "Tanh": "tanh"}


def _score_activation(raw: dict, source: Path) -> str:
    """The activation `CrossEncoder` puts on the logit: the config's
    `sentence_transformers.activation_fn` (or the older `sbert_ce_default_activation_function`)
    by its class name, else sigmoid."""
    path = (raw.get("sentence_transformers") or {}).get("activation_fn") or raw.get(
        "sbert_ce_default_activation_function")
    if not path:
        return "sigmoid"
    name = str(path).rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise CheckpointError(f"{source}: cross-encoder activation {path!r} is not supported")
    return ACTIVATIONS[name]


def _default_prompt(path: Path) -> str:
    if not path.is_file():
        return ""
    raw = _json(path)
    name = raw.get("default_prompt_name")
    return str((raw.get("prompts") or {}).get(name, "")) if name else ""


def _matryoshka(*configs: Path) -> bool:
    for path in configs:
        if path.is_file():
            raw = _json(path)
            if raw.get("matryoshka_dimensions") or raw.get("is_matryoshka"):
                return True
    return False


def read_encoder_setup(path: Path | str) -> EncoderSetup:
    """Everything but the params about the encoder folder at `path` (see the module
    docstring). Raises `CheckpointError` for a folder that is not one, or a module or mode
    not supported."""
    folder = Path(path)
    if not is_encoder_folder(folder):
        raise CheckpointError(f"{folder}: not a BERT / RoBERTa / XLM-RoBERTa folder")
    model_folder = _transformer_folder(folder)
    raw_config = _json(model_folder / "config.json")
    cfg = read_bert_config(raw_config, model_folder / "config.json")
    activation = "sigmoid"
    if cfg.num_labels:
        if cfg.num_labels != 1:
            raise CheckpointError(f"{model_folder}/config.json: a cross-encoder with "
                                  f"{cfg.num_labels} labels has no single relevance score")
        pooling, normalize, st_folder = (), False, None
        activation = _score_activation(raw_config, model_folder / "config.json")
    else:
        pooling, normalize, st_folder = _pooling(folder)
    limit = None
    lowercase = False
    st_config = (st_folder or model_folder) / "sentence_bert_config.json"
    if st_config.is_file():
        raw = _json(st_config)
        limit = raw.get("max_seq_length")
        lowercase = bool(raw.get("do_lower_case", False))
    tok_config = model_folder / "tokenizer_config.json"
    tok_raw = _json(tok_config) if tok_config.is_file() else {}
    input_names = tok_raw.get("model_input_names")
    token_types = not isinstance(input_names, list) or "token_type_ids" in input_names
    if limit is None:
        tok_max = tok_raw.get("model_max_length")
        limit = cfg.max_position_embeddings
        if isinstance(tok_max, int | float) and tok_max < 1e9:
            limit = min(limit, int(tok_max))
    limit = min(int(limit), cfg.max_tokens)
    matryoshka = _matryoshka(folder / "config_sentence_transformers.json",
                             model_folder / "config.json")
    prompt = "" if cfg.num_labels else _default_prompt(folder / "config_sentence_transformers.json")
    return EncoderSetup(model_folder, cfg, pooling, normalize, limit, lowercase, matryoshka,
                        token_types, prompt, activation)


def _linear(w: np.ndarray) -> np.ndarray:
    """torch Linear weight `[out, in]` -> ours `[in, out]`."""
    return np.ascontiguousarray(w.T)


def _tensor_map(cfg: BertConfig) -> dict[tuple, tuple[str, Any]]:
    """Our param path -> (HF name, conversion), every encoder and head tensor."""
    E, H = cfg.hidden_size, cfg.num_attention_heads
    D = E // H
    ident = np.asarray
    table: dict[tuple, tuple[str, Any]] = {
        ("embeddings", "word"): ("embeddings.word_embeddings.weight", ident),
        ("embeddings", "position"): ("embeddings.position_embeddings.weight", ident),
        ("embeddings", "token_type"): ("embeddings.token_type_embeddings.weight", ident),
        ("embeddings", "norm", "weight"): ("embeddings.LayerNorm.weight", ident),
        ("embeddings", "norm", "bias"): ("embeddings.LayerNorm.bias", ident),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"encoder.layer.{i}."
        for ours, hf in (("q", "query"), ("k", "key"), ("v", "value")):
            table[("layers", i, "attention", f"{ours}_proj")] = (
                f"{p}attention.self.{hf}.weight", lambda w: _linear(w).reshape(E, H, D))
            table[("layers", i, "attention", f"{ours}_bias")] = (
                f"{p}attention.self.{hf}.bias", lambda b: b.reshape(H, D))
        table[("layers", i, "attention", "o_proj")] = (
            f"{p}attention.output.dense.weight", lambda w: _linear(w).reshape(H, D, E))
        table[("layers", i, "attention", "o_bias")] = (f"{p}attention.output.dense.bias", ident)
        for ours, hf in (("attention_norm", "attention.output.LayerNorm"),
                         ("ffn_norm", "output.LayerNorm")):
            table[("layers", i, ours, "weight")] = (f"{p}{hf}.weight", ident)
            table[("layers", i, ours, "bias")] = (f"{p}{hf}.bias", ident)
        table[("layers", i, "ffn", "fc1")] = (f"{p}intermediate.dense.weight", _linear)
        table[("layers", i, "ffn", "fc1_bias")] = (f"{p}intermediate.dense.bias", ident)
        table[("layers", i, "ffn", "fc2")] = (f"{p}output.dense.weight", _linear)
        table[("layers", i, "ffn", "fc2_bias")] = (f"{p}output.dense.bias", ident)
    if cfg.num_labels:
        dense, out = (("classifier.dense", "classifier.out_proj") if cfg.head == "roberta"
                      else ("pooler.dense", "classifier"))
        table[("head", "dense")] = (f"{dense}.weight", _linear)
        table[("head", "dense_bias")] = (f"{dense}.bias", ident)
        table[("head", "out")] = (f"{out}.weight", _linear)
        table[("head", "out_bias")] = (f"{out}.bias", ident)
    return table


def _canonical(name: str) -> str:
    """A tensor name without its model prefix, with old LayerNorm names renamed."""
    for prefix in NAME_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.endswith("LayerNorm.gamma"):
        name = name[:-5] + "weight"
    elif name.endswith("LayerNorm.beta"):
        name = name[:-4] + "bias"
    return name


def load_bert_params(setup: EncoderSetup, dtype: str = "float32") -> BertEncoder:
    """The `BertEncoder` of the folder with its safetensors weights in `dtype`. Raises
    `CheckpointError` naming a missing tensor or a shape that disagrees with the config."""
    cfg = setup.config
    tensors = {_canonical(k): v for k, v in read_safetensors(setup.model_folder).items()}
    graphdef, abstract = abstract_bert(cfg, jnp.dtype(dtype))
    pure = nnx.to_pure_dict(abstract)
    for path, (name, convert) in _tensor_map(cfg).items():
        if name not in tensors:
            raise CheckpointError(f"{setup.model_folder}: tensor {name} is missing")
        value = convert(np.asarray(tensors[name], np.float32))
        node = pure
        for key in path[:-1]:
            node = node[key]
        want = node[path[-1]]
        if tuple(value.shape) != tuple(want.shape):
            raise CheckpointError(f"{setup.model_folder}: {name} has shape {value.shape}, "
                                  f"the config says {want.shape}")
        node[path[-1]] = jnp.asarray(value, jnp.dtype(dtype))
    missing = [p for p, v in _flat(pure) if isinstance(v, jax.ShapeDtypeStruct)]
    if missing:
        raise CheckpointError(f"{setup.model_folder}: no tensor for {missing[0]}")
    nnx.replace_by_pure_dict(abstract, pure)
    return nnx.merge(graphdef, abstract)


def _flat(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    if isinstance(tree, dict):
        return [item for k, v in tree.items() for item in _flat(v, (*prefix, k))]
    return [(prefix, tree)]


__all__ = ["EncoderSetup", "is_encoder_folder", "load_bert_params", "read_bert_config",
           "read_encoder_setup"]
