"""Tool-call parsers per model family: the model's text -> (content, OpenAI `tool_calls`).

Formats (`metrale serve --tool-call-parser NAME`):
- `hermes` (Hermes, Qwen 2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number, content before and between them.
- `llama3_json` (Llama 3.1-3.3): the whole answer is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or
  `[TOOL_CALLS]name[ARGS]{...}` (v11 and later).

`ToolParser.parse(text)` gives the complete answer; `ToolParser.stream()` a `ToolCallStream`
that turns text deltas into chat deltas whose concatenation is that answer (see
serving/http/tools/machine.py for the rules on content, whitespace and malformed calls).
`detect_tool_parser(template)` picks a format from a chat template's source.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from metrale_jax.errors import InvalidParameterError
from serving.http.tools.json_scan import JsonScanner
from serving.http.tools.machine import WS, Delta, ToolCallMachine, new_call_id


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text of an object."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The `ChatCompletionMessageToolCall` object."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass(frozen=True)
class ParsedTools:
    """A complete answer split into content (None when there is none) and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def assemble(deltas: Iterable[Delta]) -> ParsedTools:
    """Joins chat deltas (content and tool-call chunks) into the answer they make."""
    content: list[str] = []
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for chunk in d.get("tool_calls", ()):
            call = calls.setdefault(chunk["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] = chunk.get("id", call["id"])
            fn = chunk.get("function", {})
            call["name"] += fn.get("name", "")
            call["arguments"] += fn.get("arguments", "")
    text = "".join(content)
    return ParsedTools(text or None, tuple(ToolCall(c["id"], c["name"], c["arguments"])
                                           for _, c in sorted(calls.items())))


class ToolCallStream:
    """One streamed answer: `feed(text)` and `finish()` return chat deltas.

    called: True once a tool call's header was sent (the finish reason becomes "tool_calls").
    """

    def __init__(self, machine: ToolCallMachine):
        self._machine = machine

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text` (the next piece of output) completes."""
        return self._machine.feed(text) if text else []

    def finish(self) -> list[Delta]:
        """The output ended: the deltas held back."""
        return self._machine.finish()

    @property
    def called(self) -> bool:
        """True when at least one tool call went out."""
        return self._machine.calls > 0

    @property
    def done(self) -> bool:
        """True once a forced choice's answer can hold nothing more (a repeated call, or one
        beyond the limit): the generation may end here (`ToolCallMachine.forced`)."""
        return self._machine.done


class ToolParser:
    """A tool-call format. Subclasses set `name`, `markers` and `machine`.

    max_calls: at most this many calls are returned (1 under `parallel_tool_calls=false`).
    new_id: makes call ids (tests pass a deterministic one).
    unique, forced: see `ToolCallMachine` (repeated calls dropped; the output of a forced
        tool choice, where a call cut short is dropped rather than content).
    """

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    """Marker texts: they must survive detokenization (never dropped as special tokens)."""
    machine: ClassVar[type[ToolCallMachine]]

    def __init__(self, max_calls: int | None = None,
                 new_id: Callable[[], str] = new_call_id, unique: bool = False,
                 forced: bool = False):
        self.max_calls = max_calls
        self.new_id = new_id
        self.unique = unique
        self.forced = forced

    def _machine(self, stream: bool) -> ToolCallMachine:
        return self.machine(stream=stream, max_calls=self.max_calls, new_id=self.new_id,
                            unique=self.unique, forced=self.forced)

    def parse(self, text: str) -> ParsedTools:
        """The complete output as content and tool calls (malformed calls are content)."""
        m = self._machine(stream=False)
        return assemble([*m.feed(text), *m.finish()])

    def stream(self) -> ToolCallStream:
        """A streaming parse of one answer."""
        return ToolCallStream(self._machine(stream=True))


# ---- Hermes / Qwen ---------------------------------------------------------------------------
class _HermesMachine(ToolCallMachine):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    complete_state = "post"  # the object is whole; only the closing tag is missing

    def step(self) -> bool:
        s = self.state
        if s == "text":
            return self.open_at(self.OPEN, "pre")
        if s == "pre":
            return self.start_object()
        if s == "object":
            return self.scan_object("post")
        if s == "post":  # the closing tag; a missing one is forgiven
            if not self.skip_ws():
                return False
            if self.buf.startswith(self.CLOSE):
                self.consume(len(self.CLOSE))
            elif self.CLOSE.startswith(self.buf):
                if not self.final:
                    return False
                self.consume(len(self.buf))  # the closing tag cut short: the call's, no content
            self.close_call()
            self.state = "text"
            return True
        raise AssertionError(s)



class HermesParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2/3, Qwen 2.5/3)."""

    name = "hermes"
    markers = ("<tool_call>", "</tool_call>")
    machine = _HermesMachine


# ---- Llama 3.x JSON --------------------------------------------------------------------------
class _Llama3Machine(ToolCallMachine):
    TAG = "<|python_tag|>"
    args_optional = False  # a bare JSON answer is a call only with its parameters
    text_state, complete_state = "rest", "post"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.state = "start"

    def step(self) -> bool:
        s = self.state
        if s == "start":  # only the beginning of the answer may be a call
            lead = self.buf[:len(self.buf) - len(self.buf.lstrip(WS))]
            rest = self.buf[len(lead):]
            if not rest:
                if self.final and self.buf:
                    return self._to_text()
                return False
            if rest.startswith("{"):
                self.buf = rest
                self.open_call(lead)
                self.scanner, self.state = JsonScanner(), "object"
                return True
            if rest.startswith(self.TAG):
                self.buf = rest[len(self.TAG):]
                self.open_call(lead + self.TAG)
                self.state = "pre"
                return True
            if self.TAG.startswith(rest) and not self.final:
                return False
            return self._to_text()
        if s == "pre":
            return self.start_object()
        if s == "object":
            return self.scan_object("post")
        if s == "post":  # `;` and another call, or the end
            if not self.skip_ws():
                return False
            self.close_call()
            if self.buf[0] == ";":
                self.buf = self.buf[1:]
                self.open_call("")
                self.state = "pre"
            else:
                self.state = "rest"
            return True
        if s == "rest":
            if not self.buf:
                return False
            self.content(self.buf)
            self.buf = ""
            return True
        raise AssertionError(s)

    def _to_text(self) -> bool:
        self.state = "rest"
        return True



class Llama3JsonParser(ToolParser):
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}` (`;`-separated)."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)
    machine = _Llama3Machine


# ---- Mistral ---------------------------------------------------------------------------------
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


class _MistralMachine(ToolCallMachine):
    OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
    complete_state = "after"

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.in_array = False
        self.args_whole = False  # v11: the object is the arguments
        self.v11_name = ""

    def step(self) -> bool:
        s = self.state
        if s == "text":
            return self.open_at(self.OPEN, "pre")
        if s == "pre":
            if not self.skip_ws():
                return False
            c = self.buf[0]
            if c == "[":
                self.consume(1)
                self.in_array, self.state = True, "element"
            elif c == "{":
                self.in_array, self.state = False, "element"
            elif c in _NAME_CHARS:
                self.in_array, self.v11_name, self.state = False, "", "name"
            else:
                return self._fail()
            return True
        if s == "element":
            self.args_whole = False
            return self.start_object()
        if s == "name":
            n = 0
            while n < len(self.buf) and self.buf[n] in _NAME_CHARS:
                n += 1
            self.v11_name += self.consume(n)
            if not self.buf:
                return n > 0
            if self.buf.startswith(self.ARGS):
                self.consume(len(self.ARGS))
                self.state = "v11_args"
                return True
            if self.ARGS.startswith(self.buf) and not self.final:
                return n > 0
            return self._fail()
        if s == "v11_args":
            progressed = self.start_object()
            if self.state == "object":  # the object is the arguments of the name read
                assert self.call is not None
                self.call.name, self.args_whole = self.v11_name, True
            return progressed
        if s == "object":
            progressed = self.scan_object("after")
            if self.state == "after" and not self.in_array:  # a lone object: no `,` or `]`
                self.close_call()
                self.state = "text"
            return progressed
        if s == "after":  # inside the array: `,` and another call, or `]`
            if not self.skip_ws():
                return False
            c = self.buf[0]
            if c == "]":
                self.consume(1)
            self.close_call()
            if c == ",":
                self.buf = self.buf[1:]
                self.open_call("")
                self.state = "element"
            else:
                self.state = "text"
            return True
        raise AssertionError(s)

    def progress(self) -> bool:
        if not self.args_whole:
            return super().progress()
        assert self.scanner is not None and self.call is not None
        self.header()
        sc = self.scanner
        self.arguments_after(sc.span(self.call.args_sent, sc.size))
        return True

    def complete_call(self) -> bool:
        if not self.args_whole:
            return super().complete_call()
        assert self.scanner is not None
        self.header()
        self.arguments(self.scanner.text)
        return True



class MistralParser(ToolParser):
    """`[TOOL_CALLS][{"name": ..., "arguments": {...}}]` and `[TOOL_CALLS]name[ARGS]{...}`."""

    name = "mistral"
    markers = ("[TOOL_CALLS]", "[ARGS]")
    machine = _MistralMachine


# ---- the registry ----------------------------------------------------------------------------
PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
           "llama": "llama3_json"}
CHOICES = ("auto", "none", *PARSERS)
"""What `--tool-call-parser` accepts: a format, `auto` (from the template) or `none`."""


def tool_parser_class(name: str) -> type[ToolParser]:
    """The parser class of `name` (a format or an alias); raises InvalidParameterError."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise InvalidParameterError(
            f"unknown tool-call parser {name!r}: choose one of {', '.join(PARSERS)}",
            param="tool_call_parser")
    return PARSERS[key]


def detect_tool_parser(template: str | None) -> str | None:
    """The format a chat template's source speaks, or None when it has no tool calls."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters": dictionary' in template:
        return "llama3_json"
    return None


def resolve_tool_parser(setting: str | None, template: str | None) -> str | None:
    """The format to use: `setting` (a name, "none", or "auto"/None = from the template)."""
    if setting in (None, "auto"):
        return detect_tool_parser(template)
    if setting == "none":
        return None
    return tool_parser_class(setting).name
