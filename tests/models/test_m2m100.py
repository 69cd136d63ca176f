"""M2M100 / NLLB-200 against transformers on PyTorch (CPU, float32).

A tiny random `M2M100ForConditionalGeneration` is saved with `save_pretrained` and loaded with
`load_m2m100`; a SentencePiece BPE model trained here on a small corpus becomes an NLLB
tokenizer folder (fairseq layout: 4 specials, spm ids + 1, the 202 FLORES-200 codes, <mask>),
and transformers' `NllbTokenizer` saves its `tokenizer.json` beside. Encoder states and
teacher-forced logits must agree within 1e-4 relative; our tokenizer must give transformers'
ids from either file.
"""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
from safetensors.numpy import save_file

from devtools.nllb_models import nllb_config, randomize, write_nllb_tokenizer
from metrale_jax.errors import CheckpointError, InvalidParameterError
from metrale_jax.models.m2m100 import DecoderCache
from metrale_jax.text.nllb import FLORES200_CODES, load_nllb_tokenizer
from metrale_jax.weights.m2m100_reader import (
    load_m2m100,
    load_m2m100_orbax,
    save_m2m100_orbax,
)
from metrale_jax.weights.safetensors_reader import read_safetensors

pytestmark = pytest.mark.xdist_group("m2m100")

SENTENCES = [
    ("Hello world, how are you?", "eng_Latn"),
    ("Le chien saute par-dessus le renard.", "fra_Latn"),
    ("Der Hund springt über den Fuchs.", "deu_Latn"),
    ("  extra   spaces,  trailing ", "spa_Latn"),
    ("text with a code fra_Latn inside and a <mask> too", "zul_Latn"),
]


@pytest.fixture(scope="module")
def tok_folders(tmp_path_factory):
    """(spm folder, tokenizer.json folder, SentencePiece piece count): the spm folder as the
    Hub's NLLB folders are laid out (tokenizer_config.json places the codes), the other what
    transformers saves from it."""
    spm_dir = tmp_path_factory.mktemp("nllb_spm")
    pieces = write_nllb_tokenizer(spm_dir, with_json=False)
    json_dir = tmp_path_factory.mktemp("nllb_json")
    transformers.NllbTokenizer.from_pretrained(spm_dir).save_pretrained(json_dir)
    assert (json_dir / "tokenizer.json").is_file()
    return spm_dir, json_dir, pieces


@pytest.fixture(scope="module")
def pair(tok_folders, tmp_path_factory):
    """(transformers model, our model, our config, model folder)."""
    _, _, pieces = tok_folders
    folder = tmp_path_factory.mktemp("m2m100")
    # NLLB's scaled embeddings and a 64-position table, as the Hub's config (not the generation
    # tests' unscaled one)
    config = nllb_config(pieces, max_position_embeddings=64, scale_embedding=True)
    hf = transformers.M2M100ForConditionalGeneration(config).eval()
    randomize(hf, seed=0, scale=0.1)
    hf.save_pretrained(folder)
    model, cfg, generation = load_m2m100(folder)
    assert generation["decoder_start_token_id"] == 2
    return hf, model, cfg, folder


@pytest.fixture(scope="module")
def batch(tok_folders):
    """A right-padded batch of two sources of different lengths and their decoder inputs."""
    _, json_dir, _ = tok_folders
    tok = load_nllb_tokenizer(json_dir)
    sources = [tok.encode_source("Hello world, how are you today?", "eng_Latn"),
               tok.encode_source("Le chien saute.", "fra_Latn")]
    S = max(map(len, sources))
    ids = np.full((2, S), tok.pad_token_id, np.int32)
    for b, src in enumerate(sources):
        ids[b, :len(src)] = src
    mask = ids != tok.pad_token_id
    assert not mask.all()
    rng = np.random.default_rng(0)
    dec = np.stack([tok.decoder_prefix(lang) + list(rng.integers(4, 140, size=6))
                    for lang in ("fra_Latn", "deu_Latn")]).astype(np.int32)
    return ids, mask, dec


def _rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def test_encoder_matches_transformers(pair, batch):
    hf, model, _, _ = pair
    ids, mask, _ = batch
    with torch.no_grad():
        ref = hf.model.encoder(input_ids=torch.tensor(ids, dtype=torch.long),
                               attention_mask=torch.tensor(mask, dtype=torch.long))
    ref = ref.last_hidden_state.numpy()
    ours = np.asarray(model.encode(jnp.asarray(ids), jnp.asarray(mask)))
    err = _rel_err(ours[mask], ref[mask])  # pad positions are never read
    assert err <= 1e-4, f"encoder: max relative error {err:.2e}"
    np.testing.assert_allclose(ours[mask], ref[mask], rtol=1e-4, atol=1e-5)


