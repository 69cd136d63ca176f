"""Tool-call parsers on handcrafted outputs: complete, streamed at every split, malformed."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from serving.http.tools.json_scan import JsonScanner
from serving.http.tools.parsers import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedTools,
    ToolParser,
    assemble,
    detect_tool_parser,
    resolve_tool_parser,
    tool_parser_class,
)


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def parser(cls: type[ToolParser], **kw) -> ToolParser:
    return cls(new_id=ids(), **kw)


def calls(parsed: ParsedTools) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in parsed.tool_calls]


def streamed(p: ToolParser, pieces: list[str]) -> list[dict]:
    s = p.stream()
    out = []
    for piece in pieces:
        out.extend(s.feed(piece))
    out.extend(s.finish())
    return out


def splits(text: str):
    """Every way of cutting `text` in two, one character at a time, and in three."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    for i in range(1, len(text), 7):
        for j in range(i + 1, len(text), 5):
            yield [text[:i], text[i:j], text[j:]]


def check_delta_shapes(deltas: list[dict]) -> None:
    """Headers (index, id, type, name, empty arguments) come before a call's fragments."""
    seen: set[int] = set()
    for d in deltas:
        assert len(d) == 1 and next(iter(d)) in ("content", "tool_calls"), d
        if "content" in d:
            assert d["content"]
            continue
        (chunk,) = d["tool_calls"]
        if chunk["index"] not in seen:
            assert chunk["id"].startswith("call_") and chunk["type"] == "function"
            assert chunk["function"]["name"] and chunk["function"]["arguments"] == ""
            seen.add(chunk["index"])
        else:
            assert set(chunk) == {"index", "function"}
            assert set(chunk["function"]) == {"arguments"} and chunk["function"]["arguments"]
    assert sorted(seen) == list(range(len(seen)))


def check_stream_equals_parse(cls: type[ToolParser], text: str, **kw) -> ParsedTools:
    whole = parser(cls, **kw).parse(text)
    for pieces in splits(text):
        deltas = streamed(parser(cls, **kw), pieces)
        check_delta_shapes(deltas)
        got = assemble(deltas)
        assert got.content == whole.content, pieces
        assert calls(got) == calls(whole), pieces
    return whole


WEATHER = '{"city": "Paris", "days": [1, 2.5e3], "deep": {"a": "x\\"}y", "b": null}}'

HERMES_CASES = [
    (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
     '</tool_call>', "Let me check.", [("get_weather", WEATHER)]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", '
     '"arguments": {"x": true}}</tool_call>', None, [("a", "{}"), ("b", '{"x": true}')]),
    ('<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', None,
     [("late", '{"x": 1}')]),
    ('<tool_call>{"name": "s", "arguments": "{\\"q\\": 1}"}</tool_call>', None,
     [("s", '{"q": 1}')]),
    ('<tool_call>{"name": "noargs"}</tool_call> and then', "and then", [("noargs", "{}")]),
    ('<tool_call>{"name": "open", "arguments": {"a": 1}}', None, [("open", '{"a": 1}')]),
    ('<tool_call>{"type": "function", "name": "t", "parameters": {"k": "v"}}</tool_call>',
     None, [("t", '{"k": "v"}')]),
    ("plain answer, no calls  \n", "plain answer, no calls  \n", []),
    ("a < b and <tool_ is not a tag", "a < b and <tool_ is not a tag", []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "expected"), HERMES_CASES)
def test_hermes(text, content, expected):
    whole = check_stream_equals_parse(HermesParser, text)
    assert whole.content == content
    assert calls(whole) == expected
    for c in whole.tool_calls:
        assert c.id.startswith("call_")
        assert isinstance(json.loads(c.arguments), dict)


