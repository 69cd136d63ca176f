"""Reasoning parsers: a model's thinking (`<think>…</think>`) split from its answer.

`metrale serve --reasoning-parser NAME`:
- `think` (Qwen3 and the like): an answer that begins with `<think>` thinks until `</think>`;
  when the prompt already ends inside `<think>` (the generation prompt of DeepSeek-R1 and of
  Qwen's thinking models opens it), the answer begins in thinking.
- `deepseek_r1`: the answer always begins in thinking (the opening tag is optional); an
  answer that never closes it is all reasoning.

The thinking goes to `reasoning_content`, never to `content`. Whitespace next to the tags is
dropped (`"<think>\\nhm\\n</think>\\n\\nHi"` is reasoning `"hm"`, content `"Hi"`).
`split(text)` is the complete answer; `stream()` yields `(kind, text)` pieces, kind
"reasoning" or "content", that join to it. `end_of_thinking_ids(tokenizer)` are the tokens a
thinking budget forces (see metrale_jax/scheduler/thinking.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from metrale_jax.errors import InvalidParameterError
from serving.http.tools.machine import WS, partial_suffix

START, END = "<think>", "</think>"
FORCED_END = "\n</think>\n\n"
"""What a thinking budget forces when it runs out: the model's own way of closing."""

Piece = tuple[str, str]


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """True when the prompt ends inside a `<think>` block (the answer starts thinking)."""
    tail = prompt_tail.rstrip(WS)
    return tail.endswith(START)


class ReasoningStream:
    """One answer's split, fed text pieces; `feed` and `finish` return `(kind, text)` pieces."""

    def __init__(self, open_: bool):
        self._state = "open" if open_ else "start"
        self._buf = ""
        self._ws = ""  # trailing whitespace of the reasoning, held back
        self._lstrip = True  # drop whitespace at the start of the next reasoning / content
        self._out: list[Piece] = []
        self.thought = open_  # True once the answer is known to think

    def feed(self, text: str) -> list[Piece]:
        """The pieces that `text` (the next piece of output) completes."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Piece]:
        """The output ended: the pieces held back."""
        self._run(final=True)
        if self._buf:
            self._emit(self._state, self._buf)
            self._buf = ""
        return self._take()

    def _run(self, final: bool) -> None:
        while self._buf:
            s = self._state
            if s in ("start", "open"):  # before the opening tag (or instead of it)
                body = self._buf.lstrip(WS)
                if body.startswith(START):
                    self._buf = body[len(START):]
                    self._state, self.thought = "think", True
                    continue
                if not final and START.startswith(body):
                    return
                self._state = "think" if s == "open" else "content"
                self._lstrip = s == "open"
                continue
            if s == "think":
                i = self._buf.find(END)
                if i >= 0:
                    self._reasoning(self._buf[:i])
                    self._buf = self._buf[i + len(END):]
                    self._ws, self._state, self._lstrip = "", "content", True
                    continue
                keep = 0 if final else partial_suffix(self._buf, END)
                self._reasoning(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                return
            text, self._buf = self._buf, ""
            if self._lstrip:
                text = text.lstrip(WS)
                if not text:
                    return
                self._lstrip = False
            self._emit("content", text)

    def _reasoning(self, text: str) -> None:
        if self._lstrip:
            text = text.lstrip(WS)
            if not text:
                return
            self._lstrip = False
        text = self._ws + text
        body = text.rstrip(WS)
        self._ws = text[len(body):]
        if body:
            self._emit("reasoning", body)

    def _emit(self, kind: str, text: str) -> None:
        kind = "reasoning" if kind in ("think", "open") else kind
        if kind == "start":
            kind = "content"
        if self._out and self._out[-1][0] == kind:
            self._out[-1] = (kind, self._out[-1][1] + text)
        else:
            self._out.append((kind, text))

    def _take(self) -> list[Piece]:
        out, self._out = self._out, []
        return out


class ReasoningParser:
    """The `think` format; `prompt_tail` is the end of the rendered prompt."""

    name: ClassVar[str] = "think"
    starts_open: ClassVar[bool] = False

    def __init__(self, prompt_tail: str = ""):
        self.open = self.starts_open or prompt_opens_thinking(prompt_tail)

    def stream(self) -> ReasoningStream:
        """A streaming split of one answer."""
        return ReasoningStream(self.open)

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None, content) of a complete answer."""
        s = self.stream()
        pieces = [*s.feed(text), *s.finish()]
        reasoning = "".join(t for k, t in pieces if k == "reasoning")
        content = "".join(t for k, t in pieces if k == "content")
        return reasoning or None, content


class DeepSeekR1Parser(ReasoningParser):
    """DeepSeek-R1: the answer begins in thinking, with or without the opening tag."""

    name = "deepseek_r1"
    starts_open = True


PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (ReasoningParser, DeepSeekR1Parser)}
ALIASES = {"qwen3": "think", "deepseek": "deepseek_r1"}
CHOICES = ("auto", "none", *PARSERS)
"""What `--reasoning-parser` accepts: a format, `auto` (from the template) or `none`."""


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The parser class of `name` (a format or an alias); raises InvalidParameterError."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise InvalidParameterError(
            f"unknown reasoning parser {name!r}: choose one of {', '.join(PARSERS)}",
            param="reasoning_parser")
    return PARSERS[key]


def resolve_reasoning_parser(setting: str | None, template: str | None) -> str | None:
    """The format to use: `setting` (a name, "none", or "auto"/None = from the template:
    `think` when the template knows the think tags)."""
    if setting in (None, "auto"):
        return "think" if template and (START in template or END in template) else None
    if setting == "none":
        return None
    return reasoning_parser_class(setting).name


def end_of_thinking_ids(tokenizer: Any, text: str = FORCED_END) -> tuple[int, ...]:
    """The token ids a thinking budget forces to end the thinking (`"\\n</think>\\n\\n"`)."""
    return tuple(tokenizer.encode(text, add_special_tokens=False))


def thinking_tag_ids(tokenizer: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of the opening and the closing tag, `<think>` and `</think>`."""
    return (tuple(tokenizer.encode(START, add_special_tokens=False)),
            tuple(tokenizer.encode(END, add_special_tokens=False)))


def tag_texts() -> Sequence[str]:
    """The tag texts, which must survive detokenization (never dropped as special)."""
    return (START, END)
