"""The `metrale` command: its parser and `main`. Each subcommand (`pull`, `convert`,
`generate`, `serve`, `models`, `chat`, `bench`, `top`, `replay`) lives in its own module of
serving/cli with an `add_parser(sub)` that registers its flags and its `cmd_*` function.

Exit codes: 0 ok, 1 runtime failure, 2 bad usage or bad input (one line on stderr, never a
traceback).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from metrale_jax.errors import FetchError, MetraleError

log = logging.getLogger("metrale")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's default exits 2 with usage; keep 2
        self.print_usage(sys.stderr)
        self.exit(2, f"metrale: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every subcommand."""
    p = _Parser(prog="metrale", description="Metrale-JAX: LLM inference on JAX/XLA.")
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from serving.cli import (
        bench,
        chat,
        convert,
        embed,
        generate,
        models,
        pull,
        replay,
        serve,
        top,
    )
    for command in (pull, convert, generate, embed, serve, models, chat, bench, top, replay):
        command.add_parser(sub)
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

