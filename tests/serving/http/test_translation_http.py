"""A translation model (a tiny random NLLB, devtools/nllb_models.py) behind the OpenAI API.

One real server on a loopback port, started with default languages (eng_Latn -> fra_Latn):
chat translates the last user message and completions the prompt(s), with the official
`openai` client and plain HTTP; the token ids equal transformers' greedy and beam search
outputs (`generate(forced_bos_token_id=<target>)`), usage counts the source and the decoder's
two prompt tokens. Chat-only fields, unknown languages, token-id prompts and the like are 400s
in OpenAI's shape; language fields on the shared decoder-only server are 400s too.
"""

from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import (
    get_json,
    post,
    sse_events,
    start_cli_server,
    stop_cli_server,
    wait_healthy,
)

pytestmark = pytest.mark.xdist_group("translation_http")

NAME = "nllb-tiny"
MAX_NEW = 10
HELLO = "Hello world, how are you today?"
FOX = "Le renard brun rapide saute par-dessus le chien paresseux."


@pytest.fixture(scope="module")
def translator(tmp_path_factory):
    """(the server, the transformers model) on one tiny NLLB folder; the engine shapes are
    tests/scheduler/test_translation.py's (their compiled programs are shared)."""
    from devtools.nllb_models import build_nllb_folder
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    folder = tmp_path_factory.mktemp("nllb-http")
    hf = build_nllb_folder(folder)
    settings = ServerSettings(
        model=str(folder), served_model_name=NAME, port=0, max_slots=8, max_len=32,
        engine_options={"max_source_len": 64, "max_prefill_len": 16, "max_prefill_batch": 4},
        source_lang="eng_Latn", target_lang="fra_Latn", request_timeout=120.0,
        grace_period=5.0, warmup="full")
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    yield srv, hf, folder
    srv.stop()


@pytest.fixture(scope="module")
def url(translator) -> str:
    return translator[0].url


@pytest.fixture(scope="module")
def client(url):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(translator):
    return translator[0].state.runtime.tokenizer


@pytest.fixture(scope="module")
def reference(translator, tok):
    """transformers' hypotheses for (text, src, tgt): generated ids after the forced target
    language, cut after eos (one list per returned sequence)."""
    hf = translator[1]

    def generate(text: str, src: str, tgt: str, **kw) -> list[list[int]]:
        ids = torch.tensor([tok.encode_source(text, src)])
        kw.setdefault("num_beams", 1)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              forced_bos_token_id=tok.lang_id(tgt), eos_token_id=[2],
                              pad_token_id=1, max_new_tokens=MAX_NEW + 1, **kw)
        rows = out[:, 2:].tolist()
        return [row[:next((i + 1 for i, t in enumerate(row) if t == 2), len(row))]
                for row in rows]
    return generate


def _prompt_tokens(tok, text: str, src: str) -> int:
    return len(tok.encode_source(text, src)) + 2  # the source, then [</s>, target language]


def test_chat_translates_the_last_user_message(client, tok, reference, schemas):
    out = client.chat.completions.create(
        model=NAME, max_tokens=MAX_NEW, temperature=0,
        messages=[{"role": "system", "content": "You translate."},
                  {"role": "user", "content": "Der Hund."},
                  {"role": "assistant", "content": "Le chien."},
                  {"role": "user", "content": FOX}],
        extra_body={"source_lang": "fra_Latn", "target_lang": "deu_Latn",
                    "return_token_ids": True})
    schemas.chat(out.model_dump(exclude_unset=True))
    want = reference(FOX, "fra_Latn", "deu_Latn")[0]
    choice = out.choices[0]
    assert choice.token_ids == want
    assert choice.message.content == tok.decode(want, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if want[-1] == 2 else "length")
    assert out.usage.prompt_tokens == _prompt_tokens(tok, FOX, "fra_Latn")
    assert out.usage.completion_tokens == len(want)
    # Other languages give another translation: the languages reach the model.
    other = client.chat.completions.create(
        model=NAME, max_tokens=MAX_NEW, temperature=0, messages=[{"role": "user",
                                                                  "content": FOX}],
        extra_body={"src_lang": "fra_Latn", "tgt_lang": "spa_Latn", "return_token_ids": True})
    assert other.choices[0].token_ids == reference(FOX, "fra_Latn", "spa_Latn")[0]
    assert other.choices[0].token_ids != want


