"""The table of sampling fields (`metrale_jax.sampling_fields`) and every shape derived from it.

Each field is walked from a JSON body through the HTTP request model, `SamplingParams`, the
row's `SlotSettings` and `settings_to_arrays` to the device array it sets, or to the
host-side code that reads it; and each derived class is compared with the table, so a field
added to one place only fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect

import numpy as np
import pytest

from metrale_jax import SamplingParams
from metrale_jax.engine import SamplingState, SlotSettings
from metrale_jax.engine.bitmask import unpack
from metrale_jax.engine.sampling import seed_to_key
from metrale_jax.engine.state import ROW_WRITERS, settings_to_arrays
from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import (
    APIS,
    DEVICE_ARRAYS,
    FIELD,
    FIELDS,
    MAX_BAD_WORD_TOKENS,
    RESOLVED_ROWS,
    ROW_FIELDS,
    SPELLINGS,
    Bound,
    api_bound,
    spellings,
)
from metrale_jax.scheduler.request import GenerationRequest, RequestHandle
from metrale_jax.scheduler.sequence import Sequence
from metrale_jax.text import load_tokenizer
from serving.cli.sampling import add_sampling_flags, sampling_params_from_args
from serving.http.anthropic.protocol import MessagesRequest
from serving.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    SamplingRequestBase,
    parse,
)
from serving.http.responses_api.protocol import CreateResponseRequest

V = 128  # the device arrays' vocabulary in the walk (the tiny tokenizer's ids are below it)
EOS = (2,)
MESSAGES = [{"role": "user", "content": "hi"}]

# Every field: (JSON value under its OpenAI spelling, SamplingParams value, extra body fields
# it needs). A field of the table without an entry here fails `test_every_field_is_walked`.
WALK: dict[str, tuple[object, object, dict]] = {
    "max_tokens": (7, 7, {}),
    "temperature": (0.7, 0.7, {}),
    "top_k": (5, 5, {}),
    "top_p": (0.9, 0.9, {}),
    "min_p": (0.05, 0.05, {}),
    "seed": (1234, 1234, {}),
    "stop": (["END"], ("END",), {}),
    "stop_token_ids": ([5, 9], (5, 9), {}),
    "ignore_eos": (True, True, {}),
    "logprobs": (None, 3, {"logprobs": True, "top_logprobs": 3}),
    "skip_special_tokens": (False, False, {}),
    "include_stop_str_in_output": (True, True, {}),
    "repetition_penalty": (1.3, 1.3, {}),
    "presence_penalty": (0.5, 0.5, {}),
    "frequency_penalty": (-0.5, -0.5, {}),
    "logit_bias": ({"7": 2.5}, ((7, 2.5),), {}),
    "dry_multiplier": (0.8, 0.8, {}),
    "dry_base": (2.0, 2.0, {}),
    "dry_allowed_length": (3, 3, {}),
    "dry_penalty_last_n": (64, 64, {}),
    "dry_sequence_breakers": (["a"], ("a",), {"dry_multiplier": 0.5}),
    "lz_penalty": (0.2, 0.2, {}),
    "top_n_sigma": (2.0, 2.0, {}),
    "typical_p": (0.8, 0.8, {}),
    "xtc_threshold": (0.2, 0.2, {}),
    "xtc_probability": (0.5, 0.5, {}),
    "min_tokens": (2, 2, {}),
    "bad_words": (["hello world", "a"], ("hello world", "a"), {}),
    "repetition_detection": ({"max_period": 4, "min_repeats": 3}, "parsed", {}),
    "constraint": (None, "parsed", {"regex": "[ab]+"}),
    "thinking_budget": (None, "via", {"thinking_budget": 5}),
    "lora": (None, "via", {"lora": [{"id": 0, "scale": 0.5}]}),
    "num_beams": (2, 2, {}),
    "length_penalty": (0.5, 0.5, {}),
    "early_stopping": ("never", "never", {}),
    "num_return_sequences": (None, "via", {"n": 2, "num_beams": 2}),
    "speculative_tokens": (None, 2, {"speculative": {"num_tokens": 2}}),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from devtools.hf_models import save_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-tokenizer")
    save_tiny_tokenizer(folder)
    return load_tokenizer(folder)


def openai_spelling(name: str):
    return next(s for s in spellings("openai") if s.field == name)


def body_of(name: str) -> dict:
    """The chat body that sets field `name` (besides what it needs)."""
    value, _, extra = WALK[name]
    body = {"messages": MESSAGES, "max_tokens": 10, **extra}
    if value is not None:
        body[openai_spelling(name).name] = value
    return body


def params_of(body: dict) -> SamplingParams:
    req = parse(ChatCompletionRequest, body)
    req.validate_semantics()
    return req.sampling_params(req.max_new_tokens, req.num_logprobs)


def row_of(params: SamplingParams, tokenizer) -> SlotSettings:
    """The scheduler's `SlotSettings` of a request with `params` (seed 99 unless set)."""
    request = GenerationRequest((1, 2, 3), params)
    seq = Sequence(request, RequestHandle(request, on_cancel=lambda: None), tokenizer, EOS, 64)
    return seq.slot_settings(params.seed if params.seed is not None else 99)


