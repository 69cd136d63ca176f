"""The `metrale` command line: `pull`, `convert`, `generate`, `serve`, `models`, `chat`,
`bench` and `top` (each of the last four in its own module: serving/cli/models.py,
chat.py, bench.py, top.py).

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad input (one line on stderr, never a
traceback).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from metrale_jax.errors import FetchError, MetraleError

log = logging.getLogger("metrale")

DEMO_PROMPT = "What is the capital of France? Answer in one sentence."


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default exits 2 with usage; keep 2
        self.print_usage(sys.stderr)
        self.exit(2, f"metrale: error: {message}\n")


def _progress_bar():
    """A rich progress bar on a terminal, or None (plain log lines) otherwise."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn())


def cmd_pull(args: argparse.Namespace) -> int:
    """Fetches the default model into checkpoints/."""
    from metrale_jax.weights.default_model import pull_default_model
    bar = _progress_bar()
    if bar is None:
        def report(stage: str, done: int, total: int) -> None:
            if total == 0 or done == total:
                print(f"{stage} {done}/{total} bytes" if total else stage, file=sys.stderr)
        path = pull_default_model(report)
    else:
        with bar:
            task = bar.add_task("pull", total=None)

            def report(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total or None)
            path = pull_default_model(report)
    print(path)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """Converts a checkpoint (HF folder, GGUF, default) into Metrale's orbax format."""
    from pathlib import Path

    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import save_orbax
    from serving.progress import StageProgress, progress_kwargs, stage
    if Path(args.dst).expanduser().exists():  # before the slow part
        raise MetraleError(f"{args.dst}: already exists; choose a new folder")
    with StageProgress() as progress:
        with stage(progress, "loading weights") as step:
            ckpt = load_checkpoint(args.src, args.dtype,
                                   **progress_kwargs(load_checkpoint, step))
        with stage(progress, "writing orbax checkpoint") as step:
            out = save_orbax(ckpt, args.dst, **progress_kwargs(save_orbax, step))
    print(out)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Generates from one prompt, streaming text to stdout (or one JSON Completion)."""
    import dataclasses

    from metrale_jax import LLM
    from serving.cli.sampling import sampling_params_from_args
    from serving.cli.scale import engine_options, init_distributed, shape_flag
    params = sampling_params_from_args(args)
    pid, processes = init_distributed(args)
    if processes > 1:  # every process runs the same generation: the same seed on each
        params = dataclasses.replace(params, seed=0 if params.seed is None else params.seed)
        if pid != 0:  # only process 0 prints
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
    llm = LLM(args.model, dtype=args.dtype, max_slots=1, max_len=shape_flag(args.max_len),
              logprobs_mode=args.logprobs_mode, **engine_options(args))
    try:
        if args.chat:
            messages = [{"role": "user", "content": args.prompt}]
            if args.json:
                print(json.dumps(llm.chat(messages, params).to_dict()))
                return 0
            stream = llm.stream_chat(messages, params)
        else:
            if args.json:
                print(json.dumps(llm.generate([args.prompt], params)[0].to_dict()))
                return 0
            stream = llm.stream(args.prompt, params)
        for delta in stream:
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.close()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Runs the OpenAI-compatible HTTP server until SIGTERM/SIGINT; prints its URL when ready."""
    from serving.cli.scale import init_distributed
    if args.max_slots < 0 or args.max_len < 0 or args.max_len == 1:
        raise MetraleError("--max-slots must be ≥ 1 and --max-len ≥ 2 (0: chosen by the "
                           "memory plan)")
    pid, processes = init_distributed(args)
    if processes == 1:
        return _serve(args, 0, 1)
    # Multi-host: every way out is os._exit, since jax.distributed's shutdown barrier would
    # wait for processes that may be gone (metrale_jax/scheduler/multihost.py).
    from metrale_jax.scheduler.multihost import exit_now
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


