"""Chat answers shaped by the parsers, through the real response writers (serving/http/handlers.py)
over scripted generations: bodies and chunks validate against the OpenAI spec, streams join
to the non-streamed message, and the official client's parsers and stream helper accept them.
"""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import pytest

from metrale_jax.scheduler import Finished, SamplingParams, Token
from serving.http import handlers
from serving.http.chat_output import ChatOutput
from serving.http.generation import ChoiceState
from serving.http.reasoning import ReasoningParser
from serving.http.responses import Envelope, usage
from serving.http.tools.parsers import HermesParser
from serving.http.tools.request import ToolChoice

RT = SimpleNamespace(token_str=lambda i: f"<{i}>")
ARGS = '{"city": "Paris", "days": 3}'
CALLS = (f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>\n'
         '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "strict": True, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "days": {"type": "integer"}},
        "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "now", "strict": True, "parameters": {
        "type": "object", "properties": {}, "required": [], "additionalProperties": False}}}]


class ScriptedGeneration:
    """Stands in for `Generation`: each choice yields its text pieces, then `Finished`."""

    def __init__(self, outputs: list[list[str]], finish_reason: str = "stop"):
        self.outputs = outputs
        self.finish_reason = finish_reason
        self.choices = [ChoiceState(i, 0, 3) for i in range(len(outputs))]
        self.requests = [SimpleNamespace(prompt_ids=(1, 2, 3))]
        self.prompt_tokens = 3

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens)

    async def events(self):
        for c, pieces in zip(self.choices, self.outputs, strict=True):
            for k, piece in enumerate(pieces):
                c.text.append(piece)
                c.token_ids.append(k)
                c.completion_tokens += 1
                yield c, Token((k,), piece)
            c.finish_reason = self.finish_reason
            yield c, Finished(self.finish_reason, 3, len(pieces))

    def cancel(self) -> None:
        pass

    def observe_end(self) -> None:
        pass


def pieces_of(text: str, seed: int) -> list[str]:
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def prepared(output: ChatOutput | None, outputs: list[list[str]], stream: bool,
             finish_reason: str = "stop") -> handlers.Prepared:
    env = Envelope("chatcmpl", "chat.completion", "tiny", "fp_test")
    prep = handlers.Prepared(ScriptedGeneration(outputs, finish_reason), env, stream, False,
                             False)
    prep.output = output
    return prep


def body_of(output, outputs, finish_reason="stop") -> dict:
    prep = prepared(output, outputs, False, finish_reason)
    asyncio.run(handlers.collect(prep))
    return handlers.chat_body(prep, RT)


def stream_bytes(output, outputs, finish_reason="stop") -> bytes:
    prep = prepared(output, outputs, True, finish_reason)

    async def run() -> bytes:
        return b"".join([b async for b in handlers.chat_stream(prep, RT, lambda: None)])
    return asyncio.run(run())


def chunks_of(raw: bytes) -> list:
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def joined(chunks: list[dict], index: int = 0) -> tuple[dict, str]:
    """The message a client assembles from the chunks of one choice, and its finish reason."""
    content, reasoning, calls, finish = [], [], {}, None
    for ch in chunks:
        for choice in ch["choices"]:
            if choice["index"] != index:
                continue
            d = choice["delta"]
            content.append(d.get("content") or "")
            reasoning.append(d.get("reasoning_content") or "")
            for tc in d.get("tool_calls", ()):
                call = calls.setdefault(tc["index"], {"name": "", "arguments": "", "ids": []})
                if "id" in tc:
                    call["ids"].append(tc["id"])
                call["name"] += tc.get("function", {}).get("name", "")
                call["arguments"] += tc.get("function", {}).get("arguments", "")
            finish = choice["finish_reason"] or finish
    for call in calls.values():
        assert len(call["ids"]) == 1 and call["ids"][0].startswith("call_")
    return {"content": "".join(content) or None, "reasoning": "".join(reasoning) or None,
            "calls": [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]}, finish


def from_body(choice: dict) -> dict:
    m = choice["message"]
    return {"content": m["content"], "reasoning": m.get("reasoning_content"),
            "calls": [(c["function"]["name"], c["function"]["arguments"])
                      for c in m.get("tool_calls", ())]}


HERMES = ChatOutput(HermesParser(), None, ToolChoice("auto"))
BOTH = ChatOutput(HermesParser(), ReasoningParser(), ToolChoice("auto"))
OPEN_THINK = ChatOutput(None, ReasoningParser("<s>assistant: <think>"))

