"""LoRA adapters over HTTP (vLLM's convention): listed by /v1/models with their parent, picked
by `model`, answered as PEFT answers; unknown names are refused in OpenAI's shape."""

from __future__ import annotations

import pytest
import torch

from tests.hf_models import build_hf_model, save_tiny_tokenizer
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
        loras={"sql": str(root / "sql")}, warmup=False)
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), "the server did not become ready"
    wait_healthy(srv.url)
    yield srv, base, peft_model
    srv.stop()


def _reference_token(model, ids: list[int]) -> int:
    with torch.no_grad():
        return int(model(torch.tensor([ids])).logits[0, -1].argmax())


def test_models_lists_the_adapter_with_its_parent(lora_server, schemas):
    srv, _, _ = lora_server
    listing = get_json(srv.url, "/v1/models")
    cards = {c["id"]: c for c in listing["data"]}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"]["parent"] == BASE and cards[BASE]["parent"] is None
    assert get_json(srv.url, "/v1/models/sql")["root"].endswith("sql")


def test_the_model_field_picks_the_adapter(lora_server):
    import openai
    srv, base, peft_model = lora_server
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
    srv, _, _ = lora_server
    status, _, body = post(srv.url, "/v1/completions", {"model": "nope", "prompt": "hi"})
    assert status == 400  # as for any unknown model here (errors.ModelNotFoundError)
    schemas.error(body)
    assert "sql" in body["error"]["message"] and body["error"]["code"] == "model_not_found"
