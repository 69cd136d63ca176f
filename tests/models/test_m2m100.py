"""M2M100 / NLLB-200 against transformers on PyTorch (CPU, float32).

A tiny random `M2M100ForConditionalGeneration` is saved with `save_pretrained` and loaded with
`load_m2m100`; a SentencePiece BPE model trained here on a small corpus becomes an NLLB
tokenizer folder (fairseq layout: 4 specials, spm ids + 1, the 202 FLORES-200 codes, <mask>),
and transformers' `NllbTokenizer` saves its `tokenizer.json` beside. The model runs as the
engine runs it (`models/seq2seq_ragged.py`: the encoder program, then the decoder in ragged
steps over paged pools): encoder states and teacher-forced logits must agree with
transformers within 1e-4 relative; our tokenizer must give transformers' ids from either file.
"""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sentencepiece as spm
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file

from devtools.nllb_models import nllb_config, randomize, write_nllb_tokenizer
from metrale_jax.errors import CheckpointError, InvalidParameterError
from metrale_jax.models.ragged import StepLayout
from metrale_jax.models.seq2seq_ragged import (
    CrossCache,
    encode_sources,
    encoder_states,
    head,
    ragged_layers,
    split_seq2seq,
)
from metrale_jax.text.nllb import FLORES200_CODES, load_nllb_tokenizer
from metrale_jax.weights.m2m100_reader import (
    load_m2m100,
    load_m2m100_orbax,
    save_m2m100_orbax,
)
from metrale_jax.weights.safetensors_reader import read_safetensors

pytestmark = pytest.mark.xdist_group("m2m100")

PAGE = 4  # page size of the decoder's pools in the ragged steps

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


def _engine_view(model):
    """`model` as the engine holds it: (`Seq2SeqGraph`, per-layer `LayerParams`)."""
    return split_seq2seq(*nnx.split(model))


def _decode(graph, params, cross: CrossCache, dec: np.ndarray, prefix: int):
    """Teacher forcing through the engine's ragged steps: rows 0 .. B-1 prefill their first
    `prefix` decoder tokens of dec `[B, T]` as one chunk, then feed one token per decode step
    (n = B decode rows) through the paged pools. Returns (logits [B, T, V], the pools)."""
    cfg = graph.cfg
    B, T = dec.shape
    pps = -(-T // PAGE)
    table = 1 + np.arange(B * pps, dtype=np.int32).reshape(B, pps)  # page 0: the null page
    pools = tuple(jnp.zeros((1 + B * pps, PAGE, 2 * cfg.num_kv_heads, cfg.head_dim),
                            jnp.float32) for _ in range(cfg.num_layers))

    def run(pools, rows: np.ndarray, positions: np.ndarray, n: int):
        """One step: tokens dec[rows, positions], the first n of them decode rows."""
        layout = StepLayout(
            slots=jnp.asarray(table[rows, positions // PAGE] * PAGE + positions % PAGE),
            dec_table=jnp.asarray(table[:n]), dec_lens=jnp.asarray(positions[:n] + 1),
            chunk_rows=jnp.asarray(rows[n:]), page_table=jnp.asarray(table))
        x, new_pools = ragged_layers(graph, params, pools, jnp.asarray(dec[rows, positions]),
                                     jnp.asarray(positions), layout, cross, jnp.asarray(rows),
                                     n=n)
        return head(graph, params, x), new_pools

    rows = np.repeat(np.arange(B, dtype=np.int32), prefix)
    positions = np.tile(np.arange(prefix, dtype=np.int32), B)
    logits, pools = run(pools, rows, positions, 0)
    out = [np.asarray(logits).reshape(B, prefix, -1)]
    for t in range(prefix, T):
        logits, pools = run(pools, np.arange(B, dtype=np.int32), np.full(B, t, np.int32), B)
        out.append(np.asarray(logits)[:, None])
    return np.concatenate(out, axis=1), pools


def _teacher_forced(model, ids: np.ndarray, mask: np.ndarray, dec: np.ndarray, prefix: int):
    """Logits `[B, T, V]` of dec `[B, T]` given the right-padded sources ids `[B, S]`, through
    the engine's path: `encode_sources` into rows 0 .. B-1, then `_decode`. Returns (logits,
    pools, cross)."""
    graph, params = _engine_view(model)
    B, S = ids.shape
    cross = CrossCache.zeros(graph.cfg, B, S, jnp.float32)
    cross = encode_sources(graph, params, cross, jnp.arange(B, dtype=jnp.int32),
                           jnp.asarray(ids), jnp.asarray(mask.sum(1), jnp.int32))
    logits, pools = _decode(graph, params, cross, dec, prefix)
    return logits, pools, cross


def test_encoder_matches_transformers(pair, batch):
    hf, model, _, _ = pair
    ids, mask, _ = batch
    with torch.no_grad():
        ref = hf.model.encoder(input_ids=torch.tensor(ids, dtype=torch.long),
                               attention_mask=torch.tensor(mask, dtype=torch.long))
    ref = ref.last_hidden_state.numpy()
    graph, params = _engine_view(model)
    ours = np.asarray(encoder_states(graph, params, jnp.asarray(ids),
                                     jnp.asarray(mask.sum(1), jnp.int32)))
    err = _rel_err(ours[mask], ref[mask])  # pad positions are never read
    assert err <= 1e-4, f"encoder: max relative error {err:.2e}"
    np.testing.assert_allclose(ours[mask], ref[mask], rtol=1e-4, atol=1e-5)


def test_teacher_forced_logits_match_transformers(pair, batch):
    """The decoder prefix as one prefill chunk, then one token per decode step through the
    paged pools, against transformers' forward on the same decoder_input_ids."""
    hf, model, _, _ = pair
    ids, mask, dec = batch
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids, dtype=torch.long),
                 attention_mask=torch.tensor(mask, dtype=torch.long),
                 decoder_input_ids=torch.tensor(dec, dtype=torch.long)).logits.numpy()
    ours, _, _ = _teacher_forced(model, ids, mask, dec, prefix=2)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    err = _rel_err(ours, ref)
    assert err <= 1e-4, f"logits: max relative error {err:.2e}"
    np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))


def test_incremental_decode_matches_full_pass(pair, batch):
    """The prefix in one chunk, then one token per step, against the whole decoder sequence
    as one chunk: the same logits and the same keys and values in the pools."""
    _, model, cfg, _ = pair
    ids, mask, dec = batch
    T = dec.shape[1]
    steps, step_pools, cross = _teacher_forced(model, ids, mask, dec, prefix=2)
    assert len(cross.k) == cfg.decoder_layers
    assert cross.k[0].shape == (*ids.shape, 4, 16)
    full, full_pools, _ = _teacher_forced(model, ids, mask, dec, prefix=T)
    err = _rel_err(steps, full)
    assert err <= 1e-5, f"incremental decode: max relative error {err:.2e}"
    for got, want in zip(step_pools, full_pools, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


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
    for got, want in zip(jax.tree.leaves(nnx.state(again)), jax.tree.leaves(nnx.state(model)),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(_teacher_forced(again, ids, mask, dec, prefix=2)[0],
                                  _teacher_forced(model, ids, mask, dec, prefix=2)[0])
