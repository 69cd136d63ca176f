"""The real Gemma 3 270M (Q4_K_M GGUF, `metrale pull gemma3-270m`) against transformers.

transformers loads the same GGUF in float32 (its own GGUF reader and Gemma 3 code); our
engine serves it with the sliding layers' rings (window 512). Greedy tokens and the top-20
log-probabilities of each prompt's first token agree, for a prompt inside the window and
one longer than it (the rings wrapped). Skipped where the model is not pulled (CI pulls only
the default model: loading this one in transformers alone takes ~90 s there).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gemma3_model, pytest.mark.xdist_group("gemma3-model")]

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_path():
    from metrale_jax.weights.default_model import model_path
    path = model_path("gemma3-270m")
    if not path.is_file():
        pytest.skip(f"Gemma 3 270M not in {path}; run `metrale pull gemma3-270m`")
    return path


@pytest.fixture(scope="module")
def pair(gemma3_path):
    import torch
    from transformers import AutoModelForCausalLM

    from metrale_jax import LLM
    hf = AutoModelForCausalLM.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name,
                                              dtype=torch.float32).eval()
    llm = LLM("gemma3-270m", max_slots=2, max_len=1024, max_prefill_len=256,
              num_top_logprobs=20)
    yield hf, llm
    llm.close()


def test_greedy_tokens_and_top20_logprobs_equal_transformers(pair):
    import torch

    from metrale_jax import SamplingParams
    hf, llm = pair
    engine = llm.scheduler.engine
    assert engine.window_columns > 0  # the sliding layers keep rings
    tok = llm.checkpoint.tokenizer
    rng = np.random.default_rng(0)
    short = tok.encode("The capital of France is Paris. The capital of Germany is")
    long = [2, *rng.integers(1000, 200_000, 700).tolist()]  # past the 512-token window
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=20,
                            ignore_eos=True)
    for ids in (short, long):
        out = llm.generate([ids], params)[0]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              eos_token_id=None, pad_token_id=0)
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        assert list(out.token_ids) == ref[0, len(ids):].tolist(), len(ids)
        want = torch.log_softmax(logits, -1).topk(20)
        first = out.logprobs[0]
        got_ids = [t for t, _ in first.top]
        got_lp = np.array([lp for _, lp in first.top])
        assert got_ids[:5] == want.indices[:5].tolist()
        np.testing.assert_allclose(got_lp, want.values.numpy(), rtol=0, atol=2e-3)
        # the global layers' pool holds the row's positions; the rings stay W pages a row
        assert engine.pages.free_pages == engine.pages.usable_pages  # all returned after