def _serve(args: argparse.Namespace, pid: int, processes: int) -> int:
    from serving.cli.scale import engine_options, shape_flag
    from serving.http.server import serve
    from serving.http.settings import ServerSettings
    options = {"logprobs_mode": args.logprobs_mode, **engine_options(args)}
    if args.max_prefill_len is not None:
        options["max_prefill_len"] = args.max_prefill_len
    settings = ServerSettings(
        model=args.model, served_model_name=args.served_model_name, host=args.host,
        port=args.port, max_slots=shape_flag(args.max_slots),
        max_len=shape_flag(args.max_len), dtype=args.dtype, process_id=pid,
        num_processes=processes,
        engine_options=options, api_key=args.api_key, max_body_bytes=args.max_body_bytes,
        request_timeout=args.request_timeout or None, grace_period=args.grace_period,
        max_waiting=args.max_waiting, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser)
    from serving.progress import StageProgress
    for name in ("serving", "metrale_jax.engine.placement", "metrale_jax.scheduler.multihost"):
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


def _logprobs_mode_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--logprobs-mode", default="raw", choices=["raw", "processed"],
                        help="logprobs of the model's raw log-softmax (default, as vLLM) or of "
                             "the processed distribution actually sampled from")


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


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = _Parser(prog="metrale", description="Metrale-JAX: LLM inference on JAX/XLA.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    pull = sub.add_parser("pull", help="fetch the default model (SmolLM2-135M-Instruct GGUF)")
    pull.set_defaults(func=cmd_pull)

    conv = sub.add_parser("convert", help="convert a checkpoint to Metrale's orbax format")
    conv.add_argument("src", help="'default', a HF folder, or a .gguf file")
    conv.add_argument("dst", help="output folder (must not exist)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="params dtype to store (default float32)")
    conv.set_defaults(func=cmd_convert)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    gen.add_argument("--model", default="default", help="'default' or a checkpoint path")
    gen.add_argument("--prompt", default=DEMO_PROMPT, help="the prompt text")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--max-len", type=int, default=2048, help="context length (cache size)")
    gen.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                     help="params and compute dtype (default float32, or an orbax "
                          "checkpoint's stored dtype)")
    gen.add_argument("--json", action="store_true", help="print the Completion as JSON")
    from serving.cli.scale import add_scale_flags
    add_scale_flags(gen)
    _logprobs_mode_flag(gen)
    from serving.cli.sampling import add_sampling_flags
    add_sampling_flags(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    srv.add_argument("--model", default="default", help="'default' or a checkpoint path")
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
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    srv.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024,
                     help="larger request bodies get 413")
    srv.add_argument("--request-timeout", type=float, default=600.0,
                     help="default per-request timeout in seconds (0 = none)")
    srv.add_argument("--max-waiting", type=int, default=256,
                     help="requests that may wait for a slot; beyond: 503 with Retry-After")
    srv.add_argument("--grace-period", type=float, default=30.0,
                     help="seconds in-flight requests get after SIGTERM")
    _logprobs_mode_flag(srv)
    _parser_flags(srv)
    add_scale_flags(srv)
    srv.set_defaults(func=cmd_serve)

    from serving.cli import bench, chat, models, top
    for module in (models, chat, bench, top):
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `metrale` console script."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from serving.cli.bench import BenchFailedError
    from serving.cli.http_client import APIError, UnreachableError
    try:
        return args.func(args)
    except FetchError as e:  # the registry or the download failed: a runtime failure
        print(f"metrale: failed: {e.message}", file=sys.stderr)
        return 1
    except (UnreachableError, APIError, BenchFailedError) as e:  # the server is away or said no
        print(f"metrale: failed: {e}", file=sys.stderr)
        return 1
    except MetraleError as e:
        print(f"metrale: error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("metrale: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a runtime failure: one line, details only with -v
        log.debug("runtime failure", exc_info=True)
        print(f"metrale: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
