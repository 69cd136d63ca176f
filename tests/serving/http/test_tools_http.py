"""Tools and reasoning over real HTTP: a server of a tiny random model whose vocabulary has the
think and tool-call tags and whose template renders tools, tool calls and tool results.

The model's weights are random, so what it writes is noise: these tests check what reaches the
template, the 400s, and that the server's answer is exactly the parsers' reading of the
model's raw text (got from /v1/completions on the same prompt ids), streamed or not.
"""

from __future__ import annotations

import json

import pytest

from serving.http.reasoning import ReasoningParser
from serving.http.tools.parsers import HermesParser
from tests.serving.conftest import TOOL_MODEL, post, sse_events

MODEL = TOOL_MODEL
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
USER = [{"role": "user", "content": "weather?"}]
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


@pytest.fixture(scope="module")
def url(tool_server) -> str:
    return tool_server.url


def chat(url: str, **body):
    return post(url, "/v1/chat/completions", {"model": MODEL, "temperature": 0, **body})


def raw_output(url: str, prompt_ids: list[int], max_tokens: int) -> str:
    """The model's own text for these prompt ids (greedy), as /v1/completions gives it."""
    status, _, body = post(url, "/v1/completions", {
        "model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return body["choices"][0]["text"]


def streamed_message(url: str, schemas, **body) -> tuple[dict, str]:
    events = sse_events(url, "/v1/chat/completions",
                        {"model": MODEL, "temperature": 0, "stream": True, **body})
    assert events[-1] == "[DONE]"
    content, reasoning, calls, finish = "", "", {}, None
    for e in events[:-1]:
        schemas.chat_chunk(e)
        for c in e["choices"]:
            d = c["delta"]
            content += d.get("content") or ""
            reasoning += d.get("reasoning_content") or ""
            for tc in d.get("tool_calls", ()):
                call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                call["name"] += tc.get("function", {}).get("name", "")
                call["arguments"] += tc.get("function", {}).get("arguments", "")
            finish = c["finish_reason"] or finish
    return {"content": content or None, "reasoning_content": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)]}, finish


def shape(message: dict) -> dict:
    return {"content": message["content"], "reasoning_content": message.get("reasoning_content"),
            "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                      for c in message.get("tool_calls", ())]}


def test_tools_history_and_results_reach_the_template(url, schemas, tool_tokenizer):
    status, _, body = chat(url, messages=HISTORY, tools=TOOLS, max_tokens=2,
                           return_token_ids=True)
    assert status == 200, body
    schemas.chat(body)
    prompt = tool_tokenizer.decode(body["prompt_token_ids"])
    assert f"<tools>{json.dumps(TOOLS[0])}</tools>" in prompt
    # arguments reach the template as a dict (written as JSON), not as a JSON string
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' \
        in prompt
    assert "<s>tool: <tool_response>sunny</tool_response></s>" in prompt
    assert prompt.endswith("<s>assistant: ")


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     "messages[1].tool_calls[0].function.name"),
])
def test_bad_tool_fields_are_400s(url, schemas, body, param):
    status, _, err = chat(url, **{"messages": USER, "tools": TOOLS, **body})
    assert status == 400, err
    schemas.error(err)
    assert err["error"]["param"] == param and err["error"]["type"] == "invalid_request_error"


