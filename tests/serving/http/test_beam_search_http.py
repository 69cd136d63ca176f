"""Beam search over HTTP: `num_beams` (or vLLM's `use_beam_search`), the n best hypotheses
as the n choices, as transformers' `generate(num_beams=...)` returns them; streaming and
n > num_beams refused in OpenAI's error shape."""

from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import MODEL, post

PROMPT = [1, 40, 41, 42, 43, 9, 77]


@pytest.fixture(scope="module")
def reference(tiny_model):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model).eval()

    def generate(**kw) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(torch.tensor([PROMPT]), do_sample=False, pad_token_id=0, **kw)
        eos = hf.generation_config.eos_token_id
        rows = out[:, len(PROMPT):].tolist()
        return [row[:next((i + 1 for i, t in enumerate(row) if t == eos), len(row))]
                for row in rows]
    return generate


def test_the_n_best_hypotheses_are_the_choices(base_url, reference, schemas):
    import openai
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=10, n=3,
        extra_body={"num_beams": 4, "length_penalty": 0.6, "early_stopping": True,
                    "return_token_ids": True})
    want = reference(num_beams=4, num_return_sequences=3, length_penalty=0.6,
                     early_stopping=True, max_new_tokens=10)
    assert [c.token_ids for c in out.choices] == want
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(w) for w in want)
    assert out.usage.prompt_tokens == len(PROMPT)
    schemas.completion(out.model_dump(exclude_unset=True))
    # vLLM's switch: n beams.
    status, _, body = post(base_url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 10, "n": 2, "use_beam_search": True,
        "return_token_ids": True})
    assert status == 200, body
    want = reference(num_beams=2, num_return_sequences=2, max_new_tokens=10)
    assert [c["token_ids"] for c in body["choices"]] == want


def test_chat_with_beams(base_url, schemas):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
            "num_beams": 3, "n": 2}
    status, _, out = post(base_url, "/v1/chat/completions", body)
    assert status == 200, out
    schemas.chat(out)
    assert len(out["choices"]) == 2
    again = post(base_url, "/v1/chat/completions", body)[2]
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in out["choices"]]


@pytest.mark.parametrize("body, param, needle", [
    ({"num_beams": 2, "stream": True}, "stream", "beam search"),
    ({"num_beams": 2, "n": 3}, "n", "at most num_beams"),
    ({"num_beams": 0}, "num_beams", ""),
    ({"num_beams": 2, "stop": ["x"]}, "stop", "beam search"),
    ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping", ""),
    ({"num_beams": 99}, "num_beams", "at most"),
])
def test_bad_beam_requests_are_400(base_url, schemas, body, param, needle):
    status, _, err = post(base_url, "/v1/completions", {"prompt": "hi", **body})
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == param and needle in err["error"]["message"]
