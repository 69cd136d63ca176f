"""Tiny random BERT-family models saved by transformers (and sentence-transformers), for the
encoder pooler's tests.

- `build_bert_embedder(folder, pooling, normalize)`: a `BertModel` wrapped in a
  sentence-transformers folder (`modules.json`, `1_Pooling/config.json`, Normalize,
  `sentence_bert_config.json` with `max_seq_length`), saved by `SentenceTransformer.save`.
- `build_xlm_roberta(folder)`: a bare `XLMRobertaModel` folder (no modules.json), or an
  `XLMRobertaForSequenceClassification` cross-encoder.
- `build_bert_cross_encoder(folder)`: a `BertForSequenceClassification` with one label.
Each has a small word-piece `tokenizer.json` (BERT's or RoBERTa's post-processor) and
weights drawn large enough that different texts get clearly different vectors. float32.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

WORD_TEXT = """the a an of to in is are was be and or not for on with as by at from this that
it he she they we you i my your our their cat dog fox bird fish tree river city paris london
rain sun weather music book read write model text query document search answer question good
bad fast slow big small red blue green quick brown lazy jump over run walk eat drink water
coffee tea day night time year"""
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789"
PUNCT = ".,!?;:'\"()-"
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
SIZE = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64)


def _vocab(specials: list[str]) -> dict[str, int]:
    tokens = [*specials, *PUNCT, *LETTERS, *(f"##{c}" for c in LETTERS), *WORD_TEXT.split()]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}


def _tokenizer(roberta: bool, max_length: int) -> transformers.PreTrainedTokenizerFast:
    specials = ROBERTA_SPECIALS if roberta else BERT_SPECIALS
    unk = "<unk>" if roberta else "[UNK]"
    vocab = _vocab(specials)
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    if roberta:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        names = dict(bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>",
                     pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        # BERT's tokenizers hand the model token types (pairs: 1 for the second text)
        names = dict(cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                     unk_token="[UNK]", mask_token="[MASK]",
                     model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length,
                                                **names)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that texts differ: linears and embeddings N(0, 0.2²), biases
    N(0, 0.1²), LayerNorm weights 1 + N(0, 0.2²)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "LayerNorm.weight" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def _save_hf(model: torch.nn.Module, tokenizer: transformers.PreTrainedTokenizerFast,
             folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def build_bert_embedder(folder: Path | str, pooling: str = "mean", normalize: bool = True,
                        max_seq_length: int = 32, seed: int = 0) -> Path:
    """A sentence-transformers folder over a tiny `BertModel` (position table 64): `pooling`
    "mean" | "cls" | "max" | "lasttoken", a Normalize module when `normalize`, inputs of up
    to `max_seq_length` tokens."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    folder = Path(folder)
    hf = folder / "hf"
    config = transformers.BertConfig(**SIZE, max_position_embeddings=64, type_vocab_size=2)
    model = transformers.BertModel(config, add_pooling_layer=False)
    _randomize(model, seed)
    _save_hf(model, _tokenizer(False, 512), hf)
    transformer = Transformer(str(hf), max_seq_length=max_seq_length)
    modules = [transformer, Pooling(SIZE["hidden_size"], pooling)]
    if normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(folder / "st"))
    return folder / "st"


def build_xlm_roberta(folder: Path | str, max_length: int = 40, seed: int = 1,
                      classifier: bool = False) -> Path:
    """A bare `XLMRobertaModel` folder (position table 66, pad id 1, one token type; inputs of
    up to `max_length` tokens by its tokenizer); with `classifier`, an
    `XLMRobertaForSequenceClassification` with one label instead (a cross-encoder)."""
    folder = Path(folder)
    config = transformers.XLMRobertaConfig(**SIZE, max_position_embeddings=66,
                                           type_vocab_size=1, pad_token_id=1, bos_token_id=0,
                                           eos_token_id=2, num_labels=1)
    model = (transformers.XLMRobertaForSequenceClassification(config) if classifier
             else transformers.XLMRobertaModel(config, add_pooling_layer=False))
    _randomize(model, seed)
    _save_hf(model, _tokenizer(True, max_length), folder)
    return folder


def build_bert_cross_encoder(folder: Path | str, max_length: int = 32, seed: int = 2) -> Path:
    """A `BertForSequenceClassification` folder with one label (position table 64; pairs of
    up to `max_length` tokens by its tokenizer)."""
    folder = Path(folder)
    config = transformers.BertConfig(**SIZE, max_position_embeddings=64, type_vocab_size=2,
                                     num_labels=1)
    model = transformers.BertForSequenceClassification(config)
    _randomize(model, seed)
    _save_hf(model, _tokenizer(False, max_length), folder)
    return folder


__all__ = ["build_bert_cross_encoder", "build_bert_embedder", "build_xlm_roberta"]
