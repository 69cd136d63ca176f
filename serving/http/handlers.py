"""POST /v1/chat/completions and /v1/completions: validate, tokenize, submit, answer.

On a translation model the text to translate and its languages come from the same requests
(serving/http/translation.py) and the answers have the same shapes.

Non-streaming answers collect every choice; streaming answers are SSE chunks in OpenAI's order
(role delta, content deltas, the finish chunk of each choice, the usage chunk, `[DONE]`). An
error after the stream started is sent as an error event followed by `[DONE]`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.scheduler import Finished, Token
from serving.http import translation, vision
from serving.http.chat_output import ChatOutput, ChoiceStream
from serving.http.errors import InternalError
from serving.http.generation import ChoiceState, Generation
from serving.http.protocol import ChatCompletionRequest, CompletionRequest
from serving.http.responses import (
    DONE,
    Envelope,
    chat_logprobs,
    chat_message,
    completion_logprobs,
    sse,
)
from serving.http.runtime import ModelRuntime
from serving.http.state import ServerState

log = logging.getLogger(__name__)


class Prepared:
    """A validated, submitted request: what the response writers need."""

    def __init__(self, gen: Generation, env: Envelope, stream: bool, include_usage: bool,
                 logprobs: bool, echo: list[str] | None = None, token_ids: bool = False):
        self.gen = gen
        self.token_ids = token_ids  # return_token_ids: prompt and output ids (vLLM's shape)
        self.env = env
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.echo = echo
        self.on_error: Callable[[MetraleError], None] | None = None  # errors sent in a stream
        self.sent_done = False  # a stream's last event ([DONE]) was sent
        self.output: ChatOutput | None = None  # chat: reasoning / tool-call parsing, if any


def _timeout(state: ServerState, requested: float | None) -> float | None:
    return requested if requested is not None else state.settings.request_timeout


async def prepare_chat(state: ServerState, req: ChatCompletionRequest,
                       request_id: str) -> Prepared:
    """Validates a chat request against the model, renders and tokenizes it (a
    vision-language model's images are loaded in a worker thread), submits it."""
    rt, lora = await state.use_model(req.model, req.lora, req.keep_alive, generate=True)
    name = rt.settings.model_name
    if rt.vision is None:
        vision.refuse_images(req, name)
    if rt.is_translation:
        translation.check_chat_request(req)
        req.validate_semantics()
        params = dataclasses.replace(req.sampling_params(
            req.max_new_tokens, req.num_logprobs, rt.checkpoint.sampling_defaults), lora=lora)
        gen = _translate(state, rt, req, [translation.chat_text(req)], params, request_id,
                         "messages")
        env = Envelope("chatcmpl", "chat.completion", name, rt.fingerprint)
        return Prepared(gen, env, req.stream, req.include_usage, req.logprobs,
                        token_ids=req.return_token_ids)
    translation.refuse_languages(req, name)
    req.validate_semantics()
    render = dict(add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                  **req.template_kwargs())
    images: tuple[Any, ...] = ()
    if rt.vision is None:
        prompt = rt.encode_chat(req.template_messages(), **render)
    else:
        prompt, images = await vision.chat_prompt(rt, req, **render)
        state.refuse_draining()  # still serving after the images loaded
    params = dataclasses.replace(req.sampling_params(req.max_new_tokens, req.num_logprobs,
                                                     rt.checkpoint.sampling_defaults),
                                 lora=lora)
    output = ChatOutput.for_request(
        state.settings, rt.checkpoint.chat_template, req.tool_choice_spec(),
        req.suppress_tool_call, rt.decode(prompt[-16:], skip_special_tokens=False),
        constrained=getattr(params, "constraint", None) is not None)
    params = output.adjust_params(params, rt.tokenizer, req.tools, req.thinking_budget)
    gen = Generation(rt, state.metrics, [prompt], params, req.n,
                     _timeout(state, req.timeout), request_id, cache_salt=req.cache_salt,
                     max_itl_ms=req.max_itl_ms,
                     images=[images], **state.access.generation_options(req.priority))
    gen.stop_when(output.early_stop())  # a forced tool choice ends at its last call
    gen.check()
    state.access.submit(gen)  # reserves its tokens against the key's limits
    env = Envelope("chatcmpl", "chat.completion", name, rt.fingerprint)
    prep = Prepared(gen, env, req.stream, req.include_usage, req.logprobs,
                    token_ids=req.return_token_ids)
    prep.output = output if output.active else None
    return prep


async def prepare_completion(state: ServerState, req: CompletionRequest,
                             request_id: str) -> Prepared:
    """Validates a completion request, tokenizes its prompts, submits every choice."""
    rt, lora = await state.use_model(req.model, req.lora, req.keep_alive, generate=True)
    name = rt.settings.model_name
    if rt.is_translation:
        translation.check_completion_request(req)
        req.validate_semantics()
        params = dataclasses.replace(req.sampling_params(req.max_new_tokens, req.logprobs,
                                                         rt.checkpoint.sampling_defaults),
                                     lora=lora)
        gen = _translate(state, rt, req, [str(p) for p in req.prompts], params, request_id,
                         "prompt")
        env = Envelope("cmpl", "text_completion", name, rt.fingerprint)
        return Prepared(gen, env, req.stream, req.include_usage, req.logprobs is not None,
                        token_ids=req.return_token_ids)
    translation.refuse_languages(req, name)
    req.validate_semantics()
    prompts, texts = [], []
    for p in req.prompts:
        if isinstance(p, str):
            prompts.append(rt.tokenizer.encode(p, add_special_tokens=True))
            texts.append(p)
        else:
            prompts.append(list(p))
            texts.append(rt.decode(p, skip_special_tokens=False) if req.echo else "")
    params = dataclasses.replace(req.sampling_params(req.max_new_tokens, req.logprobs,
                                                         rt.checkpoint.sampling_defaults),
                                 lora=lora)
    gen = Generation(rt, state.metrics, prompts, params, req.n,
                     _timeout(state, req.timeout), request_id, cache_salt=req.cache_salt,
                     max_itl_ms=req.max_itl_ms,
                     **state.access.generation_options(req.priority))
    gen.check("prompt")
    state.access.submit(gen)  # reserves its tokens against the key's limits
    env = Envelope("cmpl", "text_completion", name, rt.fingerprint)
    echo = [texts[c.prompt_index] for c in gen.choices] if req.echo else None
    return Prepared(gen, env, req.stream, req.include_usage, req.logprobs is not None, echo,
                    token_ids=req.return_token_ids)


def _translate(state: ServerState, rt: ModelRuntime, req: Any, texts: list[str],
               params: Any, request_id: str, prompt_param: str) -> Generation:
    """Submits the translations of `texts` (n choices each) in the request's languages;
    `prompt_param` is the field errors about the text name ("messages" or "prompt")."""
    s = rt.settings
    inputs = translation.inputs(rt.tokenizer, texts, req, s.source_lang, s.target_lang,
                                prompt_param)
    gen = Generation(rt, state.metrics, [x.prompt for x in inputs], params, req.n,
                     _timeout(state, req.timeout), request_id, cache_salt=req.cache_salt,
                     max_itl_ms=req.max_itl_ms,
                     sources=[x.source for x in inputs],
                     **state.access.generation_options(req.priority))
    gen.check(prompt_param)
    state.access.submit(gen)  # reserves its tokens against the key's limits
    return gen


async def collect(prep: Prepared) -> None:
    """Runs every choice to its end (raises the first error, cancelling the others)."""
    async for _ in prep.gen.events():
        pass


def chat_body(prep: Prepared, rt: ModelRuntime) -> dict[str, Any]:
    """The non-streaming chat.completion body."""
    gen = prep.gen
    choices = []
    for c in gen.choices:
        message, finish_reason = chat_message(c.output), c.finish_reason
        if prep.output is not None:
            message, called = prep.output.message(c.output)
            finish_reason = prep.output.finish_reason(finish_reason, called)
        choices.append({"index": c.index, "message": message,
                        "logprobs": chat_logprobs(c.logprobs, rt.token_str)
                        if prep.logprobs else None,
                        "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        if prep.token_ids:
            choices[-1]["token_ids"] = list(c.token_ids)
    body = prep.env.body(choices, gen.usage())
    if prep.token_ids:
        body["prompt_token_ids"] = list(gen.requests[0].prompt_ids)
    return body


def outcome(prep: Prepared) -> tuple[list[str | None], list[str | None]]:
    """Each choice's finish reason and text as the client saw them (a whole answer or a
    stream's deltas together): a chat choice's `message.content` (None when it had none, as
    with only tool calls), a completion's `text` (its echo included); a choice cut short has
    the text so far and finish reason None. For request dumps."""
    reasons: list[str | None] = []
    texts: list[str | None] = []
    chat = prep.env.object.startswith("chat.")
    for c in prep.gen.choices:
        reason, text = c.finish_reason, c.output
        if chat and prep.output is not None:
            message, called = prep.output.message(text)
            text = message.get("content")
            reason = prep.output.finish_reason(reason, called) if reason is not None else None
        elif not chat and prep.echo:
            text = prep.echo[c.index] + text
        reasons.append(reason)
        texts.append(text)
    return reasons, texts


def completion_body(prep: Prepared, rt: ModelRuntime) -> dict[str, Any]:
    """The non-streaming text_completion body."""
    gen = prep.gen
    choices = []
    for c in gen.choices:
        prefix = prep.echo[c.index] if prep.echo else ""
        choices.append({"index": c.index, "text": prefix + c.output,
                        "logprobs": completion_logprobs(c.logprobs, rt.token_str, len(prefix))
                        if prep.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        if prep.token_ids:
            choices[-1]["prompt_token_ids"] = list(gen.prompts[c.prompt_index])
            choices[-1]["token_ids"] = list(c.token_ids)
    return prep.env.body(choices, gen.usage())


async def _stream(prep: Prepared, first: Callable[[], list[bytes]],
                  on_event: Callable[[ChoiceState, Any], bytes | None],
                  done: Callable[[], None]) -> AsyncIterator[bytes]:
    """The SSE body: `first()` chunks, one chunk per event, usage, [DONE]; errors as events."""
    gen = prep.gen
    try:
        for chunk in first():
            yield chunk
        async for choice, event in gen.events():
            chunk = on_event(choice, event)
            if chunk is not None:
                yield chunk
        if prep.include_usage:
            yield sse(prep.env.body([], gen.usage(),
                                    obj=prep.env.object))
        yield DONE
        prep.sent_done = True
    except MetraleError as e:
        if prep.on_error is not None:
            prep.on_error(e)
        yield sse(e.to_openai())
        yield DONE
        prep.sent_done = True
    except Exception:
        log.exception("stream %s failed", prep.env.id)
        error = InternalError("internal error while streaming")
        if prep.on_error is not None:
            prep.on_error(error)
        yield sse(error.to_openai())
        yield DONE
        prep.sent_done = True
    finally:
        gen.cancel()
        gen.observe_end()
        done()


def chat_stream(prep: Prepared, rt: ModelRuntime,
                done: Callable[[], None]) -> AsyncIterator[bytes]:
    """The streamed chat answer (object `chat.completion.chunk`)."""
    env, usage_key = prep.env, prep.include_usage
    env.object = "chat.completion.chunk"

    def chunk(choice: dict, extra: dict | None = None) -> bytes:
        body = env.body([choice], None, include_usage_key=usage_key)
        return sse({**body, **extra} if extra else body)

    def first() -> list[bytes]:
        extra = ({"prompt_token_ids": list(prep.gen.requests[0].prompt_ids)}
                 if prep.token_ids else None)
        return [chunk({"index": c.index, "delta": {"role": "assistant", "content": ""},
                       "logprobs": None, "finish_reason": None}, extra)
                for c in prep.gen.choices]

    output = prep.output
    streams = {c.index: output.stream() for c in prep.gen.choices} if output else {}

    def shaped(c: ChoiceState, s: ChoiceStream, event: Any) -> bytes | None:
        """The chunks of one event through the choice's parsers (one per delta)."""
        if isinstance(event, Token):
            deltas = s.feed(event.text)
            if not deltas and (event.logprobs or prep.token_ids):
                deltas = [{}]
            first = {"logprobs": chat_logprobs(event.logprobs, rt.token_str)
                     if prep.logprobs else None, "token_ids": list(event.token_ids)}
        elif isinstance(event, Finished):
            deltas = s.finish(event.text)
            first = {"logprobs": None, "token_ids": []}
        else:
            return None
        out = []
        for k, delta in enumerate(deltas):
            choice = {"index": c.index, "delta": delta, "logprobs": first["logprobs"] if k == 0
                      else None, "finish_reason": None}
            if prep.token_ids:
                choice["token_ids"] = first["token_ids"] if k == 0 else []
            out.append(chunk(choice))
        if isinstance(event, Finished):
            assert output is not None
            choice = {"index": c.index, "delta": {}, "logprobs": None,
                      "finish_reason": output.finish_reason(event.finish_reason, s.called),
                      "stop_reason": event.stop_reason}
            if prep.token_ids:
                choice["token_ids"] = []
            out.append(chunk(choice))
        return b"".join(out) or None

    def on_event(c: ChoiceState, event: Any) -> bytes | None:
        if c.index in streams:
            return shaped(c, streams[c.index], event)
        if isinstance(event, Token):
            if not event.text and not event.logprobs and not prep.token_ids:
                return None
            lp = chat_logprobs(event.logprobs, rt.token_str) if prep.logprobs else None
            choice = {"index": c.index, "delta": {"content": event.text}, "logprobs": lp,
                      "finish_reason": None}
            if prep.token_ids:
                choice["token_ids"] = list(event.token_ids)
            return chunk(choice)
        if isinstance(event, Finished):
            delta = {"content": event.text} if event.text else {}
            choice = {"index": c.index, "delta": delta, "logprobs": None,
                      "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}
            if prep.token_ids:
                choice["token_ids"] = []
            return chunk(choice)
        return None

    return _stream(prep, first, on_event, done)


def completion_stream(prep: Prepared, rt: ModelRuntime,
                      done: Callable[[], None]) -> AsyncIterator[bytes]:
    """The streamed text completion (object `text_completion`, the same shape per chunk)."""
    env = prep.env
    offsets = {c.index: len(prep.echo[c.index]) if prep.echo else 0 for c in prep.gen.choices}

    def chunk(choice: dict) -> bytes:  # the spec's text_completion has no null usage
        return sse(env.body([choice], None, include_usage_key=False))

    def first() -> list[bytes]:
        if not prep.echo and not prep.token_ids:
            return []
        out = []
        for c in prep.gen.choices:
            choice = {"index": c.index, "text": prep.echo[c.index] if prep.echo else "",
                      "logprobs": None, "finish_reason": None}
            if prep.token_ids:
                choice["prompt_token_ids"] = list(prep.gen.prompts[c.prompt_index])
                choice["token_ids"] = []
            out.append(chunk(choice))
        return out

    def on_event(c: ChoiceState, event: Any) -> bytes | None:
        if isinstance(event, Token):
            if not event.text and not event.logprobs and not prep.token_ids:
                return None
            lp = None
            if prep.logprobs:
                lp = completion_logprobs(event.logprobs, rt.token_str, offsets[c.index])
            offsets[c.index] += len(event.text)
            choice = {"index": c.index, "text": event.text, "logprobs": lp,
                      "finish_reason": None}
            if prep.token_ids:
                choice["token_ids"] = list(event.token_ids)
            return chunk(choice)
        if isinstance(event, Finished):
            choice = {"index": c.index, "text": event.text, "logprobs": None,
                      "finish_reason": event.finish_reason, "stop_reason": event.stop_reason}
            if prep.token_ids:
                choice["token_ids"] = []
            return chunk(choice)
        return None

    return _stream(prep, first, on_event, done)
