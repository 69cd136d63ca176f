"""A chat answer's shape: reasoning, content and tool calls, complete and streamed.

`ChatOutput.for_request` decides, per request, which parsers run on the model's text: the
server's reasoning parser (`--reasoning-parser`, default: from the chat template) and, when
the request has tools and `tool_choice` is not "none" (and no `suppress_tool_call`), the tool-
call parser (`--tool-call-parser`, default: from the template). Text flows through them in
that order: thinking first (`reasoning_content`), then the answer, whose tool calls become
`tool_calls`. `message(text)` is the non-streamed `message`; `stream()` gives one choice's
`ChoiceStream`, whose deltas join to that message exactly.

`adjust_params` makes the request's `SamplingParams` fit: markers that are special tokens
must reach the text (`skip_special_tokens` off), "required" / named tool choices carry their
grammar, `thinking_budget` its forced end ids.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.http.reasoning import (
    ReasoningParser,
    ReasoningStream,
    end_of_thinking_ids,
    reasoning_parser_class,
    resolve_reasoning_parser,
    tag_texts,
    thinking_tag_ids,
)
from serving.http.tools.grammar import tool_call_grammar
from serving.http.tools.machine import Delta
from serving.http.tools.parsers import (
    ToolCallStream,
    ToolParser,
    resolve_tool_parser,
    tool_parser_class,
)
from serving.http.tools.request import ToolChoice

log = logging.getLogger(__name__)

PROMPT_TAIL_TOKENS = 16  # how much of the prompt's end tells whether it opened a <think>
MAX_TOOL_CALLS = 16
"""The most tool calls one answer returns (fewer with `parallel_tool_calls` false: one);
calls that repeat an earlier one of the answer (same name, same arguments) are dropped."""


class ChoiceStream:
    """One streamed choice: text pieces in, chat deltas out (`reasoning_content`, `content`,
    `tool_calls`)."""

    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self._reasoning = reasoning
        self._tools = tools

    def feed(self, text: str) -> list[Delta]:
        """The deltas that `text` (the next piece of output) completes."""
        if not text:
            return []
        pieces = self._reasoning.feed(text) if self._reasoning else [("content", text)]
        return self._answer(pieces, final=False)

    def finish(self, text: str = "") -> list[Delta]:
        """The last piece of output (a `Finished` event's text); every delta held back."""
        if self._reasoning is not None:
            pieces = [*self._reasoning.feed(text), *self._reasoning.finish()]
        else:
            pieces = [("content", text)] if text else []
        return self._answer(pieces, final=True)

    @property
    def called(self) -> bool:
        """True once a tool call went out."""
        return self._tools is not None and self._tools.called

    @property
    def done(self) -> bool:
        """True once a forced tool choice's answer is complete (`ToolCallStream.done`)."""
        return self._tools is not None and self._tools.done

    def _answer(self, pieces: Sequence[tuple[str, str]], final: bool) -> list[Delta]:
        out: list[Delta] = []
        for kind, text in pieces:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            elif self._tools is not None:
                out.extend(self._tools.feed(text))
            elif text:
                out.append({"content": text})
        if final and self._tools is not None:
            out.extend(self._tools.finish())
        return out


@dataclasses.dataclass(frozen=True)
class ChatOutput:
    """The parsers of one request (either may be None) and its tool choice.

    tool_format: the model's tool-call format (for the grammar of a forced tool choice, also
    when `suppress_tool_call` leaves the output unparsed).
    """

    tool_parser: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    choice: ToolChoice = dataclasses.field(default_factory=lambda: ToolChoice("none"))
    tool_format: str | None = None

    @classmethod
    def for_request(cls, settings: Any, template: str | None, choice: ToolChoice,
                    suppress_tool_call: bool, prompt_tail: str,
                    constrained: bool = False) -> ChatOutput:
        """The parsers a request gets.

        Args:
            settings: the `ServerSettings` (`tool_call_parser`, `reasoning_parser`).
            template: the model's chat template source (for the automatic choices).
            choice: the request's validated tool choice.
            suppress_tool_call: the request's extension field: no tool-call parsing.
            prompt_tail: the end of the rendered prompt (does it open a `<think>`?).
            constrained: the request's output follows a grammar (response_format, regex,
                ...): then there is no thinking to split off (a grammar from the first token
                has none), also when the prompt opened a `<think>`.

        Raises:
            InvalidParameterError: tools may be called but the model has no tool-call format.
        """
        tool_parser, tool_format = None, None
        if choice.mode != "none" and (choice.constrained or not suppress_tool_call):
            tool_format = resolve_tool_parser(getattr(settings, "tool_call_parser", None),
                                              template)
            if tool_format is None:
                raise InvalidParameterError(
                    "this model's chat template has no tool-call format to parse: start the "
                    "server with --tool-call-parser NAME, or send tool_choice 'none'",
                    param="tools")
            if not suppress_tool_call:
                tool_parser = tool_parser_class(tool_format)(
                    max_calls=choice.max_calls or MAX_TOOL_CALLS, unique=True,
                    forced=choice.constrained)
        name = resolve_reasoning_parser(getattr(settings, "reasoning_parser", None), template)
        if constrained or choice.constrained:
            name = None
        reasoning = reasoning_parser_class(name)(prompt_tail) if name else None
        return cls(tool_parser, reasoning, choice, tool_format)

    @property
    def active(self) -> bool:
        """True when any parser runs (else the answer is the text, unchanged)."""
        return self.tool_parser is not None or self.reasoning is not None

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """The non-streamed assistant `message` of `text`, and whether it calls tools."""
        s = self.stream()
        deltas = [*s.feed(text), *s.finish()]
        return assemble_message(deltas, self.reasoning is not None), s.called

    def stream(self) -> ChoiceStream:
        """The streaming shaper of one choice."""
        return ChoiceStream(self.reasoning.stream() if self.reasoning else None,
                            self.tool_parser.stream() if self.tool_parser else None)

    def early_stop(self) -> Callable[[], Callable[[str], bool]] | None:
        """For a forced tool choice ("required" or a named function) with a parser: makes,
        per choice, a watcher fed each piece of output text that answers True once the
        answer can hold nothing more (a call repeating an earlier one, or one past
        `parallel_tool_calls` false's single call), so `Generation` ends the choice there
        with finish reason "stop" (the answer's "tool_calls"). None otherwise."""
        if self.tool_parser is None or not self.choice.constrained:
            return None

        def watcher() -> Callable[[str], bool]:
            s = self.stream()

            def feed(text: str) -> bool:
                s.feed(text)
                return s.done
            return feed
        return watcher

    @staticmethod
    def finish_reason(reason: str | None, called: bool) -> str | None:
        """"tool_calls" for an answer that ended normally ("stop") after calling tools."""
        return "tool_calls" if called and reason == "stop" else reason

    # ---- what the engine must do for it ----------------------------------------------------
    def markers(self) -> tuple[str, ...]:
        """The texts the parsers look for."""
        out: list[str] = []
        if self.tool_parser is not None:
            out.extend(self.tool_parser.markers)
        if self.reasoning is not None:
            out.extend(tag_texts())
        return tuple(out)

    def adjust_params(self, params: Any, tokenizer: Any, tools: Sequence[Any] | None,
                      thinking_budget: int | None) -> Any:
        """`params` (`SamplingParams`) as this output needs them.

        - A marker that is a special token would be dropped from the text: such requests
          decode with `skip_special_tokens=False` (as vLLM's parsers do).
        - "required" / a named function: the grammar of `tool_call_grammar` as the request's
          constraint.
        - `thinking_budget`: a `ThinkingBudgetSpec` with the tag ids.

        Raises:
            InvalidParameterError: what the request needs is not available (no reasoning
                parser for a thinking budget) or conflicts (a budget with a constraint).
        """
        changes: dict[str, Any] = {}
        single = single_token_markers(tokenizer, self.markers())
        if params.skip_special_tokens and any(tokenizer.is_special(i) for i in single.values()):
            changes["skip_special_tokens"] = False
        if self.choice.constrained:
            assert self.tool_format is not None
            special = single_token_markers(tokenizer, tool_parser_class(self.tool_format).markers)
            grammar = tool_call_grammar(tools or (), self.choice, self.tool_format,
                                        special=special)
            changes.update(constraint_field(params, grammar["grammar"]))
        if thinking_budget is not None:
            if changes.get("constraint", params.constraint) is not None:
                raise InvalidParameterError(
                    "thinking_budget cannot be combined with constrained output (a forced tool "
                    "choice, response_format, regex, choice or grammar)",
                    param="thinking_budget")
            changes.update(self._thinking_field(params, tokenizer, thinking_budget))
        return dataclasses.replace(params, **changes) if changes else params

    def _thinking_field(self, params: Any, tokenizer: Any, budget: int) -> dict[str, Any]:
        if self.reasoning is None:
            raise InvalidParameterError(
                "thinking_budget needs a reasoning parser: this model's template has no "
                "<think> tags (start the server with --reasoning-parser NAME)",
                param="thinking_budget")
        from metrale_jax.scheduler.thinking import ThinkingBudgetSpec
        start, close = thinking_tag_ids(tokenizer)
        spec = ThinkingBudgetSpec(budget, start, close, end_of_thinking_ids(tokenizer),
                                  open=self.reasoning.open)
        return {"thinking_budget": spec}


def assemble_message(deltas: Sequence[Delta], with_reasoning: bool) -> dict[str, Any]:
    """The assistant `message` that chat deltas make (content None when it is only calls
    or only thinking)."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for chunk in d.get("tool_calls", ()):
            call = calls.setdefault(chunk["index"], {"id": "", "type": "function",
                                                     "function": {"name": "", "arguments": ""}})
            call["id"] = chunk.get("id", call["id"])
            fn = chunk.get("function", {})
            call["function"]["name"] += fn.get("name", "")
            call["function"]["arguments"] += fn.get("arguments", "")
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not (calls or reasoning) else None,
        "refusal": None}
    if with_reasoning:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message


def single_token_markers(tokenizer: Any, markers: Sequence[str]) -> dict[str, int]:
    """The markers that are one token of `tokenizer` (added tokens), to their ids."""
    out = {}
    for text in markers:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1:
            out[text] = int(ids[0])
    return out


def constraint_field(params: Any, grammar: str) -> dict[str, Any]:
    """The `SamplingParams` change that constrains a request to the Lark `grammar`.

    Raises:
        InvalidParameterError: the request already has another constraint.
    """
    from metrale_jax.scheduler.constraints import Constraint
    if params.constraint is not None:
        raise InvalidParameterError(
            "tool_choice 'required' or a named function cannot be combined with "
            "response_format, regex, choice or grammar", param="tool_choice")
    return {"constraint": Constraint("grammar", grammar)}
