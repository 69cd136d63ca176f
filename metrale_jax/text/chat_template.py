"""Rendering a model's Jinja chat template, as transformers' `apply_chat_template` does.

Templates come from model files, so they are untrusted code: they run in Jinja's
`ImmutableSandboxedEnvironment` (`trim_blocks`, `lstrip_blocks`, loop controls), with the names
Hugging Face templates expect:
- `raise_exception(message)`: the template refuses the conversation -> `ChatTemplateError`;
- `tojson` (not Jinja's HTML-escaping one): `json.dumps` with `ensure_ascii=False` and the
  `indent`, `separators`, `sort_keys` options;
- `strftime_now(format)`, `dict(...)`, `namespace(...)` (no underscore attributes);
- the `{% generation %}...{% endgeneration %}` block (rendered as its body);
- the variables `messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens
  (`bos_token`, `eos_token`, ...) and any extra keyword (e.g. `enable_thinking`).

As transformers does, message keys whose value is None are dropped (an OpenAI assistant message
with tool calls has `"content": null`), and a message's reasoning given as `reasoning_content`,
`thinking` or `reasoning` is passed under the first two names.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from metrale_jax.errors import ChatTemplateError
from metrale_jax.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaisedError(Exception):
    """What `raise_exception` raises inside the template (turned into ChatTemplateError)."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaisedError(str(message))


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})"
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks assistant text; rendered as its body."""

    tags = {"generation"}  # noqa: RUF012 - Jinja's extension API

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _prepare_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    prepared = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {index} is not an object", param="messages")
        clean = {key: value for key, value in message.items() if value is not None}
        reasoning = next((clean[k] for k in _REASONING_FIELDS if k in clean), None)
        if reasoning is not None:
            clean = {"thinking": reasoning, **clean, "reasoning_content": reasoning}
        prepared.append(clean)
    return prepared


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja source (from `tokenizer_config.json`, `chat_template.jinja` or GGUF's
            `tokenizer.chat_template`).
        bos_token, eos_token: the model's special token texts, given to the template.
        special_tokens: more template variables naming tokens (e.g. `{"pad_token": "<pad>"}`).

    Raises:
        ChatTemplateError: the source is not a valid Jinja template.
    """

    def __init__(
        self,
        source: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        *,
        special_tokens: Mapping[str, str] | None = None,
    ) -> None:
        self.source = source
        self._tokens = {
            **(special_tokens or {}),
            **({"bos_token": bos_token} if bos_token is not None else {}),
            **({"eos_token": eos_token} if eos_token is not None else {}),
        }
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as err:
            raise ChatTemplateError(
                f"the chat template is not valid Jinja (line {err.lineno}): {err.message}"
            ) from err

    @classmethod
    def require(
        cls,
        source: str | None,
        model_name: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
        **kwargs: Any,
    ) -> ChatTemplate:
        """A `ChatTemplate` for `source`; raise `ChatTemplateError` if the model has none."""
        if not source:
            raise ChatTemplateError(
                f"model {model_name} has no chat template; use the completions endpoint or "
                "give the model a chat template"
            )
        return cls(source, bos_token, eos_token, **kwargs)

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, model_name: str | None = None) -> ChatTemplate:
        """The template `tokenizer` carries, with its bos/eos tokens (see `require`)."""
        return cls.require(
            tokenizer.chat_template,
            model_name or tokenizer.name,
            tokenizer.bos_token,
            tokenizer.eos_token,
        )

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages` (`[{"role": ..., "content": ...}, ...]`).

        `tools` (JSON schemas) and every extra keyword (e.g. `enable_thinking=False`,
        `documents=[...]`) are passed to the template; keywords override the special tokens.

        Raises:
            ChatTemplateError: the template called `raise_exception`, or failed while rendering.
        """
        variables = {
            **self._tokens,
            "documents": None,
            **kwargs,
            "messages": _prepare_messages(messages),
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**variables)
        except _TemplateRaisedError as err:
            raise ChatTemplateError(f"the chat template refused the request: {err}") from err
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"the chat template failed: {err}") from err
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise ChatTemplateError(
                f"the chat template failed: {type(err).__name__}: {err}"
            ) from err