def test_a_model_without_a_tool_format_says_so(base_url, schemas):
    """The shared server's template has no tool-call format: tools under 'auto' are a 400
    (never silently ignored), tools under 'none' are fine."""
    status, _, err = post(base_url, "/v1/chat/completions", {
        "model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 2})
    assert status == 400 and err["error"]["param"] == "tools", err
    assert "--tool-call-parser" in err["error"]["message"]
    status, _, body = post(base_url, "/v1/chat/completions", {
        "model": "tiny", "messages": USER, "tools": TOOLS, "tool_choice": "none",
        "max_tokens": 2})
    assert status == 200, body
    schemas.chat(body)


@pytest.mark.parametrize("extra", [
    {},  # the random model's text, through the hermes parser
    {"logit_bias": "tool_call"},  # `<tool_call>` again and again: malformed calls
    {"suppress_tool_call": True, "logit_bias": "tool_call"},
])
def test_auto_answers_are_the_parsed_raw_text(url, schemas, tool_tokenizer, extra):
    extra = dict(extra)
    if "logit_bias" in extra:
        (tid,) = tool_tokenizer.encode("<tool_call>", add_special_tokens=False)
        extra["logit_bias"] = {str(tid): 5.0}
    status, _, body = chat(url, messages=USER, tools=TOOLS, max_tokens=24, seed=1,
                           return_token_ids=True, **extra)
    assert status == 200, body
    schemas.chat(body)
    raw = raw_output_with(url, body, extra)
    if extra.get("logit_bias"):
        assert "<tool_call>" in raw
    choice = body["choices"][0]
    if extra.get("suppress_tool_call"):
        assert choice["message"]["content"] == raw and "tool_calls" not in choice["message"]
    else:
        expected = HermesParser().parse(raw)
        assert choice["message"]["content"] == expected.content
        assert [c.name for c in expected.tool_calls] == [
            c["function"]["name"] for c in choice["message"].get("tool_calls", ())]
    got, finish = streamed_message(url, schemas, messages=USER, tools=TOOLS, max_tokens=24,
                                   seed=1, **extra)
    assert got == shape(choice["message"]) and finish == choice["finish_reason"]


def raw_output_with(url: str, body: dict, extra: dict) -> str:
    """The raw text of `body`'s answer: the same prompt ids and bias through /v1/completions."""
    status, _, out = post(url, "/v1/completions", {
        "model": MODEL, "prompt": body["prompt_token_ids"], "max_tokens": 24, "temperature": 0,
        "seed": 1, **({"logit_bias": extra["logit_bias"]} if "logit_bias" in extra else {})})
    assert status == 200, out
    return out["choices"][0]["text"]


@pytest.mark.parametrize("how", ["top_level", "chat_template_kwargs"])
def test_thinking_goes_to_reasoning_content(url, schemas, tool_tokenizer, how):
    """`enable_thinking` opens `<think>` in the prompt: the answer is thinking until the model
    writes `</think>` (this one never does), so all of it is reasoning_content."""
    flag = ({"enable_thinking": True} if how == "top_level"
            else {"chat_template_kwargs": {"enable_thinking": True}})
    status, _, body = chat(url, messages=USER, max_tokens=16, return_token_ids=True, **flag)
    assert status == 200, body
    schemas.chat(body)
    prompt = tool_tokenizer.decode(body["prompt_token_ids"])
    assert prompt.endswith("<s>assistant: <think>")
    raw = raw_output(url, body["prompt_token_ids"], 16)
    reasoning, content = ReasoningParser(prompt).split(raw)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == reasoning and reasoning
    assert message["content"] == (content or None)
    got, finish = streamed_message(url, schemas, messages=USER, max_tokens=16, **flag)
    assert got == shape(message) and finish == body["choices"][0]["finish_reason"]


def test_thinking_off_is_content(url, schemas, tool_tokenizer):
    status, _, body = chat(url, messages=USER, max_tokens=8, return_token_ids=True,
                           enable_thinking=False)
    assert status == 200, body
    assert tool_tokenizer.decode(body["prompt_token_ids"]).endswith("<think></think>")
    raw = raw_output(url, body["prompt_token_ids"], 8)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert message["content"] == ReasoningParser().split(raw)[1]


def test_openai_stream_helper_against_the_server(url, tool_server):
    import openai
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    kwargs = dict(model=MODEL, messages=USER, tools=TOOLS, max_tokens=12, temperature=0)
    text = client.chat.completions.create(**kwargs).choices[0].message.content
    kwargs["stop"] = [text[4:6]]  # the helper refuses answers cut by max_tokens
    plain = client.chat.completions.create(**kwargs)
    assert plain.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert final.choices[0].message.content == plain.choices[0].message.content
    assert final.choices[0].finish_reason == plain.choices[0].finish_reason


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_weather"}}])
def test_forced_tool_choice_calls_the_tool(url, schemas, choice):
    """The random model, held to the tool-call grammar, always calls get_weather with
    arguments that validate, streamed as it is not."""
    import jsonschema
    called = 0
    for seed in range(3):
        status, _, body = chat(url, messages=USER, tools=TOOLS, tool_choice=choice,
                               max_tokens=120, temperature=1.0, seed=seed)
        assert status == 200, body
        schemas.chat(body)
        c = body["choices"][0]
        if c["finish_reason"] == "length":  # a random walk may ramble inside a string
            continue
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        for call in c["message"]["tool_calls"]:
            assert call["function"]["name"] == "get_weather"
            jsonschema.validate(json.loads(call["function"]["arguments"]),
                                TOOLS[0]["function"]["parameters"])
        got, finish = streamed_message(url, schemas, messages=USER, tools=TOOLS,
                                       tool_choice=choice, max_tokens=120, temperature=1.0,
                                       seed=seed)
        assert got == shape(c["message"]) and finish == "tool_calls"
        called += 1
    assert called >= 2


def test_forced_tool_choice_with_thinking_opened_still_calls(url, schemas):
    """A prompt that opens `<think>` does not turn a forced call into reasoning."""
    finished = []
    for seed in range(3):
        status, _, body = chat(url, messages=USER, tools=TOOLS, enable_thinking=True,
                               tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}},
                               max_tokens=120, temperature=1.0, seed=seed)
        assert status == 200, body
        message = body["choices"][0]["message"]
        assert message.get("reasoning_content") is None
        finished.append(body["choices"][0]["finish_reason"])
        if finished[-1] == "tool_calls":
            assert message["tool_calls"][0]["function"]["name"] == "get_weather"
            assert message["content"] is None
    assert "tool_calls" in finished