LLAMA_CASES = [
    ('{"name": "f", "parameters": {"a": 1}}', None, [("f", '{"a": 1}')]),
    ('<|python_tag|>{"name": "f", "parameters": {"a": [1, {"b": 2}]}}', None,
     [("f", '{"a": [1, {"b": 2}]}')]),
    ('  {"name": "f", "parameters": {}}; {"name": "g", "arguments": {"z": -0.5}}', None,
     [("f", "{}"), ("g", '{"z": -0.5}')]),
    ('{"name": "f", "parameters": {}} trailing words', "trailing words", [("f", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),  # a JSON answer that is no call
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),  # no parameters: no call
    ("The answer is {\"name\": \"f\"}", "The answer is {\"name\": \"f\"}", []),
    ("  hello", "  hello", []),
]


@pytest.mark.parametrize(("text", "content", "expected"), LLAMA_CASES)
def test_llama3_json(text, content, expected):
    whole = check_stream_equals_parse(Llama3JsonParser, text)
    assert whole.content == content
    assert calls(whole) == expected


MISTRAL_CASES = [
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]',
     None, [("f", '{"a": 1}'), ("g", "{}")]),
    ('Sure. [TOOL_CALLS] [{"name": "f", "arguments": {"a": "[TOOL_CALLS]"}}]', "Sure.",
     [("f", '{"a": "[TOOL_CALLS]"}')]),
    ('[TOOL_CALLS]{"name": "one", "arguments": {}}', None, [("one", "{}")]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]now[ARGS]{}', None,
     [("get_weather", '{"city": "Rome"}'), ("now", "{}")]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}', None, [("f", "{}")]),  # no closing ]
    ("no calls [here]", "no calls [here]", []),
]


@pytest.mark.parametrize(("text", "content", "expected"), MISTRAL_CASES)
def test_mistral(text, content, expected):
    whole = check_stream_equals_parse(MistralParser, text)
    assert whole.content == content
    assert calls(whole) == expected


# Malformed calls, caught before anything of the call is sent: content, streamed or not.
MALFORMED = [
    (HermesParser, "hello <tool_call> junk </tool_call> bye"),
    (HermesParser, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": [1, 2]}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f", "arguments": "not json"}</tool_call>'),
    (HermesParser, '<tool_call>{"name": "f" "arguments": {}}</tool_call>'),
    (HermesParser, "<tool_call>"),
    (HermesParser, '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    (Llama3JsonParser, '{"name": "f", "parameters": nope}'),
    (Llama3JsonParser, "<|python_tag|>print('hi')"),
    (MistralParser, "[TOOL_CALLS] nope"),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": 7}]'),
    (MistralParser, "[TOOL_CALLS]f[ARG"),
    (MistralParser, "[TOOL_CALLS]f[ARGS]nope"),
]


@pytest.mark.parametrize(("cls", "text"), MALFORMED)
def test_malformed_is_content(cls, text):
    whole = check_stream_equals_parse(cls, text)
    assert whole.content == text and whole.tool_calls == ()


@pytest.mark.parametrize(("cls", "text"), [
    (HermesParser, '<tool_call>{"name": "f", "arguments": {}'),  # ends inside the object
    (HermesParser, '<tool_call>{"name": "f", "arguments": {"a": "b'),
    (Llama3JsonParser, '{"name": "f", "parameters": {"a": 1}'),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}, '),
])
def test_truncated_calls_are_content_when_complete(cls, text):
    """Output cut inside a call (max_tokens): the complete answer is content; a stream sent the
    call's start already and keeps it, sending nothing more of it."""
    assert parser(cls).parse(text) == ParsedTools(text)
    for pieces in splits(text):
        got = assemble(streamed(parser(cls), pieces))
        assert [c.name for c in got.tool_calls] == ["f"] and got.content is None
        args = got.tool_calls[0].arguments
        assert args.startswith("{") and args in text


def test_a_stream_cut_inside_the_arguments_keeps_what_it_sent():
    """A stream cannot take back a sent header: a call that breaks after its arguments began
    ends as sent, the rest is content; the complete parse makes it all content."""
    text = '<tool_call>{"name": "f", "arguments": {"a": tru} and more'
    assert parser(HermesParser).parse(text) == ParsedTools(text)
    deltas = streamed(parser(HermesParser), list(text))
    got = assemble(deltas)
    assert calls(got) == [("f", '{"a": tru')]
    assert got.content == "} and more"


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
            '"arguments": {}}</tool_call>done')
    whole = check_stream_equals_parse(HermesParser, text, max_calls=1)
    assert calls(whole) == [("a", "{}")] and whole.content == "done"


