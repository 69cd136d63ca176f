"""Nothing a client sends breaks the server: the short fuzz profile (the long one is
bench/fuzz.py), over real HTTP against the suite's shared tiny-model server.

Requests come from devtools/fuzz_requests.py: Schemathesis strategies built from OpenAI's
published spec (every OpenAI route served) and from the Anthropic SDK's request types
(/v1/messages), positive and negative cases, a fixed number per route, derandomized; and the
hand-written hostile cases (lone surrogates and invalid UTF-8 wherever text goes, huge
numbers, NaN, deep nesting, wrong types in every field, image parts that are not images,
bodies over the limit). Every answer is a 2xx or a 4xx in its route's error shape, never a
5xx, never a hang (a client timeout); /health answers 200 afterwards.
"""

from __future__ import annotations

import json

import pytest

from devtools.fuzz_requests import (
    LONE,
    ROUTES_WITH_BODIES,
    Request,
    check,
    hostile_cases,
    json_bytes,
    send,
    text_fields,
)
from tests.serving.conftest import MODEL, SPEC

pytestmark = pytest.mark.xdist_group("tiny-server")

BODY_LIMIT = 256 * 1024  # the shared server's max_body_bytes (tests/serving/conftest.py)
EXAMPLES = 10
"""Generated requests per route and test run (positive and negative cases, drawn)."""
TIMEOUT = 60.0


def healthy(base_url: str) -> None:
    assert send(base_url, Request("GET", "/health"), timeout=TIMEOUT).status == 200


def test_a_lone_surrogate_is_a_400_naming_its_field_on_every_route(base_url):
    """A lone surrogate in any text a client sends (content, parts, system, names, stop,
    tools, response_format, logit_bias keys, user, metadata, Responses input and
    instructions, Anthropic system and blocks, embeddings, tokenize...), streamed or not: a
    400 in the route's error shape naming the field, before any tokenizer sees it."""
    wrong = []
    for label, path, body in text_fields(MODEL):
        req = Request("POST", path, json_bytes(body), label)
        out = send(base_url, req, timeout=TIMEOUT)
        if out.status != 400 or check(req, out) is not None:
            wrong.append(f"{label} {path}: {out.status} {out.text[:200]}")
            continue
        err = out.body["error"]
        if "surrogate" not in err["message"]:
            wrong.append(f"{label} {path}: {err['message']}")
        elif not req.anthropic and not err["param"]:
            wrong.append(f"{label} {path}: no param named")
    assert not wrong, "\n".join(wrong)
    healthy(base_url)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/tokenize"])
def test_invalid_utf8_and_deep_nesting_are_400s(base_url, path):
    """Bytes that are not UTF-8, and nesting past the parser's or the body walk's limit:
    400s saying so (were 500s: the parser's RecursionError)."""
    for raw, words in ((b'{"prompt": "\xff\xfe"}', "not valid JSON"),
                       (b"[" * 10_000 + b"]" * 10_000, "levels deep"),
                       (json.dumps({"model": MODEL, "x": [[[[[[[[[[1]]]]]]]]]] * 1}
                                   ).encode().replace(b"[1]", b"[" * 100 + b"1" + b"]" * 100),
                        "levels deep")):
        req = Request("POST", path, raw)
        out = send(base_url, req, timeout=TIMEOUT)
        assert out.status == 400 and check(req, out) is None, out.text
        assert words in out.text


def test_odd_unknown_field_names_are_answered(base_url):
    """An unknown field named with a newline or a lone surrogate is ignored like any other
    (its name, escaped, in x-metrale-ignored-fields) instead of breaking the answer's
    headers (was a 500 or a dropped connection)."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "a\nb": 1, "\u00e9": 2,
            **{f"f{i}": i for i in range(40)}}
    req = Request("POST", "/v1/completions", json_bytes(body))
    out = send(base_url, req, timeout=TIMEOUT)
    assert out.status == 200, out.text


def test_hostile_requests_are_2xx_or_4xx(base_url):
    """Every hand-written hostile request (several hundred over every route with a body):
    a 2xx, or a 4xx in the route's error shape; the server stays healthy."""
    failures = []
    for req in hostile_cases(MODEL, BODY_LIMIT):
        why = check(req, send(base_url, req, timeout=TIMEOUT))
        if why is not None:
            failures.append(f"{why}\n  {req.shown(300)}")
    assert not failures, f"{len(failures)} failed:\n" + "\n".join(failures[:20])
    healthy(base_url)


@pytest.fixture(scope="module")
def strategies():
    pytest.importorskip("schemathesis", reason="install the test extra (schemathesis)")
    from devtools.fuzz_requests import spec_strategies
    return spec_strategies(SPEC, MODEL)


ROUTES = ["POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses",
          "POST /v1/embeddings", "GET /v1/models", "GET /v1/models/{id}", "POST /v1/messages",
          "POST /v1/messages/count_tokens", "POST /tokenize", "POST /detokenize"]


def test_every_route_is_fuzzed():
    """The routes fuzzed from the schemas cover every route with a body the hostile cases
    cover (a new API route needs a schema here too)."""
    assert {r.split()[1] for r in ROUTES} >= set(ROUTES_WITH_BODIES) - {
        "/v1/rerank", "/v1/score"}  # no published schema: hostile cases only


@pytest.mark.parametrize("route", ROUTES)
def test_spec_generated_requests_are_2xx_or_4xx(base_url, strategies, route):
    """`EXAMPLES` requests generated from the route's schema (OpenAI's spec, the Anthropic
    SDK's types, or vLLM's documented bodies), derandomized: a 2xx or a 4xx in the
    route's error shape each; Hypothesis shrinks a failure to its smallest request."""
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
              phases=[Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(strategies[route])
    def run(req: Request) -> None:
        why = check(req, send(base_url, req, timeout=TIMEOUT))
        assert why is None, f"{why}\n{req.shown()}"

    run()
    healthy(base_url)


def test_the_python_api_refuses_a_lone_surrogate_with_a_value_error(tokenizer):
    """The tokenizer under `LLM.generate` / `LLM.chat` raises a ValueError naming the problem
    (was the Rust tokenizer's TypeError)."""
    with pytest.raises(ValueError, match="surrogate.*U\\+D800"):
        tokenizer.encode(LONE)


def test_image_urls_that_are_no_images_are_400s_in_the_decoder():
    """On a vision model the same hostile image URLs reach the decoder (a text model refuses
    every image part first): each is an `InvalidParameterError` naming its part."""
    from devtools.fuzz_requests import NOT_IMAGES
    from metrale_jax.errors import InvalidParameterError
    from metrale_jax.vision.media import ImageLimits, load_image_url

    for note, url in NOT_IMAGES.items():
        with pytest.raises(InvalidParameterError, match=r"messages\[0\]\.content\[1\]"):
            load_image_url(url, ImageLimits(), param="messages[0].content[1]")
            pytest.fail(f"{note} was decoded")
