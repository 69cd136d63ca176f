"""Progress of the CLI's long stages: loading weights, compiling, converting.

A stage reports `(stage, done, total)`; total 0 means "not known yet" (a spinner). On a
terminal `StageProgress` draws one rich bar per stage; otherwise it writes plain lines (the
start of each stage, each quarter of the way, and the end with its seconds), so logs and CI
output stay readable.

Library code takes a callback and never prints; `stage()` wraps a callback so that the caller
marks a stage's start and end even where the library reports no steps in between.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO, Any

ProgressFn = Callable[[str, int, int], None]
StepFn = Callable[[int, int], None]


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """True when `fn` takes a keyword argument `name` (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return any((p.name == name and p.kind is not p.POSITIONAL_ONLY)
               or p.kind is p.VAR_KEYWORD for p in params)


def progress_kwargs(fn: Callable[..., Any], step: StepFn | None) -> dict[str, StepFn]:
    """`{"progress": step}` when `fn` takes a `progress` keyword and `step` is given, else {}.

    Lets the CLI pass a step callback to library functions that offer the hook
    (`load_checkpoint`, `Engine.warmup`) and still run against versions that don't."""
    return {"progress": step} if step is not None and accepts_keyword(fn, "progress") else {}


@contextlib.contextmanager
def stage(report: ProgressFn | None, name: str) -> Iterator[StepFn]:
    """Reports the start of stage `name`, yields a `step(done, total)` callback for the work
    in between, and reports the stage complete when the block ends without an error."""
    if report is None:
        yield lambda done, total: None
        return
    last = [0]

    def step(done: int, total: int) -> None:
        last[0] = total
        report(name, done, total)

    report(name, 0, 0)
    yield step
    total = last[0] or 1
    report(name, total, total)


class StageProgress:
    """A `ProgressFn` that draws rich bars on a terminal and writes plain lines elsewhere.

    Thread-safe: loading and compiling report from worker threads. Use as a context manager,
    or call `close()`; stages still open at close are left as they are.
    """

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None,
                 prefix: str = "metrale"):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.prefix = prefix
        self._lock = threading.Lock()
        self._started: dict[str, float] = {}
        self._quarter: dict[str, int] = {}
        self._done: set[str] = set()
        self._bar: Any = None
        self._tasks: dict[str, Any] = {}
        self._handlers: list[tuple[logging.StreamHandler, Any]] = []
        if self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(file=self.stream), transient=False)
            self._bar.start()
            self._redirect_logs()

    def __call__(self, name: str, done: int, total: int) -> None:
        with self._lock:
            if name in self._done:
                return
            first = name not in self._started
            if first:
                self._started[name] = time.perf_counter()
            finished = total > 0 and done >= total
            if self._bar is not None:
                self._draw(name, done, total, finished)
            else:
                self._line(name, done, total, first, finished)
            if finished:
                self._done.add(name)

    def _draw(self, name: str, done: int, total: int, finished: bool) -> None:
        task = self._tasks.get(name)
        if task is None:
            task = self._tasks[name] = self._bar.add_task(name, total=total or None)
        self._bar.update(task, completed=done, total=total or None)
        if finished:
            self._bar.stop_task(task)

    def _line(self, name: str, done: int, total: int, first: bool, finished: bool) -> None:
        if finished:
            seconds = time.perf_counter() - self._started[name]
            count = f" {total}/{total}" if total > 1 else ""
            self._write(f"{name}:{count} done in {seconds:.1f} s")
            return
        if first:
            self._write(f"{name} ..." if not total or not done else f"{name}: {done}/{total}")
            self._quarter[name] = 4 * done // total if total else 0
            return
        if total:
            quarter = 4 * done // total
            if quarter > self._quarter.get(name, 0):
                self._quarter[name] = quarter
                self._write(f"{name}: {done}/{total}")

    def _write(self, text: str) -> None:
        print(f"{self.prefix}: {text}", file=self.stream, flush=True)

    def _redirect_logs(self) -> None:
        """Log lines written to our stream go through rich's proxy of it while the bars are
        drawn (it prints them above the bars instead of through them)."""
        proxy = sys.stderr  # rich's, when it redirected our stream for its live display
        if proxy is self.stream:
            return
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                self._handlers.append((handler, handler.setStream(proxy)))

    def close(self) -> None:
        """Stops drawing (the bars stay on the screen as they were)."""
        with self._lock:
            if self._bar is not None:
                for handler, stream in self._handlers:
                    handler.setStream(stream)
                self._handlers.clear()
                self._bar.stop()
                self._bar = None

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