def test_defaults_and_text_parts(url, tok, reference, schemas):
    parts = [{"type": "text", "text": "Hello world, "}, {"type": "text",
                                                          "text": "how are you today?"}]
    status, _, body = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": parts}], "max_tokens": MAX_NEW,
        "temperature": 0, "return_token_ids": True, "response_format": {"type": "text"},
        "tool_choice": "none"})
    assert status == 200, body
    schemas.chat(body)
    want = reference(HELLO, "eng_Latn", "fra_Latn")[0]  # the server's defaults
    assert body["choices"][0]["token_ids"] == want
    # Naming one language keeps the other's default; "" means the default too.
    status, _, named = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": HELLO}], "max_tokens": MAX_NEW,
        "temperature": 0, "return_token_ids": True, "source_lang": "",
        "target_lang": "deu_Latn", "tgt_lang": "deu_Latn"})
    assert status == 200, named
    assert named["choices"][0]["token_ids"] == reference(HELLO, "eng_Latn", "deu_Latn")[0]


def test_completions_translate_each_prompt(client, tok, reference, schemas):
    texts = [HELLO, "Machine translation is useful."]
    out = client.completions.create(
        model=NAME, prompt=texts, max_tokens=MAX_NEW, temperature=0,
        extra_body={"src_lang": "eng_Latn", "tgt_lang": "deu_Latn", "return_token_ids": True})
    schemas.completion(out.model_dump(exclude_unset=True))
    wants = [reference(t, "eng_Latn", "deu_Latn")[0] for t in texts]
    assert [c.token_ids for c in out.choices] == wants
    assert [c.text for c in out.choices] == [tok.decode(w, skip_special_tokens=True)
                                             for w in wants]
    assert out.usage.prompt_tokens == sum(_prompt_tokens(tok, t, "eng_Latn") for t in texts)
    assert out.usage.completion_tokens == sum(len(w) for w in wants)


def test_beam_search_gives_the_n_best_translations(client, url, reference, schemas):
    out = client.completions.create(
        model=NAME, prompt=HELLO, max_tokens=MAX_NEW, n=3,
        extra_body={"num_beams": 4, "length_penalty": 0.6, "early_stopping": True,
                    "target_lang": "spa_Latn", "return_token_ids": True})
    schemas.completion(out.model_dump(exclude_unset=True))
    want = reference(HELLO, "eng_Latn", "spa_Latn", num_beams=4, num_return_sequences=3,
                     length_penalty=0.6, early_stopping=True)
    assert [c.token_ids for c in out.choices] == want
    assert out.usage.completion_tokens == sum(len(w) for w in want)
    status, _, body = post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": FOX}], "max_tokens": MAX_NEW, "n": 2,
        "use_beam_search": True, "source_lang": "fra_Latn", "return_token_ids": True})
    assert status == 200, body
    schemas.chat(body)
    want = reference(FOX, "fra_Latn", "fra_Latn", num_beams=2, num_return_sequences=2)
    assert [c["token_ids"] for c in body["choices"]] == want


def test_sampled_choices_with_logprobs(url, schemas):
    body = {"prompt": HELLO, "max_tokens": MAX_NEW, "n": 2, "temperature": 0.9, "seed": 5,
            "logprobs": 2, "return_token_ids": True}
    status, _, out = post(url, "/v1/completions", body)
    assert status == 200, out
    schemas.completion(out)
    assert len(out["choices"]) == 2
    for c in out["choices"]:
        assert len(c["logprobs"]["tokens"]) == len(c["token_ids"]) > 0
        assert all(len(top) <= 2 for top in c["logprobs"]["top_logprobs"])
    again = post(url, "/v1/completions", body)[2]
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"]
                                                          for c in out["choices"]]