def test_thinking_budget_forces_the_end_of_thinking(url, schemas):
    status, _, body = chat(url, messages=USER, enable_thinking=True, thinking_budget=4,
                           max_tokens=16, return_token_ids=True)
    assert status == 200, body
    schemas.chat(body)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"]
    assert len(body["choices"][0]["token_ids"]) == 16
    assert message["content"]  # the answer follows the forced </think>


PING = [{"type": "function", "function": {"name": "ping", "description": "no arguments"}}]
"""A tool without parameters: every call of it is the same text, so a model held to the
"required" grammar with `ignore_eos` (no end of text allowed) repeats its first call."""
FORCED_MAX = 150


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "ping"}}])
def test_a_forced_choice_ends_at_its_call(url, schemas, choice):
    """The repeat ends the generation at once (not at max_tokens): one call, finish reason
    tool_calls, usage counting the tokens up to the repeat, streamed as not; the server's
    slot is free afterwards. (A named function's grammar ends after its one call.)"""
    body = dict(messages=USER, tools=PING, tool_choice=choice, max_tokens=FORCED_MAX,
                ignore_eos=True, return_token_ids=True)
    status, _, answer = chat(url, **body)
    assert status == 200, answer
    schemas.chat(answer)
    c = answer["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    assert [(t["function"]["name"], t["function"]["arguments"])
            for t in c["message"]["tool_calls"]] == [("ping", "{}")]
    used = answer["usage"]["completion_tokens"]
    assert used == len(c["token_ids"]) < FORCED_MAX, answer["usage"]
    got, finish = streamed_message(url, schemas, **body)
    assert got == shape(c["message"]) and finish == "tool_calls"


def test_a_forced_choice_ends_at_its_call_on_responses_and_messages(url):
    """The same early end on the Responses (completed, one function_call) and Messages
    (stop_reason tool_use, one tool_use) fronts."""
    status, _, r = post(url, "/v1/responses", {
        "model": MODEL, "input": "weather?", "tools": [{"type": "function", "name": "ping"}],
        "tool_choice": "required", "max_output_tokens": FORCED_MAX, "ignore_eos": True,
        "temperature": 0})
    assert status == 200, r
    assert r["status"] == "completed" and r["usage"]["output_tokens"] < FORCED_MAX, r
    assert [(i["type"], i["name"], i["arguments"]) for i in r["output"]] == [
        ("function_call", "ping", "{}")]
    status, _, m = post(url, "/v1/messages", {
        "model": MODEL, "messages": USER, "max_tokens": FORCED_MAX, "ignore_eos": True,
        "tools": [{"name": "ping", "input_schema": {
            "type": "object", "properties": {}, "additionalProperties": False}}],
        "tool_choice": {"type": "any"}, "temperature": 0})
    assert status == 200, m
    assert m["stop_reason"] == "tool_use" and m["usage"]["output_tokens"] < FORCED_MAX, m
    assert [(b["type"], b["name"], b["input"]) for b in m["content"]] == [
        ("tool_use", "ping", {})]


def test_a_forced_call_cut_anywhere_is_no_content(url):
    """A named call cut by max_tokens at every token: chat never has content beside it (a
    cut closing tag is the call's) and keeps a call cut inside its arguments as sent, with
    finish reason length (as OpenAI does); Messages has no text block and no `tool_use`
    whose arguments were cut (stop_reason max_tokens)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = dict(messages=USER, tools=TOOLS, tool_choice=named, return_token_ids=True)
    status, _, whole = chat(url, max_tokens=FORCED_MAX, **body)
    assert status == 200 and whole["choices"][0]["finish_reason"] == "tool_calls", whole
    length = len(whole["choices"][0]["token_ids"])
    tool = {"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}
    for n in range(1, length):
        status, _, cut = chat(url, max_tokens=n, **body)
        assert status == 200, cut
        c = cut["choices"][0]
        assert c["finish_reason"] == "length" and not c["message"]["content"], (n, c)
        for call in c["message"].get("tool_calls", ()):
            assert call["function"]["name"] == "get_weather"
        status, _, m = post(url, "/v1/messages", {
            "model": MODEL, "messages": USER, "max_tokens": n, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0})
        assert status == 200 and m["stop_reason"] == "max_tokens", (n, m)
        assert all(b["type"] == "tool_use" and "city" in b["input"] for b in m["content"]), (
            n, m)
