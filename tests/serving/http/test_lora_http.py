"""LoRA adapters over HTTP. vLLM's convention: listed by /v1/models with their parent, picked
by `model`, answered as PEFT answers; unknown names are refused in OpenAI's shape. llama.cpp's:
a request's `lora` list of ids and scales, and the active adapters of GET/POST /lora-adapters
that a request naming none is served with."""

from __future__ import annotations

import pytest
import torch

from devtools.hf_models import build_hf_model, save_tiny_tokenizer
from tests.serving.conftest import get_json, post, wait_healthy
from tests.weights.test_lora import ATTN, MLP, make_adapter

BASE = "tiny-base"


@pytest.fixture(scope="module")
def lora_server(tmp_path_factory):
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    root = tmp_path_factory.mktemp("lora-http")
    base = build_hf_model("llama", root / "base")
    save_tiny_tokenizer(root / "base")
    peft_model = make_adapter(build_hf_model("llama", root / "copy"), root / "sql",
                              ATTN + MLP, r=8, alpha=12, seed=3)
    settings = ServerSettings(
        model=str(root / "base"), served_model_name=BASE, port=0, max_slots=4, max_len=128,
        engine_options={"max_prefill_len": 32, "max_loras": 2, "max_lora_rank": 8},
        loras={"sql": str(root / "sql")}, warmup=False, enable_lora_runtime_updates=True)
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    yield srv, base, peft_model, root
    srv.stop()


def _reference_token(model, ids: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def test_models_lists_the_adapter_with_its_parent(lora_server, schemas):
    srv = lora_server[0]
    listing = get_json(srv.url, "/v1/models")
    cards = {c["id"]: c for c in listing["data"]}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"]["parent"] == BASE and cards[BASE]["parent"] is None
    assert get_json(srv.url, "/v1/models/sql")["root"].endswith("sql")


def test_the_model_field_picks_the_adapter(lora_server):
    import openai
    srv, base, peft_model, _ = lora_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ids = [1, 40, 41, 42, 43, 9, 77]
    answers = {}
    for model, reference in (("sql", peft_model), (BASE, base)):
        out = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                        extra_body={"return_token_ids": True})
        answers[model] = out.choices[0].token_ids[0]
        assert answers[model] == _reference_token(reference, ids)
    assert answers["sql"] != answers[BASE]


