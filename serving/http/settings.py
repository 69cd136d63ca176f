"""`ServerSettings`: everything `create_app` and `serve` need, in one frozen dataclass."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """How the HTTP server loads its model and talks to clients.

    model: "default", a HF folder, a .gguf file or an orbax checkpoint (`load_checkpoint`).
    served_model_name: the id clients send as `model` and /v1/models lists (None = `model`).
    host, port: where Hypercorn listens (port 0 = any free port).
    max_slots, max_len, dtype: the engine's decode slots B, context length S and dtype (B or S
        None: chosen by the memory plan, see metrale_jax/engine/placement.py).
    engine_options: further `EngineConfig` fields (max_prefill_len, decode_steps, mesh,
        memory_gb, ...).
    process_id, num_processes: this process among those of a multi-host server (process 0
        serves the API; the others run the same engine calls and answer only /health).
    max_waiting: bound of the scheduler's waiting queue (beyond it: 503 + Retry-After).
    api_key: one key (tenant "default", admin, no limits): every route but /health and
        /metrics needs `Authorization: Bearer <key>` (serving/http/access.py).
    api_keys_file: a TOML or JSON file of keys with tenants, rights and limits
        (serving/http/keys.py), read again on SIGHUP; with `api_key`, both are accepted.
    protect_metrics: with keys, /metrics needs one too (default: open, as /health).
    allowed_origins: the origins ("https://app.example.com", or "*") whose browser pages may
        call the API (CORS); empty (the default): none.
    dump_requests: a folder for request dumps (serving/http/dumps.py): every request but
        /health and /metrics is numbered (`x-request-seq`, log lines) and gets one JSON line
        there when it ends; None (the default): no dumps, and requests are not numbered.
    dump_redact: the dumps keep no prompt or output text (only their lengths).
    dump_file_bytes: a dump file is rotated before it would pass this size.
    usage_retention: seconds of per-minute usage `GET /v1/metrale/usage?since=` can look
        back over (serving/http/usage.py).
    usage_log: a file the per-tenant usage is appended to and read back from at start
        (serving/http/usage_log.py): usage outlives restarts and kills; None: memory only.
    webui: serve the web chat page at `GET /` (serving/http/routes/webui.py).
    max_body_bytes: request bodies above this get 413.
    request_timeout: default per-request deadline in seconds (None = none); a request's own
        `timeout` field overrides it.
    grace_period: seconds in-flight requests may run after SIGTERM before they are cancelled.
    warmup: "serve" (the default): compile the few programs that serve any request, turn
        /health 200, and compile the rest of the grid in the background (meanwhile a step
        runs in the nearest compiled shape; `/v1/metrale/stats` shows the progress);
        "full" (or True): compile every engine shape before /health turns 200; "none" (or
        False): each program compiles on first use. A multi-host server warms up "full"
        (every process must run the same programs).
    tool_call_parser: the tool-call format of the model's output (`hermes`, `llama3_json`,
        `mistral`), "none", or "auto" (from the chat template); serving/http/tools/parsers.py.
    reasoning_parser: the thinking format (`think`, `deepseek_r1`), "none", or "auto" (`think`
        when the chat template knows `<think>`); serving/http/reasoning.py.
    loras: LoRA adapters served beside the base model, {name: PEFT adapter folder}; a request
        picks one by sending its name as `model` (the engine's `max_loras` slots hold them).
    active_lora: the adapters (of `loras`) a request that names none is served with, {name:
        scale}; POST /lora-adapters changes them while serving (llama.cpp's global scales).
    enable_lora_runtime_updates: POST /v1/load_lora_adapter and /v1/unload_lora_adapter work
        (otherwise they answer 400).
    source_lang, target_lang: a translation model's default languages (FLORES-200 codes such
        as "eng_Latn"), for requests that name none (serving/http/translation.py); None: a
        request must name it. Checked against the tokenizer once the model loads; set on a
        decoder-only model, the loading fails. (The longest source a translation model holds
        is the engine's `max_source_len`, in `engine_options`.)
    allowed_media_domains: a vision-language model's http(s) image URLs are fetched only
        from these hosts and their subdomains; empty (the default): only data: URLs.
    max_image_bytes, max_image_pixels: the largest image file (bytes, after base64 decoding
        or downloaded) and image (width * height) a request may send; larger ones are 400s.
    media_fetch_timeout: seconds a remote image's download may take (per connect and read,
        and in all). The images per request: the engine's `max_images` (`engine_options`).
        See `metrale_jax.vision.media.ImageLimits`.
    task: what the model is served for: "generate" (chat and completions), "embed"
        (/v1/embeddings; rerank by cosine), "score" (/v1/rerank and /v1/score from a
        cross-encoder or a decoder reranker), or "auto" (the default: from the model's files,
        `metrale_jax.embedding.loader.pooling_task`).
    models: further models served beside `model`, each a path or name, or `NAME=PATH`
        (serving/http/model_catalog.py); they load on demand (serving/http/model_pool.py).
    models_dir: a folder whose every checkpoint (sub-folder or .gguf file) is servable under
        its name.
    max_loaded_models: the most models loaded at once (None: as many as the memory budget
        holds).
    memory_budget_gb: GiB per device the loaded models may hold together (weights, KV pools,
        step scratch: their memory plans); None: the device's memory less the plan's reserve
        where it reports one, else no bound (CPU: pass it, or --max-loaded-models).
    keep_alive: seconds an idle model stays loaded (Ollama's `keep_alive`; `math.inf`:
        forever, 0: unloaded once answered); None: forever with one model, 5 minutes with
        several. A request's `keep_alive` overrides it for its model.
    max_itl_ms: the latency target (ms): while rows decode, each step's prompt chunk is sized
        so that its predicted time stays within it (metrale_jax/scheduler/step_time.py); a
        request's `max_itl_ms` may ask for less (clamped to `step_time.FLOOR_MS`); None: the
        scheduler's default (`step_time.DEFAULT_MAX_ITL_MS`, 250); 0: no target.
    stall_timeout: seconds without a step completed while requests wait or run that make
        the batching loop stalled (metrale_jax/scheduler/watchdog.py); None: 120, or the
        warmup's time when longer.
    exit_on_stall: a stall ends the process (exit status `watchdog.EXIT_STALLED`, 4).
    model_wait_timeout: seconds a request waits for room to load its model while every
        loaded model is busy, before a 503 with Retry-After.
    """

    model: str = "default"
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    max_slots: int | None = 8
    max_len: int | None = 2048
    dtype: str | None = None
    engine_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_waiting: int = 256
    api_key: str | None = None
    api_keys_file: str | None = None
    protect_metrics: bool = False
    allowed_origins: tuple[str, ...] = ()
    dump_requests: str | None = None
    dump_redact: bool = False
    dump_file_bytes: int = 64 * 1024 * 1024
    usage_retention: float = 7 * 86400.0
    usage_log: str | None = None
    webui: bool = True
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout: float | None = 600.0
    grace_period: float = 30.0
    warmup: str | bool = "serve"
    process_id: int = 0
    num_processes: int = 1
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    loras: dict[str, str] = dataclasses.field(default_factory=dict)
    active_lora: dict[str, float] = dataclasses.field(default_factory=dict)
    enable_lora_runtime_updates: bool = False
    source_lang: str | None = None
    target_lang: str | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    media_fetch_timeout: float = 10.0
    task: str = "auto"
    models: tuple[str, ...] = ()
    models_dir: str | None = None
    max_loaded_models: int | None = None
    memory_budget_gb: float | None = None
    keep_alive: float | None = None
    model_wait_timeout: float = 60.0
    max_itl_ms: float | None = None
    stall_timeout: float | None = None
    exit_on_stall: bool = False

    @property
    def warmup_mode(self) -> str:
        """`warmup` as one of "serve", "full" and "none" (True and False: full and none; a
        multi-host server: full, unless none)."""
        mode = {True: "full", False: "none"}.get(self.warmup, self.warmup)  # type: ignore
        return "full" if self.num_processes > 1 and mode == "serve" else str(mode)

    @property
    def model_name(self) -> str:
        """The name the served model answers to."""
        return self.served_model_name or str(self.model)
