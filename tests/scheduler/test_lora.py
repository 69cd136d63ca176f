"""LoRA adapters per request through the batching loop, against PEFT on transformers (float32).

One engine serves three adapters of a tiny random Llama at once: attention only (rank 1), MLP
only (rank 8) and every projection (rank 16, rsLoRA), padded to the engine's rank 16; a request
takes one, a weighted mix of several (llama.cpp's scales), or the scheduler's active ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from devtools.hf_models import build_hf_model, save_tiny_tokenizer
from metrale_jax import SamplingParams
from metrale_jax.errors import InvalidParameterError
from metrale_jax.scheduler import Finished, GenerationRequest, Token
from tests.weights.test_lora import ATTN, MLP, make_adapter

ADAPTERS = {"attn": (ATTN, 1, False), "mlp": (MLP, 8, False), "all": (ATTN + MLP, 16, True)}
PROMPTS = [[1, 5, 9, 33, 70, 2, 8], list(range(40, 75)), [7] * 3 + [300, 301]]


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    """The folder of the base model ("base") and the adapters (by name)."""
    return tmp_path_factory.mktemp("lora")


@pytest.fixture(scope="module")
def lora_setup(lora_root):
    """(LLM with the three adapters, {name: PEFT model}, base transformers model)."""
    from metrale_jax import LLM
    root = lora_root
    base = build_hf_model("llama", root / "base")
    save_tiny_tokenizer(root / "base")
    peft_models = {}
    for i, (name, (targets, r, rslora)) in enumerate(ADAPTERS.items()):
        fresh = build_hf_model("llama", root / f"copy-{name}")  # PEFT wraps it in place
        peft_models[name] = make_adapter(fresh, root / name, targets, r=r, alpha=r + 5,
                                         seed=10 + i, use_rslora=rslora)
    llm = LLM(root / "base", max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2,
              num_top_logprobs=5, loras={name: root / name for name in ADAPTERS})
    _ = llm.scheduler
    yield llm, peft_models, base
    llm.close()


def _reference(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1).numpy()


def _first(llm, ids, lora) -> tuple[int, list[tuple[int, float]]]:
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=5,
                                             lora=lora))[0]
    return out.token_ids[0], list(out.logprobs[0].top)


@pytest.mark.parametrize("name", [*ADAPTERS, None])
def test_first_token_logprobs_match_peft(lora_setup, name):
    llm, peft_models, base = lora_setup
    model = peft_models[name] if name else base
    for ids in PROMPTS:
        ref = _reference(model, ids)
        token, top = _first(llm, ids, name)
        assert token == int(ref.argmax())
        ids_top = [t for t, _ in top]
        assert ids_top == [int(i) for i in np.argsort(-ref)[:5]]
        np.testing.assert_allclose([lp for _, lp in top], ref[ids_top], rtol=1e-4, atol=1e-5)


def _tokens(handle) -> list[int]:
    out = []
    for event in handle:
        if isinstance(event, Token):
            out.extend(event.token_ids)
        elif not isinstance(event, Finished):
            raise AssertionError(event)
    return out


@pytest.mark.accelerator
def test_a_batch_mixing_adapters_gives_each_request_its_tokens_alone(lora_setup):
    llm, _, _ = lora_setup
    sched = llm.scheduler
    mix = [("all", 0.0), ("attn", 0.9), (None, 0.0), ("mlp", 0.8), ("all", 1.0)]

    def params(lora, temperature, seed):
        return SamplingParams(max_tokens=10, temperature=temperature, seed=seed,
                              ignore_eos=True, lora=lora)

    prompts = [PROMPTS[i % 3] + [i] for i in range(len(mix))]
    # salts keep each run from sharing pages with the others (and prove nothing else varies)
    alone = [_tokens(sched.submit(GenerationRequest.make(p, params(lo, t, i),
                                                         cache_salt=f"alone{i}")))
             for i, (p, (lo, t)) in enumerate(zip(prompts, mix, strict=True))]
    def together(assignment, tag):
        handles = [sched.submit(GenerationRequest.make(p, params(lo, t, i),
                                                       cache_salt=f"{tag}{i}"))
                   for i, (p, (lo, t)) in enumerate(zip(prompts, assignment, strict=True))]
        return [_tokens(h) for h in handles]

    assert together(mix, "mix") == alone
    # Another assignment of adapters to the same rows and shapes: adapters are data, so
    # nothing compiles (the first batch compiled what its shapes need).
    compiles = sched.engine.compile_count
    rotated = [(mix[(i + 1) % len(mix)][0], t) for i, (_, t) in enumerate(mix)]
    assert together(rotated, "rot") != alone
    assert sched.engine.compile_count == compiles
    # The adapter changes every token: the same prompt without it gives another answer.
    plain = _tokens(sched.submit(GenerationRequest.make(prompts[0], params(None, 0.0, 0),
                                                        cache_salt="plain")))
    assert plain != alone[0]


def test_pages_are_never_shared_across_adapters(lora_setup):
    llm, _, _ = lora_setup
    sched = llm.scheduler
    prompt = list(range(100, 180))

    def cached(lora) -> int:
        h = sched.submit(GenerationRequest.make(prompt, SamplingParams(max_tokens=1,
                                                                       lora=lora)))
        return list(h)[-1].cached_tokens

    assert cached("attn") == 0
    assert cached(None) == 0
    assert cached("mlp") == 0
    assert cached("attn") == 64
    # The weights are part of the key: the same adapter at another scale is another model.
    assert cached({"attn": 0.5}) == 0
    assert cached({"attn": 0.5}) == 64


def _peft_mix(root, weights: dict[str, float]):
    """A PEFT model with the adapters of `weights` all active, each update times its weight."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    names = list(weights)
    model = PeftModel.from_pretrained(build_hf_model("llama", root / "copy-mix"),
                                      root / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(root / name, adapter_name=name)
    model.base_model.set_adapter(names)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for name, w in weights.items():
                if name in module.scaling:
                    module.scaling[name] *= w
    return model.eval()


@pytest.mark.parametrize("weights", [{"attn": 0.5}, {"attn": 1.0, "mlp": 0.7},
                                     {"all": -0.6, "mlp": 1.3, "attn": 2.0}])
def test_weighted_mixes_of_adapters_match_peft(lora_setup, lora_root, weights):
    llm = lora_setup[0]
    reference = _peft_mix(lora_root, weights)
    for ids in PROMPTS[:2]:
        ref = _reference(reference, ids)
        token, top = _first(llm, ids, weights)
        assert token == int(ref.argmax())
        ids_top = [t for t, _ in top]
        np.testing.assert_allclose([lp for _, lp in top], ref[ids_top], rtol=1e-4, atol=1e-5)


def test_requests_naming_no_adapter_get_the_active_ones(lora_setup):
    llm = lora_setup[0]
    sched = llm.scheduler
    ids = PROMPTS[1]
    plain = _first(llm, ids, {})
    try:
        sched.set_active_lora({"attn": 1.0, "mlp": 0.0})
        assert sched.active_lora == (("attn", 1.0),)
        assert _first(llm, ids, None) == _first(llm, ids, "attn") != plain
        assert _first(llm, ids, {}) == plain  # an explicit empty choice: the base model
        with pytest.raises(InvalidParameterError, match="'nope' is not loaded"):
            sched.set_active_lora({"nope": 1.0})
        assert sched.active_lora == (("attn", 1.0),)  # a refusal changes nothing
        # Unloading an active adapter takes it out of the active mix at once.
        sched.load_lora("extra", llm.loras["mlp"]).result(60)
        sched.set_active_lora({"extra": 1.0, "attn": 1.0})
        assert _first(llm, ids, None) == _first(llm, ids, {"mlp": 1.0, "attn": 1.0})
        done = sched.unload_lora("extra")
        assert sched.active_lora == (("attn", 1.0),)
        done.result(60)
    finally:
        sched.set_active_lora({})
    assert _first(llm, ids, None) == plain


def test_an_unknown_adapter_is_refused(lora_setup):
    llm, _, _ = lora_setup
    with pytest.raises(InvalidParameterError, match="adapter 'nope' is not loaded.*all, attn, mlp"):
        llm.scheduler.submit(GenerationRequest.make([1, 2], SamplingParams(lora="nope")))
    with pytest.raises(InvalidParameterError, match="lora"):
        SamplingParams(lora="")
    with pytest.raises(InvalidParameterError, match="finite"):
        SamplingParams(lora={"attn": float("nan")})
    with pytest.raises(InvalidParameterError, match="lora"):
        SamplingParams(lora=3)
    with pytest.raises(InvalidParameterError, match="adapter 'nope' is not loaded"):
        llm.scheduler.submit(GenerationRequest.make([1, 2], SamplingParams(
            lora={"attn": 1.0, "nope": 0.5})))


def test_adapters_load_and_unload_while_serving_without_compiling(lora_setup):
    llm = lora_setup[0]
    sched = llm.scheduler
    adapters = {n: llm.loras[n] for n in ADAPTERS}
    ids = PROMPTS[0]
    before = {n: _first(llm, ids, n) for n in ("attn", "all")}
    compiles = sched.engine.compile_count
    # A fourth adapter fills the last slot (max_loras 4); a fifth finds none free.
    sched.load_lora("attn2", adapters["attn"]).result(60)
    assert _first(llm, ids, "attn2") == before["attn"]
    with pytest.raises(InvalidParameterError, match="all 4 LoRA slots"):
        sched.load_lora("extra", adapters["mlp"]).result(60)
    with pytest.raises(InvalidParameterError, match="already loaded"):
        sched.load_lora("attn2", adapters["mlp"]).result(60)
    # Unloading waits for the requests that use the adapter; new ones are refused at once.
    long = sched.submit(GenerationRequest.make(ids, SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, lora="attn2")))
    events = iter(long)
    assert isinstance(next(events), Token)
    done = sched.unload_lora("attn2")
    with pytest.raises(InvalidParameterError, match="being unloaded"):
        sched.submit(GenerationRequest.make(ids, SamplingParams(lora="attn2")))
    rest = list(events)
    assert isinstance(rest[-1], Finished) and rest[-1].completion_tokens == 40
    done.result(60)
    assert "attn2" not in sched.lora_slots
    with pytest.raises(InvalidParameterError, match="no LoRA adapter 'attn2'"):
        sched.unload_lora("attn2").result(60)
    # The freed slot takes another adapter; the same name again is a new adapter.
    sched.load_lora("attn2", adapters["all"]).result(60)
    assert _first(llm, ids, "attn2") == before["all"]
    sched.unload_lora("attn2").result(60)
    assert sched.engine.compile_count == compiles