SCENARIOS = [
    # (output, text, finish_reason from the engine, expected shape, expected finish)
    (HERMES, "Let me check.\n" + CALLS, "stop",
     {"content": "Let me check.", "reasoning": None,
      "calls": [("get_weather", ARGS), ("now", "{}")]}, "tool_calls"),
    (BOTH, "<think>\nNeed the weather.\n</think>\n\n" + CALLS, "stop",
     {"content": None, "reasoning": "Need the weather.",
      "calls": [("get_weather", ARGS), ("now", "{}")]}, "tool_calls"),
    (OPEN_THINK, "hmm, <tool_call> here is thinking</think>\n\nThe answer.", "stop",
     {"content": "The answer.", "reasoning": "hmm, <tool_call> here is thinking", "calls": []},
     "stop"),
    (HERMES, "<tool_call>{broken}</tool_call> oops", "stop",
     {"content": "<tool_call>{broken}</tool_call> oops", "reasoning": None, "calls": []},
     "stop"),
    (HERMES, CALLS + "<tool_call>{\"name\": \"now\"", "length",
     {"content": '<tool_call>{"name": "now"', "reasoning": None,
      "calls": [("get_weather", ARGS), ("now", "{}")]}, "length"),
]


@pytest.mark.parametrize(("output", "text", "engine_finish", "expected", "finish"), SCENARIOS)
def test_body_and_stream(schemas, output, text, engine_finish, expected, finish):
    body = body_of(output, [pieces_of(text, 0)], engine_finish)
    schemas.chat(body)
    choice = body["choices"][0]
    assert from_body(choice) == expected and choice["finish_reason"] == finish
    if expected["calls"]:
        assert all(c["id"].startswith("call_") and c["type"] == "function"
                   for c in choice["message"]["tool_calls"])
    assert ("reasoning_content" in choice["message"]) == (output.reasoning is not None)
    for seed in range(4):
        chunks = chunks_of(stream_bytes(output, [pieces_of(text, seed)], engine_finish))
        assert chunks[-1] == "[DONE]"
        for ch in chunks[:-1]:
            schemas.chat_chunk(ch)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        shape, got_finish = joined(chunks[:-1])
        assert shape == expected and got_finish == finish
        # the thinking never reaches content, not even in pieces
        if expected["reasoning"]:
            assert all(expected["reasoning"] not in (c["choices"][0]["delta"].get("content") or "")
                       for c in chunks[:-1])


def test_n_choices_are_shaped_independently(schemas):
    outputs = [pieces_of("plain", 1), pieces_of(CALLS, 2)]
    body = body_of(HERMES, outputs)
    schemas.chat(body)
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "tool_calls"]
    chunks = chunks_of(stream_bytes(HERMES, outputs))[:-1]
    for i, choice in enumerate(body["choices"]):
        assert joined(chunks, i)[0] == from_body(choice)


def test_without_parsers_the_answer_is_unchanged(schemas):
    text = "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>"
    body = body_of(None, [pieces_of(text, 0)])
    schemas.chat(body)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": text,
                                             "refusal": None}


def _mock_client(raw: bytes | None = None, body: dict | None = None):
    openai = pytest.importorskip("openai")
    import httpx2

    def handler(request):
        if raw is not None:
            return httpx2.Response(200, content=raw,
                                   headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=body)
    return openai.OpenAI(base_url="http://mock/v1", api_key="x", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_openai_client_parses_tool_calls():
    text = "Let me check.\n" + CALLS
    client = _mock_client(body=body_of(BOTH, [pieces_of("<think>w</think>" + text, 0)]))
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "?"}],
                                       tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [
        ("get_weather", ARGS), ("now", "{}")]
    assert msg.model_extra["reasoning_content"] == "w"


def test_openai_stream_helper_accepts_the_stream():
    """`client.chat.completions.stream`: events per delta, and the final completion with the
    calls' arguments parsed (the tools are strict)."""
    text = "<think>w</think>Let me check.\n" + CALLS
    client = _mock_client(raw=stream_bytes(BOTH, [pieces_of(text, 3)]))
    with client.chat.completions.stream(
            model="tiny", messages=[{"role": "user", "content": "?"}], tools=TOOLS) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds and "content.delta" in kinds
    assert kinds.count("tool_calls.function.arguments.done") == 2
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [c.function.parsed_arguments for c in msg.tool_calls] == [
        {"city": "Paris", "days": 3}, {}]
    assert [c.function.arguments for c in msg.tool_calls] == [ARGS, "{}"]


