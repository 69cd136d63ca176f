"""Translation models (NLLB / M2M100) behind OpenAI's chat/completions API.

When the served model is an encoder-decoder (`ModelRuntime.is_translation`):
- `POST /v1/chat/completions` translates the last user message's content (a string, or its
  text parts joined); the other messages (a system prompt, earlier turns) are not read.
- `POST /v1/completions` translates the prompt; a list of strings is one translation per
  prompt (each with its n choices). Token-id prompts are refused: send text.
- The languages are FLORES-200 codes in `source_lang` / `target_lang` (NLLB's names
  `src_lang` / `tgt_lang` work too; both spellings with different values is a 400). Omitted,
  the server's `--source-lang` / `--target-lang` apply (`metrale_jax.text.translation`).
- Sampling, `n`, beam search (`num_beams`, `length_penalty`, `early_stopping`), stop strings,
  logprobs and streaming (without beams) work as for a chat model. What only makes sense for
  a chat model (tools, structured output and other constraints, reasoning and chat template
  options, `echo`) is a 400 naming the field, rather than silently ignored.

On a decoder-only model the language fields are a 400 saying they are for translation models.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from metrale_jax.errors import InvalidParameterError
from metrale_jax.text.translation import TranslationInputs, translation_inputs

LANGUAGE_FIELDS = (("source_lang", "src_lang"), ("target_lang", "tgt_lang"))
"""Each language's field and its alias (NLLB's tokenizer arguments)."""

CHAT_ONLY_EXTRAS = ("functions", "function_call", "reasoning_effort", "reasoning",
                    "guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""Fields of other servers' chat APIs that this one does not declare (a chat model ignores
them as unknown fields); a translation model refuses them, as it refuses the declared ones."""


def _refuse(field: str, why: str = "") -> InvalidParameterError:
    return InvalidParameterError(
        f"{field} is not supported by a translation model{why}: send the text to translate "
        "and, if needed, source_lang and target_lang", param=field)


def languages(req: Any) -> tuple[Any, Any]:
    """The (source, target) languages a request names, either spelling (None when it names
    none); a 400 when the two spellings of one language disagree."""
    out = []
    for name, alias in LANGUAGE_FIELDS:
        value, other = getattr(req, name, None), getattr(req, alias, None)
        if value is not None and other is not None and value != other:
            raise InvalidParameterError(f"{name} ({value!r}) and {alias} ({other!r}) differ: "
                                        "give one of them", param=name)
        out.append(value if value is not None else other)
    return out[0], out[1]


def refuse_languages(req: Any, model_name: str) -> None:
    """On a decoder-only model: a 400 when the request names a language."""
    for name, alias in LANGUAGE_FIELDS:
        for field in (name, alias):
            if getattr(req, field, None) is not None:
                raise InvalidParameterError(
                    f"{field} is for translation models; {model_name!r} is a decoder-only "
                    "model: ask for the translation in the prompt instead", param=field)


def _check_common(req: Any) -> None:
    """Fields that neither chat nor completions support on a translation model."""
    for field in ("regex", "choice", "grammar"):
        if getattr(req, field, None) is not None:
            raise _refuse(field, " (constrained decoding)")
    extra = req.model_extra or {}
    for field in CHAT_ONLY_EXTRAS:
        if extra.get(field) is not None and not (field == "function_call"
                                                 and extra[field] == "none"):
            raise _refuse(field)


def check_chat_request(req: Any) -> None:
    """A 400 naming the first field of a chat request a translation model cannot honour:
    tools (and a tool_choice other than "none"), a response_format other than text, the
    output constraints, reasoning and chat template options."""
    if req.tools:
        raise _refuse("tools")
    if req.tool_choice not in (None, "none"):
        raise _refuse("tool_choice")
    if req.response_format is not None and req.response_format.type != "text":
        raise _refuse("response_format", f" (type {req.response_format.type!r}: only "
                                         "'text')")
    for field in ("chat_template_kwargs", "enable_thinking", "thinking_budget"):
        if getattr(req, field) not in (None, {}):
            raise _refuse(field, " (it has no chat template and does not think)")
    _check_common(req)


def check_completion_request(req: Any) -> None:
    """A 400 for a completion request a translation model cannot honour: `echo`, output
    constraints, and token-id prompts (the text is tokenized with its language)."""
    if req.echo:
        raise _refuse("echo")
    _check_common(req)
    if any(not isinstance(p, str) for p in req.prompts):
        raise InvalidParameterError(
            "a translation model needs the text to translate: send the prompt as a string "
            "(or a list of strings), not token ids", param="prompt")


def chat_text(req: Any) -> str:
    """The text a chat request asks to translate: its last user message's content."""
    for i in range(len(req.messages) - 1, -1, -1):
        if req.messages[i].role == "user":
            return req.message_text(i)
    raise InvalidParameterError("a translation model translates the last user message; "
                                "this request has none", param="messages")


def inputs(tokenizer: Any, texts: Sequence[str], req: Any, default_source: str | None,
           default_target: str | None, prompt_param: str) -> list[TranslationInputs]:
    """Each text's `TranslationInputs` (source ids, decoder prompt ids) in the request's
    languages (else the defaults); errors about the text point at `prompt_param`."""
    source, target = languages(req)
    out = []
    for text in texts:
        try:
            out.append(translation_inputs(tokenizer, text, source, target, default_source,
                                          default_target))
        except InvalidParameterError as e:
            if e.param == "prompt":
                e.param = prompt_param
            raise
    return out


def model_info(tokenizer: Any, source_lang: str | None,
               target_lang: str | None) -> dict[str, Any]:
    """The `translation` entry of a translation model's /v1/models card: its default
    languages (null: none, a request must name it) and every code it knows."""
    return {"source_lang": source_lang, "target_lang": target_lang,
            "languages": list(tokenizer.lang_codes())}


__all__ = ["CHAT_ONLY_EXTRAS", "LANGUAGE_FIELDS", "chat_text", "check_chat_request",
           "check_completion_request", "inputs", "languages", "model_info",
           "refuse_languages"]
