"""The request bodies of the OpenAI API (plus vLLM's extras) as pydantic models.

Validation happens here, before anything is queued: wrong types and out-of-range values become
`InvalidParameterError` (HTTP 400) naming the parameter (`SamplingParams` checks the rest).
Parameters the engine does not implement yet are accepted only at their default value;
anything else is a 400 that says so.
Unknown fields are kept (`extra="allow"`) so the app can log them and name them in a header.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Mapping
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from metrale_jax.errors import InvalidParameterError
from metrale_jax.sampling_fields import FIELD, REQUIRED, api_bound, api_default, spellings
from metrale_jax.scheduler import SamplingParams
from metrale_jax.scheduler.waiting import PRIORITY_MAX, PRIORITY_MIN
from serving.http.tools.request import ToolChoice, parse_tool_choice, template_tool_calls

TokenIds = list[Annotated[int, Field(ge=0)]]
Priority = Annotated[int, Field(strict=True, ge=PRIORITY_MIN, le=PRIORITY_MAX)]
"""vLLM's request `priority`: an integer (no float, bool or string), lower first, default 0;
a signed 32-bit value (scheduler/waiting.py)."""


class RequestBody(BaseModel):
    """Common config: unknown fields allowed (reported), no coercion of strings to numbers."""

    model_config = ConfigDict(extra="allow", strict=False, protected_namespaces=())

    # Ollama's: how long the model stays loaded once idle ("5m", seconds, 0, -1; checked by
    # serving/http/model_catalog.parse_keep_alive when the model is acquired).
    keep_alive: float | str | None = None
    # Metrale's: the inter-token latency this request wants while it decodes (ms; clamped
    # by the server to [scheduler/step_time.FLOOR_MS, --max-itl-ms]).
    max_itl_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None

    def unknown_fields(self) -> list[str]:
        """Names of fields this server does not know (ignored)."""
        return sorted((self.model_extra or {}).keys())


class StreamOptions(BaseModel):
    """`stream_options`: `include_usage` adds a final chunk with the usage."""

    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class LoraScale(BaseModel):
    """One adapter of llama.cpp's `lora` list: its `id` (GET /lora-adapters) and `scale`."""

    model_config = ConfigDict(extra="forbid")
    id: Annotated[int, Field(ge=0)]
    scale: Annotated[float, Field(allow_inf_nan=False)]


def lora_weights(items: list[LoraScale], names: dict[int, str]) -> dict[str, float]:
    """llama.cpp's `[{"id", "scale"}]` as {adapter name: weight}; `names`: id -> name of the
    loaded adapters. Raises `InvalidParameterError` (param "lora") for an unknown or repeated
    id."""
    out: dict[str, float] = {}
    for item in items:
        if item.id not in names:
            known = ", ".join(str(i) for i in sorted(names)) or "none"
            raise InvalidParameterError(f"no LoRA adapter has id {item.id} (ids: {known}; "
                                        "GET /lora-adapters lists them)", param="lora")
        if names[item.id] in out:
            raise InvalidParameterError(f"the LoRA adapter id {item.id} is given twice",
                                        param="lora")
        out[names[item.id]] = item.scale
    return out


class Speculative(BaseModel):
    """`speculative`: this request's speculative decoding (prompt lookup): up to `num_tokens`
    draft tokens per step, at most the server's --speculative-tokens (0 = off)."""

    model_config = ConfigDict(extra="forbid")
    num_tokens: Annotated[int, Field(ge=0, le=64)]


def api_fields(api: str) -> dict[str, Any]:
    """The pydantic field definitions of an API's spellings of the sampling fields
    (`metrale_jax.sampling_fields.SPELLINGS`; those the request models declare in their own
    shape left out): the JSON type, the API's bound as constraints, the API's default (None:
    unset, the field's default applies)."""
    out: dict[str, Any] = {}
    for s in spellings(api):
        if s.own:
            continue
        f = FIELD[s.field]
        kind = s.json if s.json is not None else _JSON_TYPES[f.kind]
        if s.items is not None:
            kind = list[Annotated[int, Field(**s.items.pydantic())]]
        bound = api_bound(s)
        constraints = {**(bound.pydantic() if bound is not None and s.items is None else {}),
                       **s.constraints}
        if constraints.pop("strict", False):  # no coercion (a union's members one by one)
            kind = functools.reduce(operator.or_, (Annotated[member, Field(strict=True)]
                                                   for member in get_args(kind) or (kind,)))
        if constraints:
            kind = Annotated[kind, Field(**constraints)]
        default = api_default(s)
        if default is REQUIRED:
            out[s.name] = (kind, ...)
        elif default is None:
            out[s.name] = (kind | None, None)
        else:
            out[s.name] = (kind, default)
    return out


_JSON_TYPES = {"number": float, "integer": int, "flag": bool}


