"""Translation with an encoder-decoder (NLLB / M2M100) through the engine and batching loop.

A tiny random NLLB model (`devtools/nllb_models.py`) against transformers'
`M2M100ForConditionalGeneration.generate(forced_bos_token_id=<target language>)` in float32:
greedy and beam search (widths 2 to 5, length penalties, every early_stopping) give its
token ids exactly, with requests of different widths, languages and lengths side by side; a
request alone equals the same request in a batch; nothing compiles after warmup.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from metrale_jax import SamplingParams
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.scheduler import GenerationRequest

pytestmark = pytest.mark.xdist_group("translation")

TEXTS = [("Hello world, how are you today?", "eng_Latn", "fra_Latn"),
         ("Le renard brun rapide saute par-dessus le chien paresseux.", "fra_Latn", "deu_Latn"),
         ("Machine translation is useful.", "eng_Latn", "spa_Latn"),
         ("Der Hund.", "deu_Latn", "eng_Latn")]
MAX_NEW = 10


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """(an LLM on a tiny NLLB model, warmed up; the transformers model)."""
    from devtools.nllb_models import build_nllb_folder
    from metrale_jax import LLM
    folder = tmp_path_factory.mktemp("nllb")
    hf = build_nllb_folder(folder)
    llm = LLM(folder, max_slots=8, max_len=32, max_source_len=64, max_prefill_len=16,
              max_prefill_batch=4, source_lang="eng_Latn", target_lang="fra_Latn",
              warmup=True)
    _ = llm.scheduler
    yield llm, hf
    llm.close()


def _reference(hf, tok, text, src, tgt, eos, **kw) -> tuple[list[list[int]], np.ndarray | None]:
    """transformers' hypotheses (generated ids after the forced language, cut after eos)."""
    ids = torch.tensor([tok.encode_source(text, src)])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          forced_bos_token_id=tok.lang_id(tgt), eos_token_id=eos,
                          pad_token_id=1, output_scores=True, return_dict_in_generate=True,
                          **kw)
    seqs = []
    for row in out.sequences[:, 2:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        seqs.append(row[:cut])
    scores = getattr(out, "sequences_scores", None)
    return seqs, None if scores is None else scores.numpy()


def _stop_token(llm, hf) -> int:
    """A token the model generates for the first text (not its first one): with it as an eos
    id, hypotheses end early and the finished-hypothesis bookkeeping is exercised."""
    text, src, tgt = TEXTS[0]
    seqs, _ = _reference(hf, llm.tokenizer, text, src, tgt, [2], max_new_tokens=MAX_NEW + 1,
                         num_beams=1)
    return seqs[0][3]


def test_greedy_translations_equal_transformers(nllb):
    llm, hf = nllb
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    outs = [llm.translate(text, src, tgt, params)[0] for text, src, tgt in TEXTS[:1]]
    outs += [c for (text, src, tgt) in TEXTS[1:]
             for c in llm.translate([text], src, tgt, params)]
    seen = set()
    for (text, src, tgt), out in zip(TEXTS, outs, strict=True):
        want, _ = _reference(hf, llm.tokenizer, text, src, tgt, [2],
                             max_new_tokens=MAX_NEW + 1, num_beams=1)
        assert list(out.token_ids) == want[0]
        assert out.prompt_tokens == len(llm.tokenizer.encode_source(text, src)) + 2
        seen.add(tuple(out.token_ids))
    assert len(seen) > 1, "every source translates the same: the model tests nothing"


CASES = [(2, 1.0, False), (4, 0.6, True), (5, 2.0, False), (4, 1.0, "never"), (2, 0.6, True),
         (5, 1.0, True)]


def test_beam_search_equals_transformers_side_by_side(nllb):
    llm, hf = nllb
    stop = _stop_token(llm, hf)
    # Every case for every text, all in flight together (8 rows: widths queue and mix).
    jobs = [(text, src, tgt, case) for case in CASES for text, src, tgt in TEXTS[:3]]
    handles = []
    for text, src, tgt, (w, lp, es) in jobs:
        x = _inputs(llm, text, src, tgt)
        params = SamplingParams(max_tokens=MAX_NEW, num_beams=w, length_penalty=lp,
                                early_stopping=es, num_return_sequences=w,
                                stop_token_ids=[stop])
        handles.append(llm.scheduler.submit(GenerationRequest.make(x.prompt, params,
                                                                   source=x.source)))
    from metrale_jax.completion import collect
    stopped = 0
    for (text, src, tgt, (w, lp, es)), h in zip(jobs, handles, strict=True):
        out = collect(h)
        want, scores = _reference(hf, llm.tokenizer, text, src, tgt, [2, stop], num_beams=w,
                                  num_return_sequences=w, length_penalty=lp,
                                  early_stopping=es, max_new_tokens=MAX_NEW + 1)
        assert [list(b.token_ids) for b in out.beams] == want, (w, lp, es, text)
        np.testing.assert_allclose([b.score for b in out.beams], scores, rtol=1e-5)
        assert list(out.token_ids) == want[0]
        stopped += sum(b.finish_reason == "stop" for b in out.beams)
    assert stopped, "no hypothesis ended on eos or the stop token: the test tests less"


def _inputs(llm, text, src, tgt):
    from metrale_jax.text.translation import translation_inputs
    return translation_inputs(llm.tokenizer, text, src, tgt)


def test_a_request_alone_equals_it_in_a_batch_and_nothing_compiles(nllb):
    llm, _ = nllb
    engine = llm.scheduler.engine
    before = engine.compile_count
    beam = SamplingParams(max_tokens=MAX_NEW, num_beams=3, num_return_sequences=2)
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.95, seed=11)
    alone_beam = llm.translate(TEXTS[1][0], "fra_Latn", "deu_Latn", beam)[0]
    alone_sampled = llm.translate(TEXTS[2][0], "eng_Latn", "spa_Latn", sampled)[0]
    crowd = [SamplingParams(max_tokens=MAX_NEW, num_beams=4),
             SamplingParams(max_tokens=MAX_NEW, temperature=0.7, seed=3)]
    handles = []
    for params, (text, src, tgt) in [(crowd[0], TEXTS[0]), (beam, TEXTS[1]),
                                     (sampled, TEXTS[2]), (crowd[1], TEXTS[3])]:
        x = _inputs(llm, text, src, tgt)
        handles.append(llm.scheduler.submit(GenerationRequest.make(x.prompt, params,
                                                                   source=x.source)))
    from metrale_jax.completion import collect
    outs = [collect(h) for h in handles]
    assert [b.token_ids for b in outs[1].beams] == [b.token_ids for b in alone_beam.beams]
    assert outs[2].token_ids == alone_sampled.token_ids
    assert engine.compile_count == before


def test_defaults_and_bad_input(nllb):
    llm, _ = nllb
    params = SamplingParams(max_tokens=4, temperature=0)
    default = llm.translate(TEXTS[0][0], sampling_params=params)[0]  # eng_Latn -> fra_Latn
    named = llm.translate(TEXTS[0][0], "eng_Latn", "fra_Latn", params)[0]
    assert default.token_ids == named.token_ids
    with pytest.raises(InvalidParameterError, match="xxx_Latn") as e:
        llm.translate("Hello", "xxx_Latn", "fra_Latn", params)
    assert e.value.param == "source_lang"
    with pytest.raises(InvalidParameterError, match="empty"):
        llm.translate("   ", "eng_Latn", "fra_Latn", params)
    with pytest.raises(ContextLengthError, match="source"):
        llm.translate("Hello world " * 80, "eng_Latn", "fra_Latn", params)
    with pytest.raises(InvalidParameterError, match="translate"):
        llm.generate("Hello", params)