def test_an_unknown_model_is_refused_naming_the_adapters(lora_server, schemas):
    srv = lora_server[0]
    status, _, body = post(srv.url, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 404  # as for any unknown model (OpenAI's and vLLM's status)
    schemas.error(body)
    assert "sql" in body["error"]["message"] and body["error"]["code"] == "model_not_found"


def test_adapters_load_and_unload_at_runtime(lora_server, schemas):
    srv, _, _, root = lora_server
    url = srv.url
    status, _, body = post(url, "/v1/load_lora_adapter",
                           {"lora_name": "sql2", "lora_path": str(root / "sql")})
    assert status == 200 and body["status"] == "loaded", body
    assert "sql2" in {c["id"] for c in get_json(url, "/v1/models")["data"]}
    out = {m: post(url, "/v1/completions", {"model": m, "prompt": [1, 40, 41], "max_tokens": 3,
                                            "temperature": 0, "return_token_ids": True})
           for m in ("sql", "sql2")}
    assert out["sql"][0] == out["sql2"][0] == 200
    assert out["sql"][2]["choices"][0]["token_ids"] == out["sql2"][2]["choices"][0]["token_ids"]
    # Both slots hold adapters (max_loras 2): a third is refused, in OpenAI's shape.
    errors = [
        ({"lora_name": "third", "lora_path": str(root / "sql")}, "all 2 LoRA slots"),
        ({"lora_name": "sql", "lora_path": str(root / "sql")}, "already loaded"),
        ({"lora_name": "x", "lora_path": str(root / "nowhere")}, "no adapter folder"),
        ({"lora_name": "x", "lora_path": str(root / "base")}, "no adapter_config.json"),
        ({"lora_name": "x"}, "lora_path"),
    ]
    for body_in, needle in errors:
        status, _, err = post(url, "/v1/load_lora_adapter", body_in)
        assert status == 400, (body_in, err)
        schemas.error(err)
        assert needle in err["error"]["message"], err
    status, _, body = post(url, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert status == 200 and body["status"] == "unloaded"
    assert "sql2" not in {c["id"] for c in get_json(url, "/v1/models")["data"]}
    status, _, err = post(url, "/v1/completions", {"model": "sql2", "prompt": "hi"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    status, _, err = post(url, "/v1/unload_lora_adapter", {"lora_name": "sql2"})
    assert status == 400 and "no LoRA adapter 'sql2'" in err["error"]["message"]


def _answer(client, model: str, ids: list[int], **extra) -> int:
    out = client.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0,
                                    extra_body={"return_token_ids": True, **extra})
    return out.choices[0].token_ids[0]


def test_llama_cpp_lora_lists_and_active_adapters(lora_server, schemas):
    import openai
    srv, base, peft_model, root = lora_server
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    ids = [1, 40, 41, 42, 43, 9, 77]
    listed = get_json(srv.url, "/lora-adapters")
    assert [(a["name"], a["scale"]) for a in listed] == [("sql", 0.0)]
    assert listed[0]["path"] == str(root / "sql")
    sql_id = listed[0]["id"]
    with_sql, plain = _reference_token(peft_model, ids), _reference_token(base, ids)
    assert with_sql != plain
    # Per request: the listed adapters at their scales; one not listed gets 0.
    assert _answer(client, BASE, ids, lora=[{"id": sql_id, "scale": 1.0}]) == with_sql
    assert _answer(client, BASE, ids, lora=[{"id": sql_id, "scale": 0.0}]) == plain
    assert _answer(client, BASE, ids, lora=[]) == plain
    # The active adapters: what a request that names none gets.
    status, _, body = post(srv.url, "/lora-adapters", [{"id": sql_id, "scale": 1.0}])
    assert status == 200 and body == {"success": True}
    try:
        assert get_json(srv.url, "/lora-adapters")[0]["scale"] == 1.0
        assert _answer(client, BASE, ids) == with_sql
        assert _answer(client, BASE, ids, lora=[]) == plain  # its own choice wins
        chat = client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, extra_body={"return_token_ids": True})
        chat_plain = client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, extra_body={"return_token_ids": True, "lora": []})
        named = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, extra_body={"return_token_ids": True})
        assert chat.choices[0].token_ids == named.choices[0].token_ids
        assert chat.choices[0].token_ids != chat_plain.choices[0].token_ids
    finally:
        post(srv.url, "/lora-adapters", [])
    assert get_json(srv.url, "/lora-adapters")[0]["scale"] == 0.0
    assert _answer(client, BASE, ids) == plain
    # Bad input: 400s in OpenAI's shape, naming the parameter.
    bad = [
        ("/v1/completions", {"prompt": "hi", "lora": [{"id": 7, "scale": 1}]},
         "no LoRA adapter has id 7"),
        ("/v1/completions", {"prompt": "hi", "lora": [{"id": sql_id, "scale": 1},
                                                      {"id": sql_id, "scale": 2}]}, "twice"),
        ("/v1/completions", {"model": "sql", "prompt": "hi",
                             "lora": [{"id": sql_id, "scale": 1}]}, "one or the other"),
        ("/v1/completions", {"prompt": "hi", "lora": [{"id": sql_id}]}, "scale"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "lora": [{"id": sql_id, "scale": "big"}]}, "scale"),
        ("/lora-adapters", {"id": sql_id, "scale": 1}, "JSON list"),
        ("/lora-adapters", [{"id": 9, "scale": 1}], "no LoRA adapter has id 9"),
        ("/lora-adapters", "[{\"id\": 0, \"scale\": NaN}]", "scale"),
    ]
    for path, body_in, needle in bad:
        status, _, err = post(srv.url, path, body_in)
        assert status == 400, (body_in, err)
        schemas.error(err)
        assert needle in err["error"]["message"], err
        assert err["error"]["param"].startswith("lora"), err
    assert get_json(srv.url, "/lora-adapters")[0]["scale"] == 0.0


def test_runtime_updates_are_off_unless_enabled(base_url, schemas):
    status, _, err = post(base_url, "/v1/load_lora_adapter", {"lora_name": "a",
                                                              "lora_path": "/x"})
    assert status == 400 and "--enable-lora-runtime-updates" in err["error"]["message"]
    schemas.error(err)