class SamplingRequestBase(RequestBody):
    """The fields of chat and completions besides the sampling table's spellings."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    priority: Priority = 0  # vLLM's: lower first (a request field, not a sampling one)
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_token_ids: bool = False
    # Constrained decoding (besides chat's response_format): the whole output matches a
    # regex, is one of `choice`, or follows a Lark / GBNF `grammar` (llguidance).
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # Metrale's: seconds until the request ends with a timeout error.
    timeout: Annotated[float, Field(gt=0)] | None = None
    # vLLM's: a secret that keeps this request's prefix-cache pages apart from requests
    # without the same salt (one caller cannot learn another's prompts from timing).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # llama.cpp's: the LoRA adapters of this request and their scales (an adapter not listed
    # gets 0; [] is the base model). Without it: the adapter named by `model`, else the
    # server's active adapters (POST /lora-adapters).
    lora: list[LoraScale] | None = None
    # Beam search (transformers' and llama.cpp's num_beams; vLLM's use_beam_search): the n
    # best hypotheses as the n choices; not streamable.
    use_beam_search: bool = False
    # Translation models (serving/http/translation.py): FLORES-200 codes of the text's and
    # the translation's languages, or NLLB's src_lang / tgt_lang; omitted (or "" or 0): the
    # server's --source-lang / --target-lang. Checked against the tokenizer's codes there.
    source_lang: Any = None
    target_lang: Any = None
    src_lang: Any = None
    tgt_lang: Any = None
    # Metrale's: speculative decoding with prompt lookup ({"num_tokens": k}; default: the
    # server's --speculative-tokens).
    speculative: Speculative | None = None

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidParameterError("stream_options is only allowed when stream is true",
                                        param="stream_options")
        if self.beams > 1 and self.stream:
            raise InvalidParameterError(
                "stream is not supported with beam search (num_beams > 1): a beam's text is "
                "not final until the search ends", param="stream")
        if 1 < self.beams < self.n:
            raise InvalidParameterError(f"n ({self.n}) must be at most num_beams "
                                        f"({self.beams}) with beam search", param="n")

    @property
    def beams(self) -> int:
        """The beam search's width: num_beams, else n with use_beam_search, else 1."""
        if self.num_beams is not None:
            return self.num_beams
        return self.n if self.use_beam_search else 1

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """The scheduler's `SamplingParams` of one choice: every field the body set under its
        OpenAI spelling (unset: `defaults`, the model's generation config, then the field's
        default), then those carried by properties."""
        values: dict[str, Any] = {}
        for s in spellings("openai"):
            value = None if s.via else getattr(self, s.name)
            if value is not None:
                values[s.field] = s.convert(value) if s.convert is not None else value
        for field, value in (defaults or {}).items():
            values.setdefault(field, value)
        return SamplingParams(
            **values, max_tokens=max_tokens, logprobs=logprobs, constraint=self.constraint(),
            num_beams=self.beams, speculative_tokens=(
                None if self.speculative is None else self.speculative.num_tokens))

    def constraint(self) -> Any:
        """The request's one output constraint (`scheduler.constraints.Constraint`) or None;
        raises `InvalidParameterError` when it has more than one or a malformed one."""
        rf = getattr(self, "response_format", None)
        if rf is None and self.regex is None and self.choice is None and self.grammar is None:
            return None
        from metrale_jax.scheduler.constraints import Constraint
        return Constraint.from_request(
            response_format=rf.model_dump(exclude_none=True) if rf is not None else None,
            regex=self.regex, choice=self.choice, grammar=self.grammar)

    @property
    def include_usage(self) -> bool:
        """True when a streamed answer ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


SamplingRequest = create_model(
    "SamplingRequest", __base__=SamplingRequestBase, __module__=__name__,
    **api_fields("openai"),
    __doc__="The fields shared by chat and completions: `SamplingRequestBase`'s, and the "
            "sampling fields under their OpenAI spellings (with vLLM's and llama.cpp's "
            "extras), derived from `metrale_jax.sampling_fields.SPELLINGS`.")


class ChatMessage(BaseModel):
    """One message; `content` is a string or an array of content parts."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ResponseFormat(BaseModel):
    """`response_format`: `text`, `json_object`, or `json_schema` with `json_schema: {name,
    schema, strict}` (constrained decoding)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # extensions: tool calls left unparsed; thinking on/off (as chat_template_kwargs has it)
    # and a budget of thinking tokens (serving/http/chat_output.py, serving/http/reasoning.py)
    suppress_tool_call: bool = False
    enable_thinking: bool | None = None
    thinking_budget: Annotated[int, Field(ge=0)] | None = None

    def validate_semantics(self) -> None:
        """Cross-field checks and unsupported parameters (raises `InvalidParameterError`)."""
        self._check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameterError("top_logprobs requires logprobs to be true",
                                        param="top_logprobs")
        self.tool_choice_spec()

    @property
    def max_new_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens, else None (to the end of the context)."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """The scheduler's `logprobs` setting: None = none, k = the top-k alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_choice_spec(self) -> ToolChoice:
        """`tools`, `tool_choice` and `parallel_tool_calls`, validated (400s name the field)."""
        return parse_tool_choice(self.tools, self.tool_choice, self.parallel_tool_calls)

    def template_kwargs(self) -> dict[str, Any]:
        """Extra chat template variables: `chat_template_kwargs`, and `enable_thinking`."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.enable_thinking is not None:
            kwargs["enable_thinking"] = self.enable_thinking
        return kwargs

    def message_text(self, index: int) -> str:
        """The text of message `index` (its content parts joined; "" for none)."""
        return _content_text(self.messages[index].content, index)

    def template_messages(self, images: bool = False) -> list[dict[str, Any]]:
        """The messages as the chat template wants them (tool call arguments as dicts).

        images: False (a text-only model): content parts joined into text, an image part is
        a 400. True (a vision-language model): a list of content parts stays a list, each
        text part as `{"type": "text", "text": ...}` and each image part as sent, in place
        (`metrale_jax.vision.prompt.split_image_parts` takes them from there).
        """
        out = []
        for i, m in enumerate(self.messages):
            content = _content_parts(m.content, i) if images and isinstance(m.content, list) \
                else _content_text(m.content, i)
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": content}
            for key in ("name", "tool_calls", "tool_call_id"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls is not None:
                msg["tool_calls"] = template_tool_calls(m.tool_calls, i)
            for key in ("reasoning_content", "reasoning"):  # earlier thinking, if sent back
                if isinstance((m.model_extra or {}).get(key), str):
                    msg[key] = m.model_extra[key]
            out.append(msg)
        return out


IMAGE_PART_TYPES = ("image_url", "input_image", "image")
"""Content part types that carry an image (as `metrale_jax.vision.prompt` reads them)."""


def _content_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        param = f"messages[{index}].content[{j}]"
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in IMAGE_PART_TYPES:
            raise InvalidParameterError("this model takes no images: it is a text-only model",
                                        param=param)
        else:
            _refuse_part(kind, param, "only text")
    return "".join(texts)


def _content_parts(content: list[dict[str, Any]], index: int) -> list[dict[str, Any]]:
    """A vision-language model's content parts: text parts normalized, image parts kept."""
    out = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in ("text", "input_text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in IMAGE_PART_TYPES:
            out.append(part)
        else:
            _refuse_part(kind, f"messages[{index}].content[{j}]", "only text and images")
    return out


def _refuse_part(kind: Any, param: str, accepted: str) -> None:
    if kind in ("input_audio", "audio_url", "file", "video_url"):
        raise InvalidParameterError(f"{kind} content parts are not supported: {accepted}",
                                    param=param)
    raise InvalidParameterError(f"unknown content part type {kind!r}", param=param)


def image_parts(messages: list[ChatMessage]) -> list[str]:
    """Where the image parts of `messages` are (`messages[i].content[j]`), in order."""
    return [f"messages[{i}].content[{j}]" for i, m in enumerate(messages)
            if isinstance(m.content, list)
            for j, part in enumerate(m.content) if part.get("type") in IMAGE_PART_TYPES]


class CompletionRequest(SamplingRequest):
    """POST /v1/completions: prompt is a string, strings, token ids or lists of token ids."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
    suffix: str | None = None

    def validate_semantics(self) -> None:
        """Cross-field checks and unsupported parameters (raises `InvalidParameterError`)."""
        self._check_unsupported()
        if self.best_of not in (None, self.n):
            raise InvalidParameterError("best_of is not supported yet: omit it or set it to n",
                                        param="best_of")
        if self.suffix:
            raise InvalidParameterError("suffix is not supported yet", param="suffix")
        if self.echo and self.logprobs is not None:
            raise InvalidParameterError(
                "echo with logprobs is not supported yet (prompt logprobs)", param="echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidParameterError("prompt must not be empty", param="prompt")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one entry each: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)

    @property
    def max_new_tokens(self) -> int:
        """max_tokens, else the field's default (16, OpenAI's for completions)."""
        return self.max_tokens or FIELD["max_tokens"].default


class TokenizeRequest(RequestBody):
    """POST /tokenize (vLLM): a `prompt`, or chat `messages` rendered with the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    """POST /detokenize (vLLM)."""

    model: str | None = None
    tokens: TokenIds


def parse(model: type[RequestBody], body: Any) -> Any:
    """Validates a decoded JSON body; pydantic errors become one `InvalidParameterError`."""
    if not isinstance(body, dict):
        raise InvalidParameterError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = err.get("loc", ())
        param = ".".join(str(x) for x in loc if not _is_type_tag(x)) or None
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            raise InvalidParameterError(f"missing required parameter {param!r}",
                                        param=param) from None
        got = err.get("input")
        raise InvalidParameterError(f"invalid value for {param!r}: {msg} (got {_short(got)})",
                                    param=param) from None


def _is_type_tag(x: Any) -> bool:
    # pydantic puts union member names (`str`, `list[int]`, ...) into error locations.
    return isinstance(x, str) and (x in ("str", "int", "float", "bool", "dict") or "[" in x
                                   or x.startswith(("constrained-", "function-")))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

