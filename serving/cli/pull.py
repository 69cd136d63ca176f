"""`metrale pull`: fetches the default model (SmolLM2-135M-Instruct GGUF) into checkpoints/,
with a rich bar on a terminal and plain lines elsewhere."""

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


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale pull`."""
    pull = sub.add_parser("pull", help="fetch the default model (SmolLM2-135M-Instruct GGUF)")
    pull.set_defaults(func=cmd_pull)