# ---- the derived classes hold exactly the table's fields ------------------------------------


def test_every_field_is_walked():
    assert list(WALK) == [f.name for f in FIELDS]


def test_sampling_params_fields_are_the_table():
    fields = dataclasses.fields(SamplingParams)
    assert [f.name for f in fields] == [f.name for f in FIELDS]
    assert [f.default for f in fields] == [f.default for f in FIELDS]
    assert SamplingParams() == SamplingParams(**{f.name: f.default for f in FIELDS})
    for f in FIELDS:
        assert f.name in SamplingParams.__doc__


def test_slot_settings_fields_are_the_table():
    assert [f.name for f in dataclasses.fields(SlotSettings)] == [r.name for r in ROW_FIELDS]
    assert [r.name for r in ROW_FIELDS if r not in RESOLVED_ROWS] == [
        f.name for f in FIELDS if f.row]
    for r in ROW_FIELDS:  # each row field comes from table fields (or from the scheduler)
        assert set(r.sources) <= set(FIELD), r
    idle = SlotSettings()
    assert idle.temperature == 0.0, "an idle row (and SlotSettings()) is greedy"
    for f in FIELDS:
        if f.row and f.name not in ("temperature", "seed"):
            assert getattr(idle, f.name) == f.default, f.name


def test_device_arrays_are_the_table():
    assert [f.name for f in dataclasses.fields(SamplingState)] == [a.name for a in
                                                                   DEVICE_ARRAYS]
    rows = {r.name for r in ROW_FIELDS}
    assert {a.source for a in DEVICE_ARRAYS} <= rows
    # Every row field reaches the device, except the two the engine reads elsewhere.
    assert rows - {a.source for a in DEVICE_ARRAYS} == {"first_mask", "generated"}
    # Arrays of more than one number per row have a writer; the scalar ones are copied.
    assert {a.source for a in DEVICE_ARRAYS if a.shape} <= set(ROW_WRITERS)
    state = SamplingState.host_defaults(3, V)
    for a in DEVICE_ARRAYS:
        got = getattr(state, a.name)
        assert got.dtype == np.dtype(a.dtype) and got.shape[0] == 3, a.name
    padded = settings_to_arrays([], 2, V)
    for a in DEVICE_ARRAYS:  # an idle row is SlotSettings()'s row
        np.testing.assert_array_equal(getattr(padded, a.name)[0], getattr(
            settings_to_arrays([SlotSettings()], 1, V), a.name)[0])


def test_http_models_carry_every_spelling():
    base = set(SamplingRequestBase.model_fields)
    own = {s.name for s in spellings("openai") if s.own}
    # A sampling field declared by hand in the request models' base (not from the table)
    # would be a second declaration: only the fields whose JSON shape is the API's own.
    assert base & set(FIELD) <= own
    # The base's other fields are not sampling settings; a new one that is belongs in the
    # table (add it there, not here).
    assert base - own == {
        "model", "stream", "stream_options", "user", "return_token_ids", "regex", "choice",
        "grammar", "timeout", "cache_salt", "use_beam_search", "source_lang", "target_lang",
        "keep_alive",
        "priority",  # vLLM's, a request field (scheduler/waiting.py), not a sampling one
        "max_itl_ms",
        "src_lang", "tgt_lang"}
    for s in spellings("openai"):  # chat has every one; completions all but chat's own
        assert s.name in ChatCompletionRequest.model_fields, s.name
        assert s.own or s.name in CompletionRequest.model_fields, s.name
        assert not s.via or s.via in ChatCompletionRequest.model_fields or hasattr(
            ChatCompletionRequest, s.via), s
    for s in spellings("responses"):
        assert s.name in CreateResponseRequest.model_fields
    for s in spellings("anthropic"):
        assert s.name in MessagesRequest.model_fields
    assert set(SamplingRequest.model_fields) >= {s.name for s in spellings("openai")
                                                 if not s.own}
    # Every field is reachable over HTTP.
    assert {s.field for s in spellings("openai")} == set(FIELD)
    assert {s.api for s in SPELLINGS} == set(APIS)


