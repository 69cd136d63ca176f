"""`ModelRuntime`: the loaded model, its scheduler and text helpers, as the HTTP layer sees it.

Loading (weights, engine, warmup) runs in a worker thread started by `start()`; the event loop
keeps answering (/health is 503) until `state` is "ready". Nothing here runs JAX on the event
loop: the scheduler's thread owns the engine.

Multi-host (`settings.num_processes > 1`, metrale_jax/multihost/): once the engine
is placed, every process joins the side channel. Process 0 runs the scheduler over a
`LeaderEngine` (each engine call reaches every process); the others warm up and replay the
calls in a thread, and their app answers only /health. A lost peer fails every request with
`PeerLostError` and ends the process with `multihost.EXIT_PEER_LOST`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from metrale_jax.errors import ChatTemplateError, MetraleError
from metrale_jax.host_memory import release_free_memory
from serving.http.model_memory import AdmittedPlacement, weights_bytes
from serving.http.settings import ServerSettings
from serving.progress import ProgressFn, accepts_keyword, progress_kwargs, stage

log = logging.getLogger(__name__)

LOADING, COMPILING = "loading weights", "compiling"
PEER_LOST_GRACE_S = 2.0  # seconds the error answers get before a process with a lost peer exits
MEDIA_THREADS = 16  # images fetched and decoded at once, over every request
STATES = ("starting", "loading", "warming_up", "ready", "sleeping", "failed", "draining",
          "stopped")


class ModelRuntime:
    """One served model: checkpoint, tokenizer, chat template and `Scheduler`.

    state: one of STATES. error: the loading failure, when state is "failed".
    progress: `(stage, done, total)` reports of the "loading weights" and "compiling" stages
        (the CLI's bars); steps inside a stage are reported where the library offers a hook.
    admit: called from the loading thread with the bytes per device the model will hold
        (`footprint`), before any weight is read; it may block (the model pool makes room)
        or raise (the loading fails with its error). None: nothing to ask. With it, the KV
        page pool is sized for every slot to hold max_len (it does not fill the device, which
        other models share) unless `num_pages` is configured.
    footprint: the bytes per device the model holds once loaded (the memory plan's params,
        KV pool, windows and scratch; an embedding model: its weights); 0 until known.
    """

    def __init__(self, settings: ServerSettings, progress: ProgressFn | None = None,
                 admit: Callable[[int], None] | None = None):
        self.settings = settings
        self.progress = progress
        self.admit = admit
        self.footprint = 0
        self._offloaded: Any = None  # a sleeping model's host params (residency.py)
        self.state = "starting"
        self.error: BaseException | None = None
        self.checkpoint: Any = None
        self.scheduler: Any = None
        self.pooler: Any = None  # an embedding or reranking model's `embedding.Pooler`
        self.engine_config: Any = None  # the engine's resolved EngineConfig, once built
        self.loras: dict[str, Any] = {}  # the LoRA adapters read at start-up, by name
        self.lora_paths: dict[str, str] = dict(settings.loras)  # those served now
        self.created = int(time.time())
        self._template: Any = None
        self.image_processor: Any = None  # a vision-language model's: PIL -> [C, H, W]
        self.image_limits: Any = None  # `vision.media.ImageLimits`, once the model is read
        self._media_pool: Any = None  # the threads that fetch and decode requests' images
        self._token_strs: dict[int, str] = {}
        self._loaded = threading.Event()
        self._channel: Any = None  # the multi-host side channel, when there is one
        self._sleeping_engine: Any = None  # a sleeping model's engine (its programs)
        # A multi-host server of several models (serving/http/model_pool.py): the side
        # channel the pool holds (process 0, every model after the first), and how a
        # follower builds the engine of the model process 0 loads next.
        self.shared_channel: Any = None
        self.follower_engine: Callable[[str], Any] | None = None

    @classmethod
    def from_llm(cls, llm: Any, settings: ServerSettings) -> ModelRuntime:
        """A ready runtime serving an in-process `metrale_jax.LLM` through the LLM's own
        checkpoint and scheduler (its batching loop, compiled programs and KV pages): a
        notebook's server without a second copy of the model. `settings` gives the server's
        options and its served name; the engine's shapes are the LLM's. A server started on
        it borrows it (`ServerState.owns_runtime`): stopping the server leaves the LLM
        running, and `llm.close()` stops the batching loop."""
        runtime = cls(settings)
        ckpt = llm.checkpoint
        check_languages(ckpt, settings.source_lang, settings.target_lang)
        runtime.checkpoint = ckpt
        runtime.scheduler = llm.scheduler
        runtime.engine_config = runtime.scheduler.engine.config
        runtime.loras = dict(llm.loras)
        runtime.lora_paths = {name: settings.loras.get(name, "") for name in llm.loras}
        runtime._vision_setup(ckpt, runtime.engine_config.max_images)
        runtime.scheduler.set_active_lora(settings.active_lora)
        runtime.state = "ready"
        runtime._loaded.set()
        return runtime

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> threading.Thread:
        """Starts loading and warmup in a background thread."""
        self.state = "loading"
        thread = threading.Thread(target=self._load, name="metrale-load", daemon=True)
        thread.start()
        return thread

    def _load(self) -> None:
        s = self.settings
        try:
            self.state = "loading"
            started = time.monotonic()
            log.info("loading %s", s.model)
            if self._load_pooler():
                return
            engine = self.load_engine(started)
            if s.num_processes > 1:
                engine = self._join_processes(engine)
                if engine is None:  # a follower: replaying process 0's calls
                    return
            self.loras = self._read_loras(self.checkpoint.config, engine.config)
            self.state = "warming_up"
            with stage(self.progress if s.warmup_mode != "none" else None,
                       COMPILING) as step:
                hook = step if self.progress and accepts_keyword(engine.warmup, "progress") \
                    else None
                self._start_scheduler(engine, s.warmup_mode, hook)
            if self.state == "warming_up":
                self.state = "ready"
            log.info("ready: %s (%d programs compiled)", s.model_name, engine.compile_count)
        except BaseException as e:
            log.error("loading %s failed: %s", s.model, e, exc_info=not isinstance(
                e, MetraleError))
            self.error = e
            self.state = "failed"
        finally:
            self._loaded.set()

    def load_engine(self, started: float | None = None) -> Any:
        """Reads the checkpoint and builds its placed `Engine` (not warmed up): the memory
        plan first (`admit` asked), then the weights. Sets `checkpoint` (without its params,
        which the engine holds) and `engine_config`."""
        from metrale_jax.engine import Engine, EngineConfig
        from metrale_jax.weights.checkpoint import load_checkpoint
        s = self.settings
        started = time.monotonic() if started is None else started
        # The mesh and memory plan are decided before any weight is read (see
        # engine/placement.py); an impossible configuration fails here.
        hook = AdmittedPlacement(EngineConfig(max_slots=s.max_slots, max_len=s.max_len,
                                               **s.engine_options), self)
        with stage(self.progress, LOADING) as step:
            ckpt = load_checkpoint(s.model, s.dtype, shardings=hook,
                                   quantization=s.engine_options.get("quantization"),
                                   **progress_kwargs(load_checkpoint,
                                                     step if self.progress else None))
        self.checkpoint = ckpt
        read_s = time.monotonic() - started
        check_languages(ckpt, s.source_lang, s.target_lang)
        self._vision_setup(ckpt, hook.config.max_images)
        engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params,
                        placement=hook.placement, vision=ckpt.vision)
        log.info("weights: %s%s (read in %.1f s, placed in %.1f s)", engine.config.dtype,
                 f", {engine.model_config.quantization} quantized"
                 if engine.model_config.quantization else "", read_s,
                 time.monotonic() - started - read_s)
        # The engine holds its own (per-layer, placed) params: drop the loaded stacked
        # copy, which would double the params' memory beside the memory plan.
        self.checkpoint = ckpt = dataclasses.replace(ckpt, params=None)
        release_free_memory()
        self.engine_config = engine.config
        return engine

    def _start_scheduler(self, engine: Any, warmup: str, progress: Any = None) -> None:
        """Starts the batching loop on `engine` and waits for its warmup (raises its error)."""
        from metrale_jax.scheduler import Scheduler
        s = self.settings
        self.scheduler = Scheduler(engine, self.checkpoint.tokenizer, self.eos_token_ids,
                                   max_waiting=s.max_waiting, warmup=warmup,
                                   warmup_progress=progress, loras=self.loras,
                                   stall_timeout=s.stall_timeout,
                                   exit_on_stall=s.exit_on_stall,
                                   **({} if s.max_itl_ms is None
                                      else {"max_itl_ms": s.max_itl_ms}))
        self.scheduler.wait_ready()
        if self.scheduler.startup_error is not None:
            raise self.scheduler.startup_error
        self.scheduler.set_active_lora(s.active_lora)

    # ---- sleeping (the model pool's; serving/http/model_pool.py) -----------------------
    @property
    def can_sleep(self) -> bool:
        """True when the device memory can be freed with the host copy kept (sleep level 1):
        a ready generating model on one process."""
        return (self.state == "ready" and self.pooler is None and self.scheduler is not None
                and self.settings.num_processes == 1)

    def sleep(self) -> None:
        """Sleep level 1: stops the batching loop (no request may be in flight), copies the
        params to the host and frees their device memory and the KV pages'. The compiled
        programs stay; `wake` resumes."""
        from metrale_jax.engine.residency import offload_params
        if not self.can_sleep:
            raise RuntimeError(f"a runtime in state {self.state!r} cannot sleep")
        engine = self.scheduler.engine
        self.scheduler.stop()
        self.scheduler = None
        self._offloaded = offload_params(engine)
        self._sleeping_engine = engine
        self.state = "sleeping"
        release_free_memory()

    def wake(self) -> None:
        """Undoes `sleep`: the params back on the devices, a new batching loop on a fresh KV
        cache; no program is compiled again."""
        from metrale_jax.engine.residency import restore_params
        if self.state != "sleeping":
            raise RuntimeError(f"a runtime in state {self.state!r} is not sleeping")
        engine, self._sleeping_engine = self._sleeping_engine, None
        restore_params(engine, self._offloaded)
        self._offloaded = None
        self._start_scheduler(engine, "none")
        self.state = "ready"

    @property
    def host_bytes(self) -> int:
        """The bytes a sleeping model keeps on the host (its params); 0 otherwise."""
        return self._offloaded.nbytes if self._offloaded is not None else 0

    @property
    def programs(self) -> tuple[int, int]:
        """(programs compiled or loaded so far, those XLA compiled afresh: not from the
        executable store or JAX's persistent cache); (0, 0) before the engine exists."""
        engine = (self.scheduler.engine if self.scheduler is not None
                  else getattr(self, "_sleeping_engine", None))
        cache = getattr(engine, "programs", None)
        if cache is None:
            count = self.pooler.compile_count if self.pooler is not None else 0
            return count, count
        return cache.compile_count, cache.fresh_count

    @property
    def compiling(self) -> bool:
        """True while the engine's grid still compiles in the background."""
        engine = self.scheduler.engine if self.scheduler is not None else None
        return bool(getattr(getattr(engine, "programs", None), "compiling", False))

    def _load_pooler(self) -> bool:
        """Loads the model as a pooling model (embeddings or scores) when its files or the
        settings' `task` say it is one, and warms it up; False for a model that generates."""
        from metrale_jax.embedding.loader import load_pooler, pooling_task
        s = self.settings
        task = pooling_task(s.model, s.task)
        if task is None:
            return False
        for unsupported, flag in ((s.num_processes > 1, "multi-host serving"),
                                  (bool(s.loras), "--lora"),
                                  (s.source_lang or s.target_lang, "--source/target-lang")):
            if unsupported:
                from metrale_jax.errors import InvalidParameterError
                raise InvalidParameterError(f"{flag} is not available for an embedding or "
                                            "reranking model", param="task")
        self.footprint = weights_bytes(s.model)
        if self.admit is not None:
            self.admit(self.footprint)
        with stage(self.progress, LOADING):
            pooler = load_pooler(s.model, task, dtype=s.dtype, max_slots=s.max_slots,
                                 max_len=s.max_len, engine_options=s.engine_options)
        self.pooler = pooler
        self.scheduler = getattr(pooler, "scheduler", None)  # a decoder pooler's: its stats
        if self.scheduler is not None:
            self.engine_config = self.scheduler.engine.config
        self.state = "warming_up"
        if s.warmup_mode != "none":
            with stage(self.progress, COMPILING):
                pooler.warmup()
        if self.state == "warming_up":
            self.state = "ready"
        log.info("ready: %s (%s, %s; %d programs compiled)", s.model_name, pooler.info.kind,
                 pooler.info.task, pooler.compile_count)
        return True

    def _vision_setup(self, ckpt: Any, max_images: int) -> None:
        """The image limits of the settings and, for a vision-language model, its image
        processor (from preprocessor_config.json; a missing or unsupported one fails the
        loading, not the first request)."""
        from metrale_jax.vision.media import ImageLimits
        s = self.settings
        self.image_limits = ImageLimits(
            max_images=max_images, max_bytes=s.max_image_bytes, max_pixels=s.max_image_pixels,
            fetch_timeout_s=s.media_fetch_timeout,
            allowed_domains=s.allowed_media_domains)
        if ckpt.config.vision is None:
            return
        from metrale_jax.errors import CheckpointError
        from metrale_jax.vision.image_processor import ImageProcessor
        if ckpt.image_processor is None:
            raise CheckpointError(f"{s.model}: a vision-language model needs its "
                                  "preprocessor_config.json (the image preprocessing)")
        self.image_processor = ImageProcessor.from_hf(ckpt.image_processor)

    def media_pool(self) -> Any:
        """The worker threads that fetch, decode and preprocess requests' images (their own,
        so that slow downloads never hold the event loop's default executor, which the
        shutdown uses). Raises `UnavailableError` once the runtime stopped."""
        if self.state in ("stopped", "draining"):
            from serving.http.errors import UnavailableError
            raise UnavailableError("the server is shutting down", code="draining",
                                   retry_after=5)
        if self._media_pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._media_pool = ThreadPoolExecutor(MEDIA_THREADS,
                                                  thread_name_prefix="metrale-media")
        return self._media_pool

    def _read_loras(self, model_config: Any, engine_config: Any) -> dict[str, Any]:
        """The LoRA adapters of the settings, read and checked against the model."""
        from metrale_jax.weights.lora import load_peft_adapter
        return {name: load_peft_adapter(path, model_config, name, engine_config.max_lora_rank)
                for name, path in self.settings.loras.items()}

    def _join_processes(self, engine: Any) -> Any:
        """Opens the multi-host side channel. Process 0: returns its engine wrapped so that
        every call reaches the other processes. A follower: warms up, starts replaying
        process 0's calls in a thread, and returns None."""
        from metrale_jax import multihost
        s = self.settings
        if s.process_id == 0 and self.shared_channel is not None:  # the pool's, told to load
            return multihost.LeaderEngine(engine, self.shared_channel)
        self._channel = multihost.connect(s.process_id, s.num_processes, self._peer_lost)
        if s.process_id == 0:
            return multihost.LeaderEngine(engine, self._channel)
        self.state = "warming_up"
        if s.warmup_mode != "none":
            with stage(self.progress, COMPILING) as step:
                engine.warmup(**progress_kwargs(engine.warmup, step if self.progress else None))
        threading.Thread(target=self._follow, args=(engine,), name="metrale-follower",
                         daemon=True).start()
        self.state = "ready"
        log.info("process %d of %d: ready, replaying process 0's engine calls", s.process_id,
                 s.num_processes)
        return None

    def _follow(self, engine: Any) -> None:
        """A follower's thread: replays process 0's calls; exits the process when it ends."""
        from metrale_jax import multihost
        from metrale_jax.weights.lora import load_peft_adapter

        def load_adapter(path: str, name: str) -> Any:
            return load_peft_adapter(path, engine.model_config, name,
                                     engine.config.max_lora_rank)

        try:
            while multihost.run_follower(engine, self._channel, load_adapter) == "unload":
                # A server of several models: process 0 let this model go; the next
                # message names the one it loads (or stops the server).
                engine = None
                gc.collect()
                message = self._channel.receive()
                if message["op"] == "stop":
                    break
                if message["op"] != "load" or self.follower_engine is None:
                    raise RuntimeError(f"process 0 sent {message['op']!r} where this process "
                                       "waited for the next model to load")
                engine = self.follower_engine(str(message["model"]))
        except BaseException as e:
            if self.state == "stopped":  # our own stop() hung up
                return
            log.error("%s", e.message if isinstance(e, MetraleError) else e,
                      exc_info=not isinstance(e, MetraleError))
            self.error, self.state = e, "failed"
            multihost.exit_now(multihost.EXIT_PEER_LOST)
        log.info("process 0 stopped the server; process %d exits", self.settings.process_id)
        self.state = "stopped"
        multihost.exit_now(0)

    def _peer_lost(self, error: BaseException) -> None:
        """A peer is gone. Process 0: every request fails with `error`, then the process exits
        (after `PEER_LOST_GRACE_S`, time for the answers to go out). A follower exits now."""
        from metrale_jax import multihost
        if self.state == "stopped":  # our own stop hung up
            return
        self.error, self.state = error, "failed"
        if self.settings.process_id != 0:
            multihost.exit_now(multihost.EXIT_PEER_LOST)
        if self.scheduler is not None:
            self.scheduler.abort(error)
        multihost.exit_soon(multihost.EXIT_PEER_LOST, PEER_LOST_GRACE_S)

    async def wait_loaded(self) -> None:
        """Waits (without blocking the loop) until loading has succeeded or failed."""
        await asyncio.to_thread(self._loaded.wait)

    @property
    def ready(self) -> bool:
        """True when requests are served."""
        return self.state == "ready"

    def stop(self) -> None:
        """Stops the scheduler: every in-flight request ends with Cancelled("shutdown")."""
        if self.state != "failed":
            self.state = "stopped"
        if self.pooler is not None:
            self.pooler.close()
        elif self.scheduler is not None:
            self.scheduler.stop()
        engine = (self.scheduler.engine if self.scheduler is not None
                  else self._sleeping_engine)
        programs = getattr(engine, "programs", None)
        if programs is not None:  # a grid still compiling in the background: no more of it
            programs.cancel_background(timeout=0)
        self._offloaded = self._sleeping_engine = None
        if self._channel is not None:  # multi-host: the others stop too (or see us go)
            self._channel.close()

    def release_channel(self) -> Any:
        """Process 0 of a multi-host server of several models: hands the side channel over
        to the model pool (`stop` then leaves it open); None when this runtime has none."""
        channel, self._channel = self._channel, None
        return channel
        if self._media_pool is not None:  # downloads under way end at their own timeout
            self._media_pool.shutdown(wait=False, cancel_futures=True)

    # ---- model facts -------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer."""
        if self.pooler is not None:
            return self.pooler.tokenizer
        return self.checkpoint.tokenizer

    @property
    def max_len(self) -> int:
        """The context length S (the memory plan's choice when the settings leave it None);
        a pooling model's longest input."""
        if self.pooler is not None:
            return self.pooler.info.max_input_tokens
        if self.engine_config is not None:
            return self.engine_config.max_len
        return self.settings.max_len or 0

    @property
    def max_slots(self) -> int:
        """The decode slots B (the memory plan's choice when the settings leave it None)."""
        if self.engine_config is not None:
            return self.engine_config.max_slots
        return self.settings.max_slots or 0

    @property
    def is_translation(self) -> bool:
        """True when the model is an encoder-decoder (translation) model (NLLB / M2M100)."""
        return self.checkpoint is not None and bool(
            getattr(self.checkpoint.config, "is_encoder_decoder", False))

    @property
    def vision(self) -> Any:
        """A vision-language model's `VisionConfig` (image token, tokens per image); None for
        a text-only model."""
        return None if self.checkpoint is None else self.checkpoint.config.vision

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The generation config's eos ids, else the model's, else the tokenizer's."""
        ckpt = self.checkpoint
        gen = ckpt.generation_config.get("eos_token_id")
        if gen is not None:
            return tuple(gen) if isinstance(gen, list) else (int(gen),)
        return tuple(ckpt.config.eos_token_ids) or tuple(ckpt.tokenizer.eos_token_ids)

    @property
    def fingerprint(self) -> str:
        """`system_fingerprint`: the backend configuration (changes when outputs may)."""
        dtype = self.checkpoint.dtype if self.checkpoint is not None else "none"
        return f"fp_metrale_{dtype}_{self.max_slots}x{self.max_len}"

    def model_card(self) -> dict[str, Any]:
        """The /v1/models entry of the served model."""
        card: dict[str, Any] = {"id": self.settings.model_name, "object": "model",
                                "created": self.created, "owned_by": "metrale",
                                "root": str(self.settings.model), "parent": None,
                                "max_model_len": self.max_len,
                                "input_modalities": ["text", "image"] if self.vision is not None
                                else ["text"]}
        if self.checkpoint is not None and self.checkpoint.sampling_defaults:
            # the request defaults from generation_config.json (a request's fields win)
            card["sampling_defaults"] = self.checkpoint.sampling_defaults
        if self.pooler is not None:
            info = self.pooler.info
            card["task"] = "embedding" if info.task == "embed" else "score"
            card["pooling"] = {"kind": info.kind, "dimensions": info.dimensions,
                               "pooling": info.pooling, "normalize": info.normalize,
                               "matryoshka": info.matryoshka}
        if self.vision is not None and self.image_limits is not None:
            card["max_images"] = self.image_limits.max_images  # per request
        if self.is_translation:
            from serving.http.translation import model_info
            card["task"] = "translation"
            card["translation"] = model_info(self.tokenizer, self.settings.source_lang,
                                             self.settings.target_lang)
        return card

    def lora_cards(self) -> list[dict[str, Any]]:
        """The /v1/models entries of the LoRA adapters (their parent: the served model)."""
        return [{"id": name, "object": "model", "created": self.created,
                 "owned_by": "metrale", "root": str(path),
                 "parent": self.settings.model_name, "max_model_len": self.max_len}
                for name, path in list(self.lora_paths.items())]

    def lora_ids(self) -> dict[int, str]:
        """The loaded LoRA adapters by id (llama.cpp's: here the engine slot each one holds)."""
        return {slot: name for name, slot in list(self.scheduler.lora_slots.items())
                if name in self.lora_paths}

    def lora_adapters(self) -> list[dict[str, Any]]:
        """GET /lora-adapters: each loaded adapter's id, name, path and its scale in the
        active mix (what a request that names no adapter gets)."""
        active = dict(self.scheduler.active_lora)
        return [{"id": slot, "name": name, "path": self.lora_paths.get(name, ""),
                 "scale": active.get(name, 0.0)}
                for slot, name in sorted(self.lora_ids().items())]

    # ---- text --------------------------------------------------------------------------
    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, **kwargs: Any) -> str:
        """Renders `messages` with the model's chat template (raises ChatTemplateError)."""
        if self._template is None:
            from metrale_jax.text import ChatTemplate
            source = self.checkpoint.chat_template
            if not source:
                raise ChatTemplateError(f"model {self.settings.model_name!r} has no chat "
                                        "template; use /v1/completions")
            tok = self.tokenizer
            self._template = ChatTemplate(source, bos_token=tok.bos_token,
                                          eos_token=tok.eos_token)
        return self._template.render(messages, add_generation_prompt=add_generation_prompt,
                                     tools=tools, **kwargs)

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Chat prompt ids: the rendered template, encoded without extra special tokens."""
        return self.tokenizer.encode(self.render_chat(messages, **kwargs),
                                     add_special_tokens=False)

    def token_str(self, token_id: int) -> str:
        """One token's text (special tokens included), cached."""
        text = self._token_strs.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strs[token_id] = text
        return text

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def check_languages(checkpoint: Any, source_lang: str | None, target_lang: str | None) -> None:
    """The default languages (`--source-lang` / `--target-lang`) against the loaded model:
    codes its tokenizer knows on a translation model, none on a decoder-only one (raises
    `InvalidParameterError`)."""
    from metrale_jax.errors import InvalidParameterError
    if getattr(checkpoint.config, "is_encoder_decoder", False):
        from metrale_jax.text.translation import check_default_languages
        check_default_languages(checkpoint.tokenizer, source_lang, target_lang)
        return
    for code, flag in ((source_lang, "--source-lang"), (target_lang, "--target-lang")):
        if code is not None:
            raise InvalidParameterError(
                f"{flag} is for translation models (NLLB / M2M100); {checkpoint.name!r} is a "
                "decoder-only model", param=flag[2:].replace("-", "_"))