# ---- which parsers a request gets, and what its SamplingParams become ------------------------
SETTINGS = SimpleNamespace(tool_call_parser="auto", reasoning_parser="auto")
HERMES_TEMPLATE = "{% if tools %}<tool_call>{% endif %}{{ '</think>' }}"


def test_for_request_picks_parsers_from_the_template():
    auto = ToolChoice("auto", max_calls=1)
    out = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, auto, False, "assistant: <think>")
    assert isinstance(out.tool_parser, HermesParser) and out.tool_parser.max_calls == 1
    assert out.reasoning is not None and out.reasoning.open and out.active
    out = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, auto, True, "")
    assert out.tool_parser is None and out.tool_format is None
    forced = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, ToolChoice("required"), True, "")
    assert forced.tool_parser is None and forced.tool_format == "hermes"  # for the grammar
    held = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, ToolChoice("required"), False,
                                  "assistant: <think>")
    assert held.reasoning is None  # the grammar starts at the first token: no thinking
    held = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, ToolChoice("none"), False,
                                  "assistant: <think>", constrained=True)
    assert held.reasoning is None and not held.active
    plain = ChatOutput.for_request(SETTINGS, "{{ messages }}", ToolChoice("none"), False, "")
    assert not plain.active
    off = SimpleNamespace(tool_call_parser="none", reasoning_parser="none")
    with pytest.raises(Exception, match="--tool-call-parser") as err:
        ChatOutput.for_request(off, HERMES_TEMPLATE, auto, False, "")
    assert err.value.param == "tools"


def test_adjust_params_sets_the_constraint_and_thinking_budget(tool_tokenizer):
    from metrale_jax.scheduler.constraints import Constraint
    from metrale_jax.scheduler.thinking import ThinkingBudgetSpec
    tools = [{"type": "function", "function": {"name": "now"}}]
    choice = ToolChoice("named", "now", 1)
    out = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, choice, False, "x: <think>")
    with pytest.raises(Exception, match="cannot be combined") as err:
        out.adjust_params(SamplingParams(), tool_tokenizer, tools, 5)
    assert err.value.param == "thinking_budget"
    params = out.adjust_params(SamplingParams(), tool_tokenizer, tools, None)
    assert isinstance(params.constraint, Constraint) and params.constraint.kind == "grammar"
    (tc,) = tool_tokenizer.encode("<tool_call>", add_special_tokens=False)
    assert params.constraint.value.startswith(f'start: call "\\n"?\ncall: <[{tc}]>')
    auto = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, ToolChoice("auto"), False,
                                  "x: <think>")
    spec = auto.adjust_params(SamplingParams(), tool_tokenizer, tools, 5).thinking_budget
    assert isinstance(spec, ThinkingBudgetSpec) and spec.budget == 5 and spec.open
    assert spec.close_ids == tuple(tool_tokenizer.encode("</think>", add_special_tokens=False))
    assert params.skip_special_tokens  # the tags are not special tokens here
    with pytest.raises(Exception, match="cannot be combined"):
        out.adjust_params(SamplingParams(constraint=params.constraint), tool_tokenizer, tools,
                          None)
    auto = ChatOutput.for_request(SETTINGS, HERMES_TEMPLATE, ToolChoice("auto"), False, "")
    assert auto.adjust_params(SamplingParams(), tool_tokenizer, tools, None) == SamplingParams()
    none = ChatOutput.for_request(SETTINGS, "{{ messages }}", ToolChoice("none"), False, "")
    with pytest.raises(Exception, match="reasoning parser") as err:
        none.adjust_params(SamplingParams(), tool_tokenizer, tools, 3)


def test_special_markers_turn_skip_special_tokens_off():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return [7] if text == "[TOOL_CALLS]" else [1, 2]

        def is_special(self, i):
            return i == 7

    from serving.http.tools.parsers import MistralParser
    out = ChatOutput(MistralParser(), None, ToolChoice("auto"), "mistral")
    assert not out.adjust_params(SamplingParams(), Tok(), [], None).skip_special_tokens


def test_cli_flags():
    from serving.cli import build_parser
    args = build_parser().parse_args(["serve", "--tool-call-parser", "llama3_json",
                                      "--reasoning-parser", "deepseek_r1"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3_json", "deepseek_r1")
    args = build_parser().parse_args(["serve"])
    assert (args.tool_call_parser, args.reasoning_parser) == ("auto", "auto")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
