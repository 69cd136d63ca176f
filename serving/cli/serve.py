"""`metrale serve`: the OpenAI-compatible HTTP server (serving/http) until SIGTERM/SIGINT,
with the stages of loading as progress and its URL printed when ready; multi-host: one
process per host, process 0 serves the API."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from metrale_jax.errors import MetraleError
from serving.cli.languages import add_language_flags, source_len_option, translation_model
from serving.cli.sampling import add_logprobs_mode_flag
from serving.cli.scale import (
    add_kv_cache_flag,
    add_quantization_flag,
    add_scale_flags,
    engine_options,
    init_distributed,
    shape_flag,
)


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the OpenAI-compatible HTTP server until SIGTERM/SIGINT; prints its URL when ready."""
    check_flags(args)
    pid, processes = init_distributed(args)
    if processes == 1:
        return _serve(args, 0, 1)
    # Multi-host: every way out is os._exit, since jax.distributed's shutdown barrier would
    # wait for processes that may be gone (metrale_jax/multihost/).
    from metrale_jax.multihost import exit_now
    code = 1
    try:
        code = _serve(args, pid, processes)
    except MetraleError as e:
        print(f"metrale: error: {e.message}", file=sys.stderr)
        code = 2
    except BaseException as e:
        print(f"metrale: failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        exit_now(code)
    return code


def check_flags(args: argparse.Namespace) -> None:
    """Refuses bad flag values (`MetraleError`: exit 2) before anything loads; normalizes
    --lora, --active-lora and --allowed-media-domains in `args`."""
    if args.max_slots < 0 or args.max_len < 0 or args.max_len == 1:
        raise MetraleError("--max-slots must be ≥ 1 and --max-len ≥ 2 (0: chosen by the "
                           "memory plan)")
    if not 0.0 <= args.prefix_cache_share <= 1.0:
        raise MetraleError("--prefix-cache-share must be from 0 to 1")
    if args.prefix_cache_min_tokens < 0:
        raise MetraleError("--prefix-cache-min-tokens must be >= 0")
    if not 0 <= args.speculative_tokens <= 32:
        raise MetraleError("--speculative-tokens must be from 0 (off) to 32")
    _check_media_flags(args)
    _check_access_flags(args)
    _check_model_flags(args)
    args.loras = _lora_flags(args.lora)
    if args.loras and not 1 <= len(args.loras) <= args.max_loras:
        raise MetraleError(f"{len(args.loras)} LoRA adapters for --max-loras {args.max_loras}")
    if args.max_lora_rank < 1:
        raise MetraleError("--max-lora-rank must be >= 1")
    args.active_lora = _active_lora_flags(args.active_lora, args.loras)


def _check_model_flags(args: argparse.Namespace) -> None:
    """--model (repeatable, NAME=PATH), --models-dir and the pool's flags: `args.model` becomes
    the primary model (the first --model, else the first of --models-dir, else "default"),
    `args.models` the others; `args.keep_alive` seconds (None: the default)."""
    from serving.http.model_catalog import models_in_dir, parse_keep_alive, split_named
    values = list(args.model or [])
    if args.models_dir is not None:
        try:
            found = models_in_dir(args.models_dir)
        except MetraleError as e:
            raise MetraleError(e.message) from None
        if not found:
            raise MetraleError(f"--models-dir {args.models_dir}: no checkpoint in it (a "
                               "folder with config.json or metrale.json, or a .gguf file)")
        if not values:
            values = [f"{next(iter(found))}={found[next(iter(found))]}"]
    values = values or ["default"]
    name, path = split_named(values[0])
    if name is not None:
        if args.served_model_name is not None and args.served_model_name != name:
            raise MetraleError(f"--model {values[0]!r} names the model; --served-model-name "
                               f"{args.served_model_name!r} names it differently")
        args.served_model_name = name
    args.model, args.models = path, tuple(values[1:])
    if args.max_loaded_models is not None and args.max_loaded_models < 1:
        raise MetraleError("--max-loaded-models must be >= 1")
    if args.memory_budget_gb is not None and not (
            math.isfinite(args.memory_budget_gb) and args.memory_budget_gb > 0):
        raise MetraleError("--memory-budget-gb must be a number of GiB > 0")
    if not (math.isfinite(args.model_wait_timeout) and args.model_wait_timeout >= 0):
        raise MetraleError("--model-wait-timeout must be a number of seconds >= 0")
    try:
        args.keep_alive = (None if args.keep_alive is None
                           else parse_keep_alive(args.keep_alive, "--keep-alive"))
    except MetraleError as e:
        raise MetraleError(e.message) from None


def _check_media_flags(args: argparse.Namespace) -> None:
    """The image flags of a vision-language model (refused before anything loads);
    --allowed-media-domains becomes a tuple of host names."""
    if args.max_images is not None and args.max_images < 1:
        raise MetraleError("--max-images must be >= 1")
    if args.max_image_bytes < 1:
        raise MetraleError("--max-image-bytes must be >= 1")
    if args.max_image_pixels < 1:
        raise MetraleError("--max-image-pixels must be >= 1")
    if not (math.isfinite(args.media_fetch_timeout) and args.media_fetch_timeout > 0):
        raise MetraleError("--media-fetch-timeout must be a number of seconds > 0")
    args.allowed_media_domains = _media_domains(args.allowed_media_domains)


def _check_access_flags(args: argparse.Namespace) -> None:
    """--api-keys is read and checked whole now (a bad file: exit 2 before the model
    loads); --allowed-origins becomes a tuple of origins."""
    if args.api_key is not None and (not args.api_key.strip() or " " in args.api_key):
        raise MetraleError("--api-key must be a non-empty key without spaces")
    if args.api_keys is not None:
        from serving.http.keys import load_keys
        load_keys(args.api_keys)
    if args.protect_metrics and args.api_key is None and args.api_keys is None:
        raise MetraleError("--protect-metrics needs --api-key or --api-keys")
    args.allowed_origins = _origins(args.allowed_origins)
    if args.dump_file_mb <= 0:
        raise MetraleError("--dump-file-mb must be > 0")
    if args.dump_redact and args.dump_requests is None:
        raise MetraleError("--dump-redact needs --dump-requests DIR")
    if args.usage_log is not None and Path(args.usage_log).is_dir():
        raise MetraleError(f"--usage-log {args.usage_log}: a folder, not a file")
    if args.dump_requests is not None:
        folder = Path(args.dump_requests)
        if folder.exists() and not folder.is_dir():
            raise MetraleError(f"--dump-requests {args.dump_requests}: not a folder")


def _origins(values: list[str]) -> tuple[str, ...]:
    """--allowed-origins values (each may list several, comma separated): "*", or origins as
    browsers send them (scheme://host[:port], no path)."""
    import re
    out: list[str] = []
    for value in values:
        for origin in filter(None, (o.strip() for o in value.split(","))):
            if origin != "*" and not re.fullmatch(
                    r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(:\d{1,5})?", origin):
                raise MetraleError(f"--allowed-origins {origin!r}: give '*' or an origin as "
                                   "browsers send it (https://app.example.com[:port], no path)")
            if origin not in out:
                out.append(origin)
    return tuple(out)


def _media_domains(values: list[str]) -> tuple[str, ...]:
    """--allowed-media-domains values (each may list several, comma separated) as host names;
    a URL, a port, a path or a wildcard is an error."""
    import ipaddress
    import re
    out: list[str] = []
    for value in values:
        hosts = [h.strip() for h in value.split(",")]
        if not any(hosts):
            raise MetraleError(f"--allowed-media-domains {value!r}: expected host names")
        for host in filter(None, hosts):
            bare = host.strip("[]")
            if "://" in host or "/" in host:
                problem = "give a host name (example.com), not a URL"
            elif "*" in host:
                problem = "write the domain itself (example.com allows its subdomains too)"
            elif ":" in bare:
                try:
                    ipaddress.IPv6Address(bare)
                    problem = None
                except ValueError:
                    problem = "give the host without a port"
            elif not re.fullmatch(r"\.?[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*\.?", host):
                problem = "not a host name"
            else:
                problem = None
            if problem:
                raise MetraleError(f"--allowed-media-domains {host!r}: {problem}")
            if host not in out:
                out.append(host)
    return tuple(out)


def _itl_ms(value: str) -> float:
    """`--max-itl-ms`: a finite number of milliseconds >= 0 (0: no target)."""
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if not (math.isfinite(ms) and ms >= 0):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds >= 0, not {value!r}")
    return ms


def _seconds(value: str) -> float:
    """`--stall-timeout`: a finite number of seconds > 0."""
    try:
        s = float(value)
    except ValueError:
        s = math.nan
    if not (math.isfinite(s) and s > 0):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, not {value!r}")
    return s


def _lora_flags(values: list[str]) -> dict[str, str]:
    """--lora NAME=PATH values as {name: path}; a malformed or repeated one is an error."""
    out: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise MetraleError(f"--lora {value!r}: expected NAME=PATH")
        if name in out:
            raise MetraleError(f"--lora: the name {name!r} is given twice")
        out[name] = path
    return out


def _active_lora_flags(values: list[str], loras: dict[str, str]) -> dict[str, float]:
    """--active-lora NAME[=SCALE] values as {name: scale}; each must name a --lora adapter."""
    out: dict[str, float] = {}
    for value in values:
        name, sep, scale = value.partition("=")
        if name not in loras:
            raise MetraleError(f"--active-lora {value!r}: no --lora adapter is named {name!r}")
        try:
            out[name] = float(scale) if sep else 1.0
        except ValueError:
            raise MetraleError(f"--active-lora {value!r}: expected NAME or NAME=SCALE") \
                from None
        if not math.isfinite(out[name]):
            raise MetraleError(f"--active-lora {value!r}: the scale must be a finite number")
    return out


def _serve(args: argparse.Namespace, pid: int, processes: int) -> int:
    from serving.http.server import serve
    if args.source_lang is not None or args.target_lang is not None:
        # Checked from the model's files now (before any weight is read), and by the server
        # once loaded.
        translation_model(args.model, args.source_lang, args.target_lang)
    settings = server_settings(args, pid, processes)
    from serving.progress import StageProgress
    for name in ("serving", "metrale_jax.engine.placement", "metrale_jax.engine.programs",
                 "metrale_jax.multihost"):
        logging.getLogger(name).setLevel(logging.DEBUG if args.verbose else logging.INFO)
    print(f"metrale: loading {args.model} ...", file=sys.stderr)
    progress = StageProgress()

    def ready(url: str) -> None:
        progress.close()
        if pid == 0:
            print(f"metrale: serving {settings.model_name!r} at {url}/v1 (Ctrl-C to stop)",
                  flush=True)
        else:
            print(f"metrale: process {pid} of {processes} ready at {url} (/health only; "
                  "process 0 serves the API)", flush=True)

    try:
        serve(settings, on_ready=ready, progress=progress)
    except OSError as e:  # the port is taken, or the host is not ours
        raise MetraleError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    finally:
        progress.close()
    print("metrale: stopped", file=sys.stderr)
    return 0


def server_settings(args: argparse.Namespace, pid: int = 0, processes: int = 1) -> Any:
    """The `ServerSettings` of `metrale serve`'s flags (after `check_flags`)."""
    from serving.http.settings import ServerSettings
    options = {"logprobs_mode": args.logprobs_mode, "prefix_cache": args.prefix_cache,
               "prefix_cache_share": args.prefix_cache_share,
               "prefix_cache_min_tokens": args.prefix_cache_min_tokens, **engine_options(args)}
    if args.loras or args.enable_lora_runtime_updates:
        options.update(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    if args.max_prefill_len is not None:
        options["max_prefill_len"] = args.max_prefill_len
    options.update(source_len_option(args))
    if args.max_images is not None:
        options["max_images"] = args.max_images
    if args.speculative_tokens:
        options["speculative_tokens"] = args.speculative_tokens
    settings = ServerSettings(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, max_slots=shape_flag(args.max_slots),
        max_len=shape_flag(args.max_len), dtype=args.dtype, process_id=pid,
        num_processes=processes,
        engine_options=options, api_key=args.api_key, api_keys_file=args.api_keys,
        protect_metrics=args.protect_metrics, allowed_origins=args.allowed_origins,
        dump_requests=args.dump_requests, dump_redact=args.dump_redact,
        dump_file_bytes=int(args.dump_file_mb * 1024 * 1024), webui=not args.no_webui,
        usage_log=args.usage_log,
        max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout or None, grace_period=args.grace_period,
        max_waiting=args.max_waiting, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, loras=args.loras,
        active_lora=args.active_lora,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
        source_lang=args.source_lang, target_lang=args.target_lang,
        allowed_media_domains=args.allowed_media_domains,
        max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels,
        media_fetch_timeout=args.media_fetch_timeout, warmup=args.warmup, task=args.task,
        models=args.models, models_dir=args.models_dir,
        max_loaded_models=args.max_loaded_models, memory_budget_gb=args.memory_budget_gb,
        keep_alive=args.keep_alive, model_wait_timeout=args.model_wait_timeout,
        max_itl_ms=args.max_itl_ms, stall_timeout=args.stall_timeout,
        exit_on_stall=args.exit_on_stall)
    return settings


def _parser_flags(parser: argparse.ArgumentParser) -> None:
    from serving.http import reasoning
    from serving.http.tools import parsers
    parser.add_argument("--tool-call-parser", default="auto",
                        choices=[*parsers.CHOICES, *parsers.ALIASES],
                        help="the tool-call format of the model's output (default: from the "
                             "chat template)")
    parser.add_argument("--reasoning-parser", default="auto",
                        choices=[*reasoning.CHOICES, *reasoning.ALIASES],
                        help="split the model's thinking into reasoning_content (default: "
                             "'think' when the chat template knows <think>)")


def _access_flags(parser: argparse.ArgumentParser) -> None:
    """Keys, tenants and limits (serving/http/keys.py, limits.py) and CORS."""
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (one admin key of tenant "
                             "'default', no limits; with --api-keys, accepted beside them)")
    parser.add_argument("--api-keys", default=None, metavar="FILE",
                        help="a TOML or JSON file of keys (or their SHA-256), each with its "
                             "tenant, allowed models and adapters, limits (requests and "
                             "tokens per minute, concurrent requests, daily tokens), enabled "
                             "and admin flags; re-read on SIGHUP")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="/metrics needs a key too (default: open, as /health)")
    parser.add_argument("--allowed-origins", action="extend", nargs="+", default=[],
                        metavar="ORIGIN",
                        help="browser pages of these origins may call the API (CORS; "
                             "https://app.example.com, or '*' for any); default none")
    parser.add_argument("--no-webui", action="store_true",
                        help="do not serve the web chat page at GET /")
    parser.add_argument("--dump-requests", default=None, metavar="DIR",
                        help="number every request (x-request-seq) and write one JSON line "
                             "per request into DIR (requests-<seq>.jsonl): tenant, route, "
                             "body, outcome, timings; replay with 'metrale replay DIR'")
    parser.add_argument("--usage-log", default=None, metavar="FILE",
                        help="append per-tenant usage to FILE (JSON lines) and read it back "
                             "at start: GET /v1/metrale/usage survives restarts and kills")
    parser.add_argument("--dump-redact", action="store_true",
                        help="request dumps keep no prompt or output text, only lengths")
    parser.add_argument("--dump-file-mb", type=float, default=64.0, metavar="MB",
                        help="rotate a request dump file before it passes this size "
                             "(default 64)")


def _pool_flags(parser: argparse.ArgumentParser) -> None:
    """Several models in one server (serving/http/model_pool.py)."""
    parser.add_argument("--models-dir", default=None, metavar="DIR",
                        help="serve every checkpoint in DIR (sub-folders with config.json or "
                             "metrale.json, .gguf files) under its name, loaded on demand")
    parser.add_argument("--max-loaded-models", type=int, default=None, metavar="N",
                        help="the most models loaded at once (default: what the memory "
                             "budget holds); the least recently used idle one is unloaded")
    parser.add_argument("--memory-budget-gb", type=float, default=None, metavar="GIB",
                        help="GiB per device the loaded models' weights, KV pools and "
                             "scratch may take together (default: the device's memory less "
                             "10%%; unbounded on CPU)")
    parser.add_argument("--keep-alive", default=None, metavar="DURATION",
                        help="how long an idle model stays loaded: '5m', '30s', seconds, 0 "
                             "(unload once answered) or -1 (forever); default forever with "
                             "one model, 5m with several; a request's keep_alive overrides it")
    parser.add_argument("--model-wait-timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long a request waits for room to load its model while "
                             "every loaded model is busy, before a 503 (default 60)")


def _media_flags(parser: argparse.ArgumentParser) -> None:
    """The image flags of a vision-language model (LLaVA): chat content parts image_url."""
    parser.add_argument("--max-images", type=int, default=None, metavar="N",
                        help="vision-language models: the most images one request may send, "
                             "and the images the device holds at once (default 8)")
    parser.add_argument("--allowed-media-domains", action="extend", nargs="+", default=[],
                        metavar="HOST",
                        help="vision-language models: fetch http(s) image URLs from these "
                             "hosts and their subdomains (space or comma separated, e.g. "
                             "example.com,img.example.org 127.0.0.1); default none: images "
                             "only as data: URLs")
    parser.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024,
                        metavar="BYTES",
                        help="the largest image file a request may send or name (default 20 "
                             "MiB; a data: URL also counts in --max-body-bytes)")
    parser.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        metavar="PIXELS",
                        help="the largest image, width x height (default 4096 x 4096), "
                             "checked before its pixels are decoded")
    parser.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="SECONDS",
                        help="seconds an image URL's download may take (default 10)")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale serve`."""
    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("--model", action="append", default=None, metavar="[NAME=]MODEL",
                     help="'default', a checkpoint path, or a Hugging Face name "
                     "org/repo[:QUANT][@revision]; NAME= names it; repeat to serve several "
                     "(the first loads at start, the others on their first request)")
    _pool_flags(srv)
    srv.add_argument("--served-model-name", default=None,
                     help="the model id clients use (default: the --model argument)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8000, help="port to listen on (0 = any)")
    srv.add_argument("--max-slots", type=int, default=8,
                     help="decode slots B (0 = as many as fit: the memory plan)")
    srv.add_argument("--max-len", type=int, default=2048,
                     help="context length S (0 = chosen by the memory plan)")
    srv.add_argument("--max-prefill-len", type=int, default=None,
                     help="largest prefill bucket (a power of two; default the engine's)")
    srv.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                     help="params and compute dtype (default float32)")
    add_quantization_flag(srv)
    add_kv_cache_flag(srv)
    _access_flags(srv)
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                     help="larger request bodies get 413")
    srv.add_argument("--request-timeout", type=float, default=600.0,
                     help="default per-request timeout in seconds (0 = none)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="requests that may wait for a slot; beyond: 503 with Retry-After")
    srv.add_argument("--max-itl-ms", type=_itl_ms, default=None, metavar="MS",
                     help="latency target: while streams decode, each step's prompt chunk is "
                          "sized so the step's predicted time stays within MS (a request's "
                          "max_itl_ms may ask for less); 0: none (default 250)")
    srv.add_argument("--grace-period", type=float, default=30.0,
                     help="seconds in-flight requests get after SIGTERM")
    srv.add_argument("--stall-timeout", type=_seconds, default=None, metavar="S",
                     help="the batching loop is stalled when no step completes for S seconds "
                          "while requests wait or run: /health and new requests get 503, "
                          "waiting requests 503, the thread stacks go to the log (default: "
                          "120, or the warmup's time when longer)")
    srv.add_argument("--exit-on-stall", action="store_true",
                     help="a stall ends the process with exit status 4, for a supervisor to "
                          "restart it (the deploy/ recipes turn it on)")
    srv.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                     help="prefill every prompt whole (default: full KV pages are cached by "
                          "content and shared by prompts that start with them)")
    srv.add_argument("--prefix-cache-share", type=float, default=1.0, metavar="FRACTION",
                     help="the most of the KV page pool (0 .. 1) that cached pages no request "
                          "holds may keep (default 1: all of it; they are evicted, least "
                          "recently used first, whenever requests need pages)")
    srv.add_argument("--lora", "--lora-modules", dest="lora", action="extend", nargs="+",
                     default=[], metavar="NAME=PATH",
                     help="serve the PEFT LoRA adapter in folder PATH as model NAME (requests "
                          "send \"model\": NAME); repeatable (vLLM's --lora-modules)")
    srv.add_argument("--active-lora", action="append", default=[], metavar="NAME[=SCALE]",
                     help="serve requests that name no adapter (by model or lora) with the "
                          "--lora adapter NAME at SCALE (default 1); repeatable, the updates "
                          "add up; POST /lora-adapters changes it while serving")
    srv.add_argument("--enable-lora-runtime-updates", action="store_true",
                     help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter")
    srv.add_argument("--max-loras", type=int, default=4,
                     help="LoRA adapter slots on the device (default 4)")
    srv.add_argument("--max-lora-rank", type=int, default=16,
                     help="the largest LoRA rank served (default 16)")
    srv.add_argument("--prefix-cache-min-tokens", type=int, default=64, metavar="N",
                     help="the shortest shared prefix read from the cache (default 64: off "
                          "TPU a shorter one costs more to read than to prefill)")
    srv.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                     help="speculative decoding with prompt lookup: up to K draft tokens per "
                          "step, copied from the request's own text and verified in one "
                          "forward (same output); the requests' default and maximum "
                          "(\"speculative\": {\"num_tokens\": k}); 0 = off (default)")
    srv.add_argument("--warmup", choices=["serve", "full", "none"], default="serve",
                     help="serve (default): compile the few programs that serve any request, "
                          "answer /health, and compile the rest in the background; full: "
                          "compile every program before /health; none: compile on first use")
    srv.add_argument("--task", choices=["auto", "generate", "embed", "score"], default="auto",
                     help="auto (default): from the model's files (an embedding or "
                          "cross-encoder folder serves /v1/embeddings, /v1/rerank and "
                          "/v1/score); generate: chat and completions; embed: a decoder model "
                          "as an embedding model (last-token pooling); score: a decoder "
                          "model as a yes/no reranker (as Qwen3-Reranker)")
    _media_flags(srv)
    add_language_flags(srv)
    add_logprobs_mode_flag(srv)
    _parser_flags(srv)
    add_scale_flags(srv)
    srv.set_defaults(func=cmd_serve)