def test_teacher_forced_logits_match_transformers(pair, batch):
    hf, model, _, _ = pair
    ids, mask, dec = batch
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
    ours = np.asarray(model.forward(jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(dec)))
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    err = _rel_err(ours, ref)
    assert err <= 1e-4, f"logits: max relative error {err:.2e}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_incremental_decode_matches_full_pass(pair, batch):
    """The prefix in one step into a cache, then one token per step."""
    _, model, cfg, _ = pair
    ids, mask, dec = batch
    enc_mask = jnp.asarray(mask)
    cross = model.cross_kv(model.encode(jnp.asarray(ids), enc_mask))
    assert cross.k.shape == (cfg.decoder_layers, *ids.shape, 4, 16)
    B, T = dec.shape
    full, full_cache = model.decode(jnp.asarray(dec), jnp.broadcast_to(jnp.arange(T), (B, T)),
                                    cross, enc_mask)
    cache = DecoderCache.zeros(cfg, B, T + 3)
    first, cache = model.decode(jnp.asarray(dec[:, :2]), jnp.broadcast_to(jnp.arange(2), (B, 2)),
                                cross, enc_mask, cache)
    steps = [np.asarray(first)]
    for t in range(2, T):
        logits, cache = model.decode(jnp.asarray(dec[:, t:t + 1]), jnp.full((B, 1), t), cross,
                                     enc_mask, cache)
        steps.append(np.asarray(logits))
    err = _rel_err(np.concatenate(steps, axis=1), np.asarray(full))
    assert err <= 1e-5, f"incremental decode: max relative error {err:.2e}"
    np.testing.assert_allclose(np.asarray(cache.k[:, :, :T]), np.asarray(full_cache.k),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["json", "spm"])
def test_tokenizer_matches_transformers(tok_folders, kind):
    spm_dir, json_dir, pieces = tok_folders
    folder = json_dir if kind == "json" else spm_dir
    ours = load_nllb_tokenizer(folder)
    ref = transformers.NllbTokenizer.from_pretrained(folder)
    assert ours.lang_codes() == list(FLORES200_CODES)
    assert ours.lang_id("ace_Arab") == pieces + 1
    assert ours.lang_id("zul_Latn") == pieces + len(FLORES200_CODES)
    for text, lang in SENTENCES:
        ref.src_lang = lang
        want = ref(text).input_ids
        got = ours.encode_source(text, lang)
        assert got == want, (kind, text, lang)
        assert got[0] == ours.lang_id(lang) == ref.convert_tokens_to_ids(lang)
        assert ours.decode(got, skip_special_tokens=True) == ref.decode(
            want, skip_special_tokens=True)
        assert ours.decode(got) == ref.decode(want)
        assert ours.decoder_prefix(lang) == [2, ref.convert_tokens_to_ids(lang)]
    sp = spm.SentencePieceProcessor(model_file=str(spm_dir / "sentencepiece.bpe.model"))
    plain = "The lazy dog jumps."  # fairseq's offset: every piece id + 1
    assert ours.encode(plain, add_special_tokens=False) == [i + 1 for i in sp.encode(plain)]


def test_unknown_language_code(tok_folders):
    tok = load_nllb_tokenizer(tok_folders[0])
    with pytest.raises(InvalidParameterError, match=r"'xx_Latn'.*lang_codes\(\)"):
        tok.lang_id("xx_Latn")
    with pytest.raises(InvalidParameterError, match="'english'"):
        tok.encode_source("Hello", "english")


def test_missing_or_misshaped_tensor(pair, tmp_path):
    _, _, _, folder = pair
    tensors = read_safetensors(folder)
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    missing = "model.decoder.layers.1.encoder_attn.out_proj.bias"
    save_file({k: v for k, v in tensors.items() if k != missing},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        load_m2m100(tmp_path)
    bad = "model.encoder.layers.0.fc1.weight"
    save_file({**tensors, bad: tensors[bad][:, :10]}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=bad.replace(".", r"\.") + ".*shape"):
        load_m2m100(tmp_path)


def test_orbax_round_trip(pair, batch, tok_folders, tmp_path):
    _, model, cfg, _ = pair
    ids, mask, dec = batch
    dst = save_m2m100_orbax(model, tmp_path / "ckpt", generation_config={"max_length": 200},
                            tokenizer_folder=tok_folders[1])
    again, cfg2, generation = load_m2m100_orbax(dst)
    assert cfg2 == cfg and generation == {"max_length": 200}
    assert (dst / "tokenizer" / "tokenizer.json").is_file()
    args = (jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(dec))
    np.testing.assert_array_equal(np.asarray(again.forward(*args)),
                                  np.asarray(model.forward(*args)))