def _hermes(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


@pytest.mark.parametrize("cls, call", [
    (HermesParser, _hermes),
    (Llama3JsonParser, lambda n, a: f'{{"name": "{n}", "parameters": {a}}}'),
])
def test_unique_drops_repeated_calls_streamed_or_not(cls, call):
    """A model that repeats a call (SmolLM2 under tool_choice "required"): with `unique`
    each distinct call comes once, in order, numbered without gaps, streamed or not; a call
    that only begins like an earlier one is sent whole."""
    sep = "\n" if cls is HermesParser else "; "
    text = sep.join([call("a", '{"x": 1}'), call("a", '{"x": 1}'), call("a", '{"x": 12}'),
                     call("b", "{}"), call("a", '{"x": 1}')])
    whole = check_stream_equals_parse(cls, text, unique=True)
    assert calls(whole) == [("a", '{"x": 1}'), ("a", '{"x": 12}'), ("b", "{}")]
    deltas = streamed(parser(cls, unique=True), list(text))
    assert [d["tool_calls"][0]["index"] for d in deltas if "id" in d["tool_calls"][0]] == [
        0, 1, 2]
    assert len(parser(cls).parse(text).tool_calls) == 5  # without `unique`, all of them


def test_a_forced_choice_cut_by_max_tokens_leaves_no_content():
    """A forced tool choice's output cut short (max_tokens) inside the next marker or the
    next call: the complete calls, and no content (the cut text is no answer)."""
    first = _hermes("f", '{"a": 1}')
    for cut in ("\n<tool_", "\n<tool_call>\n{\"name\": \"f\", \"argu", "\n<"):
        text = first + cut
        whole = check_stream_equals_parse(HermesParser, text, forced=True, unique=True)
        assert calls(whole) == [("f", '{"a": 1}')] and whole.content is None, cut
        assert parser(HermesParser).parse(text).content == cut.strip()  # auto: kept


def test_ids_are_openai_style_and_distinct():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>' * 3
    got = HermesParser().parse(text)
    assert len({c.id for c in got.tool_calls}) == 3
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got.tool_calls)
    assert got.tool_calls[0].to_openai() == {
        "id": got.tool_calls[0].id, "type": "function",
        "function": {"name": "a", "arguments": "{}"}}


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list('<>{}[]":,; \nabtool_cal/TOOLS_CA|pyhn0-1\\e')),
               max_size=60), st.integers(1, 7))
def test_fuzz_never_crashes_and_keeps_every_character(text, step):
    for cls in (HermesParser, Llama3JsonParser, MistralParser):
        whole = parser(cls).parse(text)
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        got = assemble(streamed(parser(cls), pieces))
        if not whole.tool_calls:
            assert whole.content == (text or None)
        for c in whole.tool_calls:
            assert isinstance(json.loads(c.arguments), dict)
        if not got.tool_calls:  # nothing sent as a call: the stream is the whole text too
            assert got.content == (text or None)


@pytest.mark.parametrize("text", [
    '{"a": 1}', '{"a": [1, -2.5e-3, true, false, null, "x\\u00e9\\n"], "b": {"c": {}}}',
    '{ "k" : "v" , "n" : 0 }', "{}", '{"a": 0.0E+1}'])
def test_scanner_accepts_json(text):
    sc = JsonScanner()
    assert sc.feed(text + " tail") == len(text)
    assert sc.done and not sc.error and sc.value() == json.loads(text)
    for m in sc.members:
        assert json.loads(sc.member_text(m)) == json.loads(text)[m.key]