@pytest.mark.parametrize("arch", ["llama3", "mistral", "qwen2", "qwen3", "gemma", "gemma2"])
def test_other_architectures_match_peft(arch, tmp_path):
    """Every other architecture we load: rope scaling (Llama 3), sliding windows (Mistral),
    q/k/v biases (Qwen2), q/k norms (Qwen3), GELU and scaled embeddings (Gemma), post norms
    and soft caps (Gemma 2): the update goes where PEFT puts it."""
    from metrale_jax import LLM
    build_hf_model(arch, tmp_path / "base")
    save_tiny_tokenizer(tmp_path / "base")
    peft_model = make_adapter(build_hf_model(arch, tmp_path / "copy"), tmp_path / "a",
                              ATTN + MLP, r=8, alpha=12, seed=5)
    llm = LLM(tmp_path / "base", max_slots=2, max_len=64, max_prefill_len=16,
              max_prefill_batch=1, num_top_logprobs=5, loras={"a": tmp_path / "a"})
    try:
        for ids in PROMPTS[:2]:
            ref = _reference(peft_model, ids[:20])
            token, top = _first(llm, ids[:20], "a")
            assert token == int(ref.argmax())
            ids_top = [t for t, _ in top]
            np.testing.assert_allclose([lp for _, lp in top], ref[ids_top], rtol=1e-4,
                                       atol=1e-5)
    finally:
        llm.close()