def test_streaming_equals_the_whole_answer(client, url, tok, reference, schemas):
    want = reference(HELLO, "eng_Latn", "fra_Latn")[0]
    text = tok.decode(want, skip_special_tokens=True)
    stream = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": HELLO}], max_tokens=MAX_NEW,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    for chunk in chunks:
        schemas.chat_chunk(chunk.model_dump(exclude_unset=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.prompt_tokens == _prompt_tokens(tok, HELLO, "eng_Latn")
    assert chunks[-1].usage.completion_tokens == len(want)
    events = sse_events(url, "/v1/completions", {"prompt": HELLO, "max_tokens": MAX_NEW,
                                                 "temperature": 0, "stream": True})
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        schemas.completion_chunk(e)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text


def test_models_lists_a_translation_model(url, schemas):
    listing = get_json(url, "/v1/models")
    schemas.validate("ListModelsResponse", listing)
    card = listing["data"][0]
    assert card["id"] == NAME and card["task"] == "translation"
    info = card["translation"]
    assert (info["source_lang"], info["target_lang"]) == ("eng_Latn", "fra_Latn")
    assert {"eng_Latn", "fra_Latn", "zho_Hans"} <= set(info["languages"])
    schemas.validate("Model", get_json(url, f"/v1/models/{NAME}"))


USER = [{"role": "user", "content": HELLO}]
CHAT_400 = [
    ({"source_lang": "xxx_Latn"}, "source_lang", "xxx_Latn"),
    ({"tgt_lang": "yyy_Zzzz"}, "target_lang", "yyy_Zzzz"),
    ({"target_lang": 7}, "target_lang", "FLORES-200"),
    ({"source_lang": "eng_Latn", "src_lang": "fra_Latn"}, "source_lang", "differ"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools",
     "translation model"),
    ({"tool_choice": "required"}, "tool_choice", "translation model"),
    ({"functions": [{"name": "f"}]}, "functions", "translation model"),
    ({"response_format": {"type": "json_object"}}, "response_format", "json_object"),
    ({"regex": "[a-z]+"}, "regex", "translation model"),
    ({"enable_thinking": True}, "enable_thinking", "translation model"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs", "chat"),
    ({"reasoning_effort": "low"}, "reasoning_effort", "translation model"),
    ({"num_beams": 2, "stream": True}, "stream", "beam search"),
    ({"messages": [{"role": "user", "content": "   "}]}, "messages", "empty"),
    ({"messages": [{"role": "system", "content": "Translate."}]}, "messages", "user message"),
    ({"messages": [{"role": "user", "content": "Hello world " * 80}]}, "messages", "64"),
]


@pytest.mark.parametrize("extra, param, needle", CHAT_400)
def test_bad_chat_requests_are_400(url, schemas, extra, param, needle):
    status, _, err = post(url, "/v1/chat/completions",
                          {"messages": USER, "max_tokens": 4, **extra})
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == param and needle in err["error"]["message"], err


@pytest.mark.parametrize("extra, param, needle", [
    ({"prompt": [1, 40, 41]}, "prompt", "string"),
    ({"prompt": [[1, 40], [41]]}, "prompt", "string"),
    ({"echo": True}, "echo", "translation model"),
    ({"prompt": [HELLO, ""]}, "prompt", "empty"),
    ({"grammar": "start: \"a\""}, "grammar", "translation model"),
    ({"source_lang": "english"}, "source_lang", "english"),
])
def test_bad_completion_requests_are_400(url, schemas, extra, param, needle):
    status, _, err = post(url, "/v1/completions", {"prompt": HELLO, "max_tokens": 4, **extra})
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == param and needle in err["error"]["message"], err


def test_a_language_is_required_without_a_default(tok):
    from metrale_jax.errors import InvalidParameterError
    from serving.http.protocol import CompletionRequest
    from serving.http.translation import inputs
    req = CompletionRequest(prompt=HELLO, source_lang="eng_Latn")
    with pytest.raises(InvalidParameterError, match="--target-lang") as e:
        inputs(tok, [HELLO], req, None, None, "prompt")
    assert e.value.param == "target_lang"
    x = inputs(tok, [HELLO], req, None, "deu_Latn", "prompt")[0]
    assert x.prompt == (2, tok.lang_id("deu_Latn"))


def test_metrale_serve_passes_the_translation_flags(translator, tok, reference):
    """`metrale serve --source-lang --target-lang --max-source-len` on the same folder. The
    shapes are the fixture's, so the subprocess's warmup reads its programs from the cache."""
    long_source = " ".join([FOX] * 6)
    assert len(tok.encode(long_source, add_special_tokens=False)) > 64
    proc, cli_url = start_cli_server(
        "--model", str(translator[2]), "--served-model-name", NAME, "--max-slots", "8",
        "--max-len", "32", "--max-prefill-len", "16", "--max-source-len", "64",
        "--source-lang", "fra_Latn", "--target-lang", "eng_Latn")
    try:
        info = get_json(cli_url, "/v1/models")["data"][0]["translation"]
        assert (info["source_lang"], info["target_lang"]) == ("fra_Latn", "eng_Latn")
        status, _, body = post(cli_url, "/v1/completions", {
            "prompt": FOX, "max_tokens": MAX_NEW, "temperature": 0, "return_token_ids": True})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference(FOX, "fra_Latn", "eng_Latn")[0]
        status, _, err = post(cli_url, "/v1/completions", {"prompt": long_source})
        assert status == 400 and "at most 64 tokens" in err["error"]["message"], err
    finally:
        stop_cli_server(proc)
