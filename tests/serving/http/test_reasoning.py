"""Reasoning parsers on handcrafted outputs: the thinking never reaches the content."""

from __future__ import annotations

import pytest

from serving.http.reasoning import (
    DeepSeekR1Parser,
    ReasoningParser,
    end_of_thinking_ids,
    prompt_opens_thinking,
    reasoning_parser_class,
    resolve_reasoning_parser,
    thinking_tag_ids,
)
from tests.serving.http.test_tool_parsers import splits


def streamed(p: ReasoningParser, pieces: list[str]) -> tuple[str | None, str]:
    s = p.stream()
    out = []
    for piece in pieces:
        out.extend(s.feed(piece))
    out.extend(s.finish())
    for kind, text in out:
        assert kind in ("reasoning", "content") and text
    reasoning = "".join(t for k, t in out if k == "reasoning")
    return reasoning or None, "".join(t for k, t in out if k == "content")


CASES = [
    # (parser, prompt tail, output, reasoning, content)
    (ReasoningParser, "", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    (ReasoningParser, "", "  <think>a < b</think>c", "a < b", "c"),
    (ReasoningParser, "", "No thinking here.", None, "No thinking here."),
    (ReasoningParser, "", "  <thin is not a tag", None, "  <thin is not a tag"),
    (ReasoningParser, "", "<think>\n\n</think>\n\nHi", None, "Hi"),
    (ReasoningParser, "", "<think>cut short", "cut short", ""),
    (ReasoningParser, "", "<think>x</think>y</think>", "x", "y</think>"),
    (ReasoningParser, "assistant: <think>\n", "thinking...</think>answer",
     "thinking...", "answer"),
    (ReasoningParser, "assistant: <think></think>", "answer", None, "answer"),
    (DeepSeekR1Parser, "", "hm</think>\n\nok", "hm", "ok"),
    (DeepSeekR1Parser, "", "<think>hm</think>ok", "hm", "ok"),
    (DeepSeekR1Parser, "", "never closed", "never closed", ""),
]


@pytest.mark.parametrize(("cls", "tail", "text", "reasoning", "content"), CASES)
def test_split_and_stream(cls, tail, text, reasoning, content):
    p = cls(tail)
    assert p.split(text) == (reasoning, content)
    for pieces in splits(text):
        assert streamed(cls(tail), pieces) == (reasoning, content), pieces


def test_prompt_opens_thinking():
    assert prompt_opens_thinking("<s>assistant: <think>\n")
    assert not prompt_opens_thinking("<s>assistant: <think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<s>assistant: ")


def test_resolution():
    assert resolve_reasoning_parser("auto", "{% if x %}<think>{% endif %}") == "think"
    assert resolve_reasoning_parser("auto", "{{ content.split('</think>')[-1] }}") == "think"
    assert resolve_reasoning_parser("auto", "{{ messages }}") is None
    assert resolve_reasoning_parser("none", "<think>") is None
    assert resolve_reasoning_parser("deepseek_r1", None) == "deepseek_r1"
    assert reasoning_parser_class("qwen3") is ReasoningParser
    with pytest.raises(Exception, match="unknown reasoning parser"):
        reasoning_parser_class("nope")


def test_tag_ids_of_a_tokenizer_with_think_tokens(tool_tokenizer):
    start, close = thinking_tag_ids(tool_tokenizer)
    assert len(start) == 1 and len(close) == 1  # added tokens
    end = end_of_thinking_ids(tool_tokenizer)
    assert close[0] in end
    assert tool_tokenizer.decode(list(end)) == "\n</think>\n\n"
