"""A tiny random NLLB (M2M100) translation model with a real NLLB tokenizer, for tests.

`build_nllb_folder(folder)` trains a SentencePiece BPE model on a small corpus, lays it out as
the Hub's NLLB folders are (4 fairseq specials, spm ids + 1, the 202 FLORES-200 codes,
<mask>; `tokenizer_config.json` places them), lets transformers' `NllbTokenizer` save its
`tokenizer.json` beside, and saves a tiny random `M2M100ForConditionalGeneration` there with
weights large enough that the next token depends on the source (transformers' 0.02 init
makes every source translate the same, and so do scaled embeddings: the generation tests use
`scale_embedding=False`; the teacher-forced tests in `tests/models/test_m2m100.py` cover
the scale). One folder: `LLM(folder)` and
`M2M100ForConditionalGeneration.from_pretrained(folder)` both load it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import sentencepiece as spm
import torch
import transformers

from metrale_jax.text.nllb import FLORES200_CODES

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "Hello world, how are you today?",
    "Bonjour le monde, comment allez-vous aujourd'hui ?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "El rápido zorro marrón salta sobre el perro perezoso.",
    "Translation models map sentences between many languages.",
    "Les modèles de traduction relient les langues du monde.",
    "Machine translation is useful for reading news in other languages.",
    "La traduction automatique est utile pour lire les nouvelles.",
]


def _added(content: str, **kw) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True, **kw}


def write_nllb_tokenizer(folder: Path, with_json: bool = True) -> int:
    """Writes an NLLB tokenizer into `folder` (`sentencepiece.bpe.model`,
    `tokenizer_config.json`, and transformers' `tokenizer.json` when `with_json`); returns
    the SentencePiece piece count n (language codes are ids n + 1 ..)."""
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS * 3), model_writer=buf, vocab_size=150, model_type="bpe",
        character_coverage=1.0, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    pieces = spm.SentencePieceProcessor(model_proto=buf.getvalue()).get_piece_size()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sentencepiece.bpe.model").write_bytes(buf.getvalue())
    decoder = {str(i): _added(t) for i, t in enumerate(("<s>", "<pad>", "</s>", "<unk>"))}
    for i, code in enumerate(FLORES200_CODES):
        decoder[str(pieces + 1 + i)] = _added(code)
    decoder[str(pieces + 1 + len(FLORES200_CODES))] = _added("<mask>", lstrip=True,
                                                             normalized=True)
    config = {"tokenizer_class": "NllbTokenizer", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<pad>", "sep_token": "</s>",
              "cls_token": "<s>", "mask_token": "<mask>", "legacy_behaviour": False,
              "additional_special_tokens": list(FLORES200_CODES),
              "added_tokens_decoder": decoder, "model_max_length": 1024}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if with_json:
        transformers.NllbTokenizer.from_pretrained(folder).save_pretrained(folder)
    return pieces


def nllb_config(pieces: int, **overrides) -> transformers.M2M100Config:
    """A tiny M2M100 config whose vocabulary holds the tokenizer's ids (+ 2 padding ids, as
    NLLB's config has)."""
    kw = dict(vocab_size=pieces + 1 + len(FLORES200_CODES) + 1 + 2, d_model=64,
              encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
              max_position_embeddings=128, dropout=0.0, attention_dropout=0.0,
              activation_dropout=0.0, decoder_start_token_id=2, scale_embedding=False)
    kw.update(overrides)
    return transformers.M2M100Config(**kw)


def randomize(model: torch.nn.Module, seed: int = 0, scale: float = 0.3) -> None:
    """Fills every weight with N(0, scale) (layer norm weights 1 + N(0, 0.2))."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(scale * torch.randn_like(p))


def build_nllb_folder(folder: Path, seed: int = 0,
                      **overrides) -> transformers.M2M100ForConditionalGeneration:
    """A tiny NLLB model and its tokenizer saved into `folder`; returns the transformers
    model (eval mode, float32). `overrides` change the `M2M100Config`."""
    pieces = write_nllb_tokenizer(folder)
    model = transformers.M2M100ForConditionalGeneration(nllb_config(pieces, **overrides))
    randomize(model, seed)
    model.eval()
    model.generation_config.max_length = 200
    model.save_pretrained(folder)
    return model