def resolve(dotted: str):
    """The object a dotted path names (a module, or attributes of the longest module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            target = getattr(target, attr)
        return target
    raise ImportError(dotted)


def test_readers_exist_and_read_the_field():
    """Each field's reader exists; a device reader's module reads one of its arrays."""
    for f in FIELDS:
        target = resolve(f.reader)
        arrays = [a.name for a in DEVICE_ARRAYS if any(
            f.name in r.sources for r in ROW_FIELDS if r.name == a.source)]
        if f.reader.startswith("metrale_jax.engine."):
            assert arrays, f.name
            text = inspect.getsource(inspect.getmodule(target))
            assert any(f"s.{a}" in text or f"sampling.{a}" in text for a in arrays), f.name


# ---- the walk: JSON -> HTTP model -> SamplingParams -> SlotSettings -> device ------------------


def device_value(array: str, state: SamplingState) -> np.ndarray:
    return getattr(state, array)[0]


@pytest.mark.parametrize("name", list(WALK))
def test_walk_from_json_to_the_device(name, tokenizer):
    f = FIELD[name]
    body = body_of(name)
    _, expected, _ = WALK[name]
    if name == "lora":  # the handler resolves llama.cpp's [{id, scale}] to {name: weight}
        from serving.http.protocol import lora_weights
        req = parse(ChatCompletionRequest, body)
        weights = lora_weights(req.lora, {0: "adapter"})
        params = dataclasses.replace(params_of(body), lora=weights)
        assert params.lora == (("adapter", 0.5),)
        return
    if name == "thinking_budget":  # chat's field; serving/http/chat_output.py builds the spec
        assert parse(ChatCompletionRequest, body).thinking_budget == 5
        return
    if name == "num_return_sequences":  # n with beam search: serving/http/generation.py
        req = parse(ChatCompletionRequest, body)
        assert req.n == 2 and req.beams == 2
        return
    params = params_of(body)
    got = getattr(params, name)
    if expected == "parsed":
        assert got is not None and got != f.default
    else:
        assert got == expected and got != f.default, (name, got)
    if params.num_beams > 1:
        return
    row = row_of(params, tokenizer)
    state = settings_to_arrays([row], 1, V)
    idle = settings_to_arrays([row_of(SamplingParams(max_tokens=10), tokenizer)], 1, V)
    arrays = [a for a in DEVICE_ARRAYS
              if any(name in r.sources for r in ROW_FIELDS if r.name == a.source)]
    if f.row:
        assert getattr(row, name) == expected
    for a in arrays:  # every array the field sets differs from a request without it
        assert not np.array_equal(device_value(a.name, state), device_value(a.name, idle)), (
            name, a.name)
    if f.row and not DEVICE_SHAPED.get(name):
        (a,) = [a for a in DEVICE_ARRAYS if a.source == name]
        np.testing.assert_allclose(device_value(a.name, state), expected, rtol=1e-6)
    if name in DEVICE_SHAPED:
        DEVICE_SHAPED[name](state, params, tokenizer)
    if not arrays:  # a host-side field: its reader is host code
        assert not f.reader.startswith("metrale_jax.engine"), name


def _seed(state, params, tokenizer):
    np.testing.assert_array_equal(state.keys[0], seed_to_key(1234))


def _logit_bias(state, params, tokenizer):
    assert state.bias_ids[0, 0] == 7 and state.bias_values[0, 0] == 2.5
    assert (state.bias_ids[0, 1:] == V).all()


def _stop_ids(state, params, tokenizer):
    assert set(np.flatnonzero(unpack(state.stop_ids[:1], V)[0])) == {5, 9, *EOS}


def _ignore_eos(state, params, tokenizer):
    assert not np.asarray(unpack(state.stop_ids[:1], V))[0][list(EOS)].any()


def _breakers(state, params, tokenizer):
    ids = np.flatnonzero(unpack(state.dry_breakers[:1], V)[0])
    assert len(ids) and all("a" in tokenizer.decode([int(i)]) for i in ids)


def _bad_words(state, params, tokenizer):
    banned = np.flatnonzero(unpack(state.banned[:1], V)[0])
    seqs = [tuple(w[MAX_BAD_WORD_TOKENS - n:]) for w, n in zip(
        state.bad_words[0], state.bad_word_lens[0], strict=True) if n]
    words = {tokenizer.decode(list(s)).strip() for s in seqs}
    assert "a" in {tokenizer.decode([int(i)]).strip() for i in banned} and "hello world" in words


DEVICE_SHAPED = {"seed": _seed, "logit_bias": _logit_bias, "stop_token_ids": _stop_ids,
                 "ignore_eos": _ignore_eos, "dry_sequence_breakers": _breakers,
                 "bad_words": _bad_words}
"""Fields whose device arrays are not the value itself, with their own check."""


# ---- one default, one bound, one spelling table ---------------------------------------------


@pytest.mark.parametrize("field", [f for f in FIELDS if f.bound is not None],
                         ids=lambda f: f.name)
def test_bounds_are_checked_once_with_the_param_named(field):
    bad = _outside(field.bound, field.kind)
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**{field.name: bad})
    assert e.value.param == field.name
    s = openai_spelling(field.name)
    if s.own or s.via:
        return
    http_bad = _outside(api_bound(s), field.kind)
    with pytest.raises(InvalidParameterError) as e:
        parse(ChatCompletionRequest, {"messages": MESSAGES, s.name: http_bad})
    assert e.value.param == s.name and e.value.status == 400


def _outside(bound: Bound, kind: str) -> float:
    step = 1 if kind == "integer" else 0.5
    return bound.low - step if bound.low is not None else bound.high + step


def test_defaults_agree_on_every_path():
    """An HTTP body without sampling fields gives `SamplingParams()`'s defaults (chat: no
    max_tokens = to the end of the context); completions default to max_tokens 16; the CLI
    to greedy; an idle row to greedy."""
    chat = params_of({"messages": MESSAGES})
    assert chat == SamplingParams(max_tokens=None)
    completion = parse(CompletionRequest, {"prompt": "x"})
    assert completion.sampling_params(completion.max_new_tokens, None) == SamplingParams()
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=16)
    add_sampling_flags(parser)
    assert sampling_params_from_args(parser.parse_args([])) == SamplingParams(temperature=0.0)
    assert SlotSettings().temperature == 0.0 and FIELD["temperature"].default == 1.0


def test_other_apis_reach_the_same_fields():
    responses = parse(CreateResponseRequest, {"input": "hi", "temperature": 0.3, "top_p": 0.6,
                                              "max_output_tokens": 9})
    chat = responses.chat_request([])
    assert chat.sampling_params(chat.max_new_tokens, None) == SamplingParams(
        temperature=0.3, top_p=0.6, max_tokens=9)
    messages = parse(MessagesRequest, {"model": "m", "messages": MESSAGES, "max_tokens": 9,
                                       "stop_sequences": ["X"], "temperature": 0.2, "top_k": 4,
                                       "top_p": 0.5, "seed": 3, "ignore_eos": True})
    chat = messages.chat_request()
    assert chat.sampling_params(chat.max_new_tokens, None) == SamplingParams(
        max_tokens=9, stop=("X",), temperature=0.2, top_k=4, top_p=0.5, seed=3, ignore_eos=True)
    with pytest.raises(InvalidParameterError) as e:  # Anthropic's own bound
        parse(MessagesRequest, {"model": "m", "messages": MESSAGES, "max_tokens": 9,
                                "temperature": 1.5})
    assert e.value.param == "temperature"
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=16)
    add_sampling_flags(parser)
    for s in spellings("cli"):
        value = WALK[s.field][1]
        args = parser.parse_args([s.name, str(value)])
        assert getattr(sampling_params_from_args(args), s.field) == value, s.name
