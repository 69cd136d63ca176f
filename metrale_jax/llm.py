"""`LLM`: the offline Python API for notebooks and scripts.

    from metrale_jax import LLM
    llm = LLM("default")                      # or a HF folder, a .gguf file, an orbax checkpoint
    llm = LLM("default", mesh="data=2,model=4")   # sharded over 8 devices
    llm.config, llm.tokenizer
    llm.logits(token_ids)                     # [T, V] float32, one full forward pass
    llm.apply_chat_template(messages, add_generation_prompt=True) -> str
    llm.generate(prompts, SamplingParams(...)) -> list[Completion]
    llm.chat(messages, params) -> Completion ; llm.stream(prompt, params) -> text deltas
    llm = LLM("path/to/nllb-200", target_lang="fra_Latn")   # a translation model
    llm.translate(texts, source_lang="eng_Latn", num_beams=4) -> list[Completion]
    llm = LLM("all-minilm-l6-v2")             # an embedding model (or a cross-encoder)
    llm.embed(texts) -> [N, E] ; llm.score(query, documents) -> [N]

A thin front: loading lives in `metrale_jax.weights`, text in `metrale_jax.text`, and the
compiled steps in `metrale_jax.engine`.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metrale_jax.completion import Completion, collect
from metrale_jax.config import ModelConfig
from metrale_jax.errors import ChatTemplateError, InvalidParameterError
from metrale_jax.models.ragged import sequence_logits
from metrale_jax.models.unrolled import LayerGraph, LayerParams, split_layers
from metrale_jax.scheduler.step_time import DEFAULT_MAX_ITL_MS
from metrale_jax.weights.checkpoint import Checkpoint, load_checkpoint

log = logging.getLogger(__name__)

def _stop_scheduler(scheduler: Any) -> None:
    """Stops a batching loop, then its engine's background compile (the programs not started
    are skipped, those compiling waited for): no thread of it is left inside XLA."""
    scheduler.stop()
    scheduler.engine.programs.cancel_background(timeout=None)


def _release(closers: list[Any]) -> None:
    """Runs the closers of what an `LLM` started (its batching loop, a pooling model's
    worker), newest first. Runs once per `weakref.finalize`: at `close()`, when the `LLM` is
    garbage collected, or at interpreter exit, before Python tears down the daemon threads
    (a script that never calls `close()` would otherwise end with a loop inside XLA and
    abort: exit 134, "terminate called after throwing an instance of ''")."""
    if threading.current_thread().name.startswith("metrale-"):
        # Collected on a thread of the engine's own (it cannot join itself): from another.
        threading.Thread(target=_release, args=(closers,), name="llm-close").start()
        return
    while closers:
        closers.pop()()

MIN_LOGITS_BUCKET = 16


def _bucket(n: int) -> int:
    """The smallest power of two ≥ max(n, 16): one compile per bucket, not per length."""
    return max(MIN_LOGITS_BUCKET, 1 << (n - 1).bit_length())


class LLM:
    """A loaded model with its tokenizer and chat template.

    Args:
        model: "default", or a path to a Hugging Face folder, a .gguf file or a Metrale
            (orbax) checkpoint folder, or a Hugging Face Hub name ("org/repo",
            "org/repo:QUANT", "org/repo/file.gguf", each with an optional "@revision").
        dtype: params and compute dtype, "float32" (CPU) or "bfloat16" (TPU/GPU); None =
            float32, or an orbax checkpoint's stored dtype.
        max_slots, max_len: decode slots B and context length S of the engine (None = as
            many / as long as fit: the memory plan, which needs `memory_gb` on CPU).
        mesh: the device mesh, "data=2,model=4" or (data, model); None = the default for the
            model and the devices (see `engine/sharding.py`).
        memory_gb: GiB per device for the memory plan (None = what the devices report).
        warmup: True (or "full"): compile every program of the serving grid (all prefill
            buckets, batch sizes and decode buckets) when the batching loop starts, as
            `metrale serve --warmup full` does; "serve": compile the few programs that serve
            any request, then the rest in the background while requests run (as `metrale
            serve` does by default; `llm.scheduler.engine.wait_compiled()` waits for it). The
            default, False, suits one-shot runs: each program compiles on its first use, so
            a first `generate` compiles only the shapes it needs. Either way the grid is
            fixed, so no request compiles anything outside it.
        loras: LoRA adapters to serve, {name: PEFT adapter folder}; a request picks one with
            `SamplingParams(lora=name)`. Read and checked here (a `LoraError` names what does
            not fit); the engine gets max(4, len(loras)) adapter slots unless `max_loras` says.
        source_lang, target_lang: a translation model's default languages (FLORES-200 codes)
            for `translate`.
        allowed_media_domains: a vision-language model's http(s) image URLs are fetched only
            from these domains (and their subdomains); none = data: URLs and PIL images only.
        image_limits: a `vision.media.ImageLimits` for the bytes, pixels, fetch time and
            redirects of each image (its max_images is the engine's `max_images`).
        max_itl_ms: the latency target in ms (`Scheduler`'s; `metrale serve --max-itl-ms`):
            while rows decode, prompt chunks are sized to keep each step within it; None or
            0: none. The default: `scheduler.step_time.DEFAULT_MAX_ITL_MS`.
        stall_timeout: seconds without progress while requests wait or run that make the
            batching loop stalled (`Scheduler`'s; scheduler/watchdog.py): waiting requests
            and new ones raise `StalledError`; None: 120, or the warmup's time when longer.
        Further keyword arguments go to `EngineConfig`; e.g. `quantization="int8"`: int8
            weights with per-output-channel scales, quantized while loading
            (`models/quant.py`), or `"int4"`: 4-bit blocks (`models/quant4.py`).

    The mesh and memory plan are decided while the checkpoint loads, before any weight is
    read: an impossible configuration raises `MemoryPlanError` here, and an orbax
    checkpoint restores straight into sharded arrays.
    """

    def __init__(self, model: str | Path = "default", *, dtype: str | None = None,
                 max_slots: int | None = 8, max_len: int | None = 2048,
                 mesh: str | tuple[int, int] | None = None, memory_gb: float | None = None,
                 warmup: bool | str = False, loras: dict[str, str | Path] | None = None,
                 source_lang: str | None = None, target_lang: str | None = None,
                 allowed_media_domains: Sequence[str] | None = None,
                 image_limits: Any = None, task: str = "auto",
                 max_itl_ms: float | None = DEFAULT_MAX_ITL_MS,
                 stall_timeout: float | None = None, **engine_options: Any):
        from metrale_jax.embedding.loader import load_pooler, pooling_task
        from metrale_jax.engine.config import EngineConfig
        from metrale_jax.engine.placement import PlacementHook
        self.pooler = None
        self._scheduler = None
        self._closers: list[Any] = []  # what `close()` stops (see `_release`)
        self._finalizer = weakref.finalize(self, _release, self._closers)
        self.checkpoint: Checkpoint | None = None  # None for a pooling model
        self.loras: dict[str, Any] = {}
        pooling = pooling_task(model, task)
        if pooling is not None:  # an embedding or reranking model: embed() and score()
            self.pooler = load_pooler(model, pooling, dtype=dtype, max_slots=max_slots,
                                      max_len=max_len, engine_options=engine_options)
            self._closers.append(self.pooler.close)
            if warmup:
                self.pooler.warmup()
            return
        if loras:
            engine_options.setdefault("max_loras", max(4, len(loras)))
        self._placement = PlacementHook(EngineConfig(
            max_slots=max_slots, max_len=max_len, mesh=mesh, memory_gb=memory_gb,
            **engine_options))
        self.checkpoint = load_checkpoint(
            model, dtype, shardings=self._placement,
            quantization=engine_options.get("quantization"))
        self._template = None
        self._scheduler = None
        self._warmup = warmup
        self._max_itl_ms = max_itl_ms
        self._stall_timeout = stall_timeout
        self.source_lang, self.target_lang = source_lang, target_lang
        import dataclasses

        from metrale_jax.vision.media import ImageLimits
        self.image_limits = dataclasses.replace(
            image_limits or ImageLimits(), max_images=self._placement.config.max_images,
            allowed_domains=tuple(allowed_media_domains or
                                  (image_limits.allowed_domains if image_limits else ())))
        self._image_processor = None
        if self.checkpoint.config.is_encoder_decoder:
            from metrale_jax.text.translation import check_default_languages
            check_default_languages(self.checkpoint.tokenizer, source_lang, target_lang)
        self.loras = {}
        if loras:
            from metrale_jax.weights.lora import load_peft_adapter
            rank = self._placement.config.max_lora_rank
            self.loras = {name: load_peft_adapter(path, self.checkpoint.config, name, rank)
                          for name, path in loras.items()}

    @property
    def scheduler(self):
        """The batching loop, built on first use (with every program compiled when
        `warmup=True`; otherwise programs compile as requests first need them)."""
        if self._scheduler is None:
            self._refuse_generation()
            from metrale_jax.engine import Engine
            from metrale_jax.scheduler import Scheduler
            ckpt = self.checkpoint
            engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params,
                            placement=self._placement.placement, vision=ckpt.vision)
            scheduler = Scheduler(engine, ckpt.tokenizer, self.eos_token_ids,
                                  warmup=self._warmup, loras=self.loras,
                                  max_itl_ms=self._max_itl_ms,
                                  stall_timeout=self._stall_timeout)
            if not scheduler.wait_ready():
                raise scheduler.startup_error
            self._scheduler = scheduler
            self._closers.append(functools.partial(_stop_scheduler, scheduler))
        return self._scheduler

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation: the generation config's, else the tokenizer's."""
        gen = self.checkpoint.generation_config.get("eos_token_id")
        if gen is not None:
            return tuple(gen) if isinstance(gen, list) else (int(gen),)
        return tuple(self.config.eos_token_ids) or tuple(self.tokenizer.eos_token_ids)

    def warmup(self) -> float:
        """Compiles every program of the serving grid now (as `metrale serve` does before it
        reports ready); returns the seconds it took. Later requests compile nothing."""
        return self.scheduler.engine.warmup()

    def _refuse_generation(self) -> None:
        if self.pooler is not None:
            raise InvalidParameterError(
                "this is an embedding or reranking model: use embed() and score(); it "
                "generates no text", param="model")

    def _require_pooler(self, task: str | None = None) -> Any:
        if self.pooler is None:
            raise InvalidParameterError(
                f"model {self.checkpoint.name!r} generates text; it is not an embedding or "
                "reranking model (load one, or a decoder with task='embed' / 'score')",
                param="model")
        if task is not None and self.pooler.info.task != task:
            raise InvalidParameterError("this model scores text pairs (score()); it makes "
                                        "no embeddings", param="model")
        return self.pooler

    def embed(self, texts: str | Sequence[str | Sequence[int]],
              dimensions: int | None = None) -> np.ndarray:
        """Embeddings `[N, E] float32` of texts (or token-id lists), pooled and normalized
        as the model's files say; one text gives `[1, E]`. `dimensions`: keep the first ones
        (a Matryoshka model's), re-normalized. Inputs longer than the model's limit raise
        `ContextLengthError` naming their index."""
        from metrale_jax.embedding.pooler import shortened
        from metrale_jax.errors import ContextLengthError
        pooler = self._require_pooler("embed")
        items = [texts] if isinstance(texts, str) else list(texts)
        ids = [pooler.encode_text(t) if isinstance(t, str) else [int(x) for x in t]
               for t in items]
        limit = pooler.info.max_input_tokens
        for i, x in enumerate(ids):
            if not x or len(x) > limit:
                raise ContextLengthError(f"input {i} has {len(x)} tokens; this model embeds "
                                         f"1 to {limit}", param="texts")
        return shortened(np.asarray(pooler.embed_ids(ids), np.float32), dimensions,
                         pooler.info)

    def score(self, query: str, documents: str | Sequence[str],
              truncate: bool = False) -> np.ndarray:
        """Relevance `[N] float32` of each document to `query`: a cross-encoder's or a
        decoder reranker's score, or an embedding model's cosine similarity."""
        docs = [documents] if isinstance(documents, str) else list(documents)
        scores, _ = self._require_pooler().score_texts(query, docs, truncate)
        return np.asarray(scores, np.float32)

    def close(self) -> None:
        """Stops every thread the `LLM` started: the batching loop, a background compile, a
        pooling model's worker. Optional: the same happens when the `LLM` is garbage
        collected (`del llm`) or at interpreter exit. A later generation starts a new loop."""
        self._finalizer()
        self._scheduler = None
        self._closers = []
        self._finalizer = weakref.finalize(self, _release, self._closers)

    def __enter__(self) -> LLM:
        """`with LLM(...) as llm:` closes it at the end of the block."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Closes the `LLM` (see `close`)."""
        self.close()

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        self._refuse_generation()
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def _submit(self, prompt_ids: list[int], params, source: Sequence[int] = (),
                images: Sequence[Any] = (), priority: int = 0):
        from metrale_jax.scheduler import GenerationRequest
        self._refuse_generation()
        if self.config.is_encoder_decoder and not source:
            raise InvalidParameterError(
                f"model {self.checkpoint.name!r} is a translation model: use translate()",
                param="prompt")
        return self.scheduler.submit(GenerationRequest.make(prompt_ids, params,
                                                            source=source, images=images,
                                                            priority=priority))

    def translate(self, texts: str | Sequence[str], source_lang: str | None = None,
                  target_lang: str | None = None, sampling_params=None, *,
                  num_beams: int | None = None, length_penalty: float | None = None,
                  early_stopping: bool | str | None = None) -> list[Completion]:
        """Translates each text (all run together in the batch) with a translation model.

        source_lang / target_lang: FLORES-200 codes (None: the defaults given to `LLM`);
        `sampling_params`: one `SamplingParams` for all or one per text (default: greedy,
        up to eos or the context, as transformers' `generate` for NLLB);
        num_beams, length_penalty, early_stopping: beam search settings that override
        theirs. Each `Completion.text` is a translation (`Completion.beams`: the best
        hypotheses of a beam search).
        """
        from metrale_jax.scheduler import SamplingParams
        from metrale_jax.text.translation import translation_inputs
        if not self.config.is_encoder_decoder:
            raise InvalidParameterError(f"model {self.checkpoint.name!r} is not a translation "
                                        "model", param="model")
        if isinstance(texts, str):
            texts = [texts]
        params = (sampling_params if sampling_params is not None
                  else SamplingParams(temperature=0.0, max_tokens=None))
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(texts)
        if len(per) != len(texts):
            raise InvalidParameterError("give one SamplingParams, or one per text",
                                        param="sampling_params")
        beams = {k: v for k, v in (("num_beams", num_beams), ("length_penalty", length_penalty),
                                   ("early_stopping", early_stopping)) if v is not None}
        if beams:
            import dataclasses
            per = [dataclasses.replace(sp, **beams) for sp in per]
        inputs = [translation_inputs(self.tokenizer, t, source_lang, target_lang,
                                     self.source_lang, self.target_lang) for t in texts]
        handles = [self._submit(list(x.prompt), sp, x.source)
                   for x, sp in zip(inputs, per, strict=True)]
        return [collect(h) for h in handles]

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling_params=None, *,
                 priority: int | Sequence[int] | None = None) -> list[Completion]:
        """Generates for each prompt (text or token ids), all run together in the batch.

        `sampling_params`: one `SamplingParams` for all, or a list with one per prompt.
        `priority` (vLLM's): one integer for all or one per prompt, lower first (default
        0), a signed 32-bit value: orders the waiting queue, and a waiting request may
        preempt a running one of a worse value (scheduler/waiting.py).
        """
        from metrale_jax.scheduler import SamplingParams
        from metrale_jax.scheduler.waiting import check_priority
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidParameterError("give one SamplingParams, or one per prompt",
                                        param="sampling_params")
        prios = [0] * len(prompts) if priority is None else (
            list(priority) if isinstance(priority, (list, tuple)) else [priority] * len(prompts))
        if len(prios) != len(prompts):
            raise InvalidParameterError("give one priority, or one priority per prompt",
                                        param="priority")
        prios = [check_priority(p) for p in prios]
        handles = [self._submit(self._encode(p), sp, priority=pr)
                   for p, sp, pr in zip(prompts, per, prios, strict=True)]
        return [collect(h) for h in handles]

    def chat(self, messages: list[dict[str, Any]], sampling_params=None,
             **template_kwargs: Any) -> Completion:
        """Applies the chat template to `messages` and generates the assistant's answer.

        A vision-language model takes images as content parts: `{"type": "image_url",
        "image_url": {"url": "data:image/png;base64,..."}}` (http(s) URLs only from the
        domains in `LLM(..., allowed_media_domains=...)`) or `{"type": "image", "image":
        <a PIL image>}`."""
        from metrale_jax.completion import collect
        from metrale_jax.scheduler import SamplingParams
        ids, images = self._chat_request(messages, **template_kwargs)
        return collect(self._submit(ids, sampling_params or SamplingParams(), images=images))

    def _chat_request(self, messages, **template_kwargs) -> tuple[list[int], tuple]:
        """(the prompt ids of a chat, its `PromptImage`s)."""
        from metrale_jax.vision.prompt import split_image_parts
        messages, refs = split_image_parts(messages,
                                           text_parts=self.config.vision is not None)
        if refs and self.config.vision is None:
            raise InvalidParameterError(f"model {self.checkpoint.name!r} takes no images: it "
                                        "is a text-only model", param=refs[0].param)
        text = self.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if self.config.vision is None:
            return ids, ()
        from metrale_jax.vision.prompt import expand_placeholders, load_refs, prompt_images
        images, digests = load_refs(refs, self.image_limits)
        ids, offsets = expand_placeholders(ids, self.config.vision, len(refs))
        return ids, prompt_images(images, offsets, digests, self.image_processor,
                                  self.config.vision)

    @property
    def image_processor(self):
        """A vision-language model's `vision.ImageProcessor` (from its
        preprocessor_config.json): PIL image -> pixel_values `[C, H, W] float32`."""
        if self._image_processor is None:
            from metrale_jax.vision.image_processor import ImageProcessor
            if self.checkpoint.image_processor is None:
                raise InvalidParameterError(f"model {self.checkpoint.name!r} takes no images",
                                            param="messages")
            self._image_processor = ImageProcessor.from_hf(self.checkpoint.image_processor)
        return self._image_processor

    def _chat_ids(self, messages, **template_kwargs) -> list[int]:
        ids, images = self._chat_request(messages, **template_kwargs)
        if images:
            raise InvalidParameterError("streaming a chat with images: use chat()",
                                        param="messages")
        return ids

    def stream(self, prompt: str | Sequence[int], sampling_params=None) -> Iterator[str]:
        """Yields the text of one generation as it is produced."""
        from metrale_jax.scheduler import SamplingParams
        handle = self._submit(self._encode(prompt), sampling_params or SamplingParams())
        yield from _text_deltas(handle)

    def stream_chat(self, messages: list[dict[str, Any]], sampling_params=None,
                    **template_kwargs: Any) -> Iterator[str]:
        """`stream` for a chat: applies the template, yields the answer's text deltas."""
        from metrale_jax.scheduler import SamplingParams
        handle = self._submit(self._chat_ids(messages, **template_kwargs),
                              sampling_params or SamplingParams())
        yield from _text_deltas(handle)

    @property
    def config(self) -> ModelConfig:
        """The model's architecture."""
        return self.checkpoint.config

    @property
    def tokenizer(self):
        """The model's tokenizer: `encode(text) -> list[int]`, `decode(ids) -> str`."""
        if self.pooler is not None:
            return self.pooler.tokenizer
        return self.checkpoint.tokenizer

    @functools.cached_property
    def _layers(self) -> tuple[LayerGraph, LayerParams]:
        """The checkpoint's params split per layer, as the engine runs them."""
        return split_layers(self.checkpoint.graphdef, self.checkpoint.params)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """The model's logits for every position of `token_ids`: `[T, V] float32`, computed as
        the engine computes a prompt (the ragged step's layers over a paged cache, in one chunk
        of the smallest power of two ≥ max(T, 16): one compile per bucket, not per length)."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidParameterError("token_ids must not be empty", param="token_ids")
        if self.config.is_encoder_decoder:
            raise InvalidParameterError(f"model {self.checkpoint.name!r} is a translation "
                                        "model: logits are for decoder-only models",
                                        param="token_ids")
        V = self.config.vocab_size
        if min(ids) < 0 or max(ids) >= V:
            raise InvalidParameterError(f"token ids must be in [0, {V})", param="token_ids")
        graph, params = self._layers
        # Padding sits after the prompt, so causal attention keeps it out of positions < T.
        out = sequence_logits(graph, params, ids, chunk=_bucket(len(ids)),
                              cache_dtype=params.outer["embed"][...].dtype)
        return np.asarray(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], *,
                            add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Renders `messages` with the model's chat template (Hugging Face semantics)."""
        if self._template is None:
            from metrale_jax.text import ChatTemplate
            source = self.checkpoint.chat_template
            if not source:
                raise ChatTemplateError(f"model {self.checkpoint.name!r} has no chat template")
            tok = self.tokenizer
            self._template = ChatTemplate(source, bos_token=tok.bos_token,
                                          eos_token=tok.eos_token)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, **kwargs)


def _text_deltas(handle) -> Iterator[str]:
    from metrale_jax.scheduler import Failed, Finished, Token
    try:
        for event in handle:
            if isinstance(event, (Token, Finished)) and event.text:
                yield event.text
            elif isinstance(event, Failed):
                raise event.error
    finally:
        handle.cancel()