@pytest.mark.parametrize("text", [
    '{"a": 01}', '{"a": 1.}', '{"a": -}', '{"a": tru,', '{a: 1}', '{"a" 1}', '{"a": 1,}',
    '{"a": "\\x"}', '{"a": "\n"}', '{"a": [1 2]}', '[1]', '{"a": 1]', '{"a": .5}', '{,}'])
def test_scanner_rejects_invalid_json_at_the_first_bad_character(text):
    sc = JsonScanner()
    n = sc.feed(text)
    assert sc.error and not sc.done
    with pytest.raises(json.JSONDecodeError):
        json.loads(text[:n + 1])


def test_detection_from_the_chat_template():
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser("[AVAILABLE_TOOLS] [TOOL_CALLS]") == "mistral"
    assert detect_tool_parser("<|python_tag|>{{ x }}") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
    assert resolve_tool_parser("auto", "<tool_call>") == "hermes"
    assert resolve_tool_parser("none", "<tool_call>") is None
    assert resolve_tool_parser("qwen", None) == "hermes"
    assert tool_parser_class("llama3") is Llama3JsonParser
    with pytest.raises(Exception, match="unknown tool-call parser"):
        tool_parser_class("nope")


CLOSED_BY = [  # (parser, a whole call, the closing text its last call ends with)
    (HermesParser, _hermes("f", '{"a": 1}')[:-len("</tool_call>")], "</tool_call>"),
    (MistralParser, '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}', "]"),
]


@pytest.mark.parametrize(("cls", "head", "close"), CLOSED_BY)
@pytest.mark.parametrize("forced", [True, False])
def test_a_call_cut_inside_its_closing_tag_leaves_no_content(cls, head, close, forced):
    """Output cut (max_tokens) at every character of a whole call's closing tag: the call,
    and no content (no `"</tool_call"` beside it), streamed or not, forced or not."""
    for k in range(len(close) + 1):
        text = head + close[:k]
        whole = check_stream_equals_parse(cls, text, forced=forced, unique=True)
        assert calls(whole) == [("f", '{"a": 1}')] and whole.content is None, text


def _done_after(cls, pieces: list[str], **kw) -> list[bool]:
    s = parser(cls, **kw).stream()
    out = []
    for piece in pieces:
        s.feed(piece)
        out.append(s.done)
    return out


@pytest.mark.parametrize("cls, call, sep", [
    (HermesParser, _hermes, "\n"),
    (Llama3JsonParser, lambda n, a: f'{{"name": "{n}", "parameters": {a}}}', "; "),
    (MistralParser, lambda n, a: f'{{"name": "{n}", "arguments": {a}}}', ", "),
])
def test_a_forced_answer_is_done_at_its_first_repeat(cls, call, sep):
    """`done` (the generation may end) turns on at the first call repeating an earlier one,
    once that call is read whole, under a forced choice only; the answer is the distinct
    calls, and the repeat cut anywhere adds no content."""
    lead = "[TOOL_CALLS][" if cls is MistralParser else ""
    a, b = call("a", '{"x": 1}'), call("b", "{}")
    text = lead + sep.join([a, b, a, b])
    upto = len(lead + sep.join([a, b, a]))
    done = _done_after(cls, list(text), forced=True, unique=True)
    first = done.index(True)
    assert upto - 1 <= first <= upto + len(sep), (first, upto)
    assert not any(done[:first]) and all(done[first:])
    assert not any(_done_after(cls, list(text), unique=True))  # auto: never
    whole = parser(cls, forced=True, unique=True).parse(text[:first + 1])
    assert calls(whole) == [("a", '{"x": 1}'), ("b", "{}")] and whole.content is None


def test_a_forced_single_call_is_done_when_a_second_opens():
    """`parallel_tool_calls` false (max_calls 1): done as soon as a second call opens."""
    text = _hermes("a", "{}") + "\n" + _hermes("b", "{}")
    done = _done_after(HermesParser, list(text), forced=True, unique=True, max_calls=1)
    assert done.index(True) == len(_hermes("a", "{}") + "\n<tool_call>") - 1
