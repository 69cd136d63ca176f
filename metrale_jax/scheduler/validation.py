"""Request validation: whether a `GenerationRequest` fits the engine it is submitted to.

Every check that depends on the loaded model and the engine's shapes (vocabulary, context,
pages, images, sources, beams, speculation, LoRA adapters, grammars) runs here, on the
caller's thread, before the request is queued: a refusal is a `MetraleError` (an HTTP 400 or
a context-length error), never a failure inside the loop.
"""

from __future__ import annotations

from typing import Any

from metrale_jax.engine.images import find_image_offsets
from metrale_jax.engine.sampling_state import MAX_BAD_WORD_TOKENS, MAX_BAD_WORDS
from metrale_jax.errors import ContextLengthError, InvalidParameterError
from metrale_jax.scheduler.grammar_slots import GrammarSlots
from metrale_jax.scheduler.lora_registry import LoraRegistry
from metrale_jax.scheduler.request import GenerationRequest
from metrale_jax.scheduler.token_sets import bad_word_ids


class RequestValidator:
    """Checks requests against one engine.

    Args:
        engine: the `Engine` (its config, model config, pages, source and image limits).
        tokenizer: the model's tokenizer (bad words are resolved to ids to be checked).
        eos_token_ids: the model's eos ids (a beam search keeps room for them).
        grammar: the slots' `GrammarSlots` (constraints are compiled to be checked).
        loras: the `LoraRegistry` (the adapters a request names must be loaded).
    """

    def __init__(self, engine: Any, tokenizer: Any, eos_token_ids: tuple[int, ...],
                 grammar: GrammarSlots, loras: LoraRegistry):
        self.engine = engine
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar = grammar
        self.loras = loras
        self.num_slots = engine.config.max_slots
        self.max_len = engine.config.max_len

    def check(self, request: GenerationRequest) -> None:
        """Validates a request against the engine's shapes; raises a `MetraleError`."""
        n = len(request.prompt_ids)
        if n == 0:
            raise InvalidParameterError("the prompt must not be empty", param="prompt")
        self.check_pooling(request)
        self.check_source(request)
        self.check_images(request)
        self.check_token_ids(request)
        if request.params.constraint is not None:
            self.grammar.validate(request.params.constraint, self.engine.config.decode_steps)
        self.loras.mix(request.params.lora)
        self.check_beams(request)
        most = self.engine.config.speculative_tokens
        if (request.params.speculative_tokens or 0) > most:
            raise InvalidParameterError(
                f"speculative num_tokens must be at most {most} here (the server's "
                "--speculative-tokens)", param="speculative")
        self.check_length(request)

    def check_pooling(self, request: GenerationRequest) -> None:
        """A pooling request needs an engine whose steps return pooled hidden states, and
        samples nothing (no beams, grammar or speculation)."""
        if not request.pooling:
            return
        if not self.engine.config.pooled_output:
            raise InvalidParameterError("this engine does not serve pooling requests "
                                        "(EngineConfig.pooled_output is off)", param="input")
        p = request.params
        if p.num_beams != 1 or p.constraint is not None or p.speculative_tokens:
            raise InvalidParameterError("a pooling request samples no tokens: no beams, "
                                        "constraints or speculation", param="input")

    def check_source(self, request: GenerationRequest) -> None:
        """A translation model's request has a source text in its vocabulary; a decoder-only
        model's has none."""
        if self.engine.encoder_decoder:
            if not request.source:
                raise InvalidParameterError("a translation model needs the text to translate",
                                            param="messages")
            self.engine.check_source(len(request.source))
            vocab = self.engine.model_config.vocab_size
            if min(request.source) < 0 or max(request.source) >= vocab:
                raise InvalidParameterError(f"source token ids must be in [0, {vocab})",
                                            param="prompt")
        elif request.source:
            raise InvalidParameterError("a source (text to translate) is for translation "
                                        "models; this model is decoder-only", param="source")

    def check_images(self, request: GenerationRequest) -> None:
        """A request's images match its prompt's placeholder runs (raises otherwise)."""
        engine = self.engine
        engine.check_images(len(request.images))
        vision = engine.model_config.vision
        if vision is None:
            return
        T = vision.tokens_per_image
        offsets = find_image_offsets(request.prompt_ids, vision.image_token_id, T)
        if len(offsets) != len(request.images):
            raise InvalidParameterError(
                f"the prompt has {len(offsets)} image placeholders for {len(request.images)} "
                "images", param="messages")
        shape = (vision.num_channels, vision.image_size, vision.image_size)
        for at, im in zip(offsets, request.images, strict=True):
            if im.offset != at or im.length != T or tuple(im.pixels.shape) != shape:
                raise InvalidParameterError(
                    f"an image at prompt position {im.offset} does not fit this model "
                    f"({T} placeholders at {at}, pixels {shape})", param="messages")

    def check_token_ids(self, request: GenerationRequest) -> None:
        """The prompt, stop ids, logit biases and bad words are within the vocabulary (V)."""
        vocab = self.engine.model_config.vocab_size
        if min(request.prompt_ids) < 0 or max(request.prompt_ids) >= vocab:
            raise InvalidParameterError(f"prompt token ids must be in [0, {vocab})",
                                        param="prompt")
        if any(t >= vocab for t in request.params.stop_token_ids):
            raise InvalidParameterError(f"stop_token_ids must be < {vocab}",
                                        param="stop_token_ids")
        if any(t >= vocab for t, _ in request.params.logit_bias):
            raise InvalidParameterError(
                f"logit_bias has a token id outside the vocabulary [0, {vocab})",
                param="logit_bias")
        if request.params.bad_words:  # resolves now, so a bad word is a 400 here
            _, words = bad_word_ids(self.tokenizer, request.params.bad_words)
            if len(words) > MAX_BAD_WORDS or any(len(w) > MAX_BAD_WORD_TOKENS for w in words):
                raise InvalidParameterError(
                    f"bad_words: at most {MAX_BAD_WORDS} multi-token sequences of at most "
                    f"{MAX_BAD_WORD_TOKENS} tokens each", param="bad_words")

    def check_beams(self, request: GenerationRequest) -> None:
        """A beam search fits the slots and the top log-probabilities of a step, on an
        engine that decodes one token a step and returns raw log-probabilities."""
        p = request.params
        if p.num_beams == 1:
            return
        cfg = self.engine.config
        eos = 0 if p.ignore_eos else len(set(self.eos_token_ids) | set(p.stop_token_ids))
        top = cfg.num_top_logprobs
        most = min(self.num_slots, (top - eos) // max(2, 1 + eos))
        if p.num_beams > most:
            raise InvalidParameterError(
                f"num_beams must be at most {most} here ({self.num_slots} sequence slots, "
                f"{top} top log-probabilities per step)", param="num_beams")
        if cfg.decode_steps != 1:
            raise InvalidParameterError("beam search needs an engine with decode_steps 1",
                                        param="num_beams")
        if cfg.logprobs_mode != "raw":
            raise InvalidParameterError("beam search needs the server's logprobs mode 'raw'",
                                        param="num_beams")
        if getattr(self.engine, "window_columns", 0):
            raise InvalidParameterError(
                "beam search is not available for this model's sliding-window cache (each row "
                "keeps a ring of pages a beam cannot share); the server's --sliding-cache full "
                "allows it", param="num_beams")

    def check_length(self, request: GenerationRequest) -> None:
        """The prompt plus max_tokens fits the context (max_len) and the KV cache's pages."""
        n = len(request.prompt_ids)
        wanted = request.params.max_tokens or 1
        if n + wanted > self.max_len:
            raise ContextLengthError(
                f"this model's maximum context length is {self.max_len} tokens, but the "
                f"request has {n} prompt tokens plus max_tokens={wanted} "
                f"({n + wanted} in all)")
        pages = self.engine.pages
        if pages.pages_for(n + wanted) > pages.usable_pages:
            raise ContextLengthError(
                f"the KV cache holds {pages.usable_pages * pages.page_size} tokens in all, but "
                f"the request has {n} prompt tokens plus max_tokens={wanted} "
                f"({n + wanted} in all)")
