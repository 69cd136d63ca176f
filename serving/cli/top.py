"""`metrale top --url http://HOST:PORT`: a live terminal dashboard of a running server.

A textual app: the summary (state, slots, queue, compiles, errors), sparklines of throughput
and TTFT, a table of the busy slots (request id, tokens so far, tokens/s) and the latest
errors. It polls every `--interval` seconds in a worker thread (the HTTP reads never block
the screen); a failed poll shows "disconnected" and the next one tries again. Keys: q quits,
p pauses. With `--once`, or when stdout is not a terminal, it prints one text snapshot.
What is shown is computed in serving/cli/top_data.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, ClassVar

from serving.cli.http_client import APIError, Client, UnreachableError
from serving.cli.top_data import (
    ERROR_COLUMNS,
    MODEL_COLUMNS,
    SLOT_COLUMNS,
    TopModel,
    error_rows,
    model_rows,
    render_text,
    slot_rows,
)
from serving.cli.top_data import summary as summary_lines


def build_app(model: TopModel, interval: float = 1.0) -> Any:
    """The textual `App` over `model`; `interval` 0 = poll only when `poll()` is awaited."""
    from textual.app import App, ComposeResult
    from textual.containers import Horizontal, Vertical
    from textual.widgets import DataTable, Footer, Header, Label, Sparkline, Static

    class TopApp(App):
        """The dashboard (see the module docstring)."""

        CSS = """
        #summary { height: auto; padding: 0 1; }
        #sparks { height: 6; }
        .spark { width: 1fr; padding: 0 1; }
        Sparkline { height: 4; }
        #slots { height: 1fr; }
        #errors { height: 10; }
        .title { padding: 0 1; text-style: bold; }
        """
        BINDINGS: ClassVar = [("q", "quit", "Quit"), ("p", "pause", "Pause")]

        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.interval = interval
            self.paused = False
            self.polls = 0
            self.last_error: str | None = None
            self._busy = False

        def compose(self) -> ComposeResult:
            yield Header(show_clock=True)
            yield Static("connecting ...", id="summary")
            with Horizontal(id="sparks"):
                with Vertical(classes="spark"):
                    yield Label("throughput (tok/s)", id="tput-label")
                    yield Sparkline([], id="tput", summary_function=max)
                with Vertical(classes="spark"):
                    yield Label("TTFT (ms)", id="ttft-label")
                    yield Sparkline([], id="ttft", summary_function=max)
            yield Label("slots", classes="title")
            yield DataTable(id="slots", zebra_stripes=True)
            yield Label("models", classes="title")
            yield DataTable(id="models")
            yield Label("recent errors", classes="title")
            yield DataTable(id="errors")
            yield Footer()

        def on_mount(self) -> None:
            self.title = "metrale top"
            self.sub_title = model.client.url
            self.query_one("#slots", DataTable).add_columns(*SLOT_COLUMNS)
            self.query_one("#errors", DataTable).add_columns(*ERROR_COLUMNS)
            self.query_one("#models", DataTable).add_columns(*MODEL_COLUMNS)
            if self.interval > 0:
                self.set_interval(self.interval, self.poll)
                self.call_later(self.poll)

        async def poll(self) -> None:
            """Reads the server once (in a thread) and redraws."""
            if self.paused or self._busy:
                return
            self._busy = True
            try:
                sample = await asyncio.to_thread(self.model.poll)
            except (UnreachableError, APIError) as e:
                self.last_error = str(e)
                self.query_one("#summary", Static).update(f"disconnected: {e}")
                return
            finally:
                self._busy = False
            self.last_error = None
            self.polls += 1
            self.show(sample.stats)

        def show(self, stats: dict[str, Any]) -> None:
            """Redraws every widget from one stats JSON and the model's series."""
            self.query_one("#summary", Static).update("\n".join(summary_lines(stats)))
            tput, ttft = list(self.model.throughput), list(self.model.ttft_ms)
            self.query_one("#tput", Sparkline).data = tput
            self.query_one("#ttft", Sparkline).data = ttft
            if tput:
                self.query_one("#tput-label", Label).update(
                    f"throughput (tok/s): now {tput[-1]:.1f}, peak {max(tput):.1f}")
            if any(ttft):
                self.query_one("#ttft-label", Label).update(
                    f"TTFT (ms): last {[v for v in ttft if v][-1]:.0f}, peak {max(ttft):.0f}")
            slots = self.query_one("#slots", DataTable)
            slots.clear()
            for row in slot_rows(stats):
                slots.add_row(*row)
            models = self.query_one("#models", DataTable)
            models.clear()
            for row in model_rows(stats):
                models.add_row(*row)
            errors = self.query_one("#errors", DataTable)
            errors.clear()
            for row in error_rows(stats):
                errors.add_row(*row)

        def action_pause(self) -> None:
            """Stops (or resumes) polling."""
            self.paused = not self.paused
            self.sub_title = model.client.url + ("  [paused]" if self.paused else "")

    return TopApp()


def cmd_top(args: argparse.Namespace) -> int:
    """Runs the dashboard (or prints one snapshot)."""
    from metrale_jax.errors import InvalidParameterError
    if args.interval <= 0:
        raise InvalidParameterError("--interval must be > 0")
    client = Client(args.url, api_key=args.api_key, timeout=args.timeout)
    model = TopModel(client)
    try:
        sample = model.poll()  # fail fast, with one line, before taking over the screen
    except APIError as e:
        if e.status == 404:
            raise APIError(404, f"{client.url} has no /v1/metrale/stats (is it a Metrale "
                                "server?)") from None
        raise
    if args.once or not sys.stdout.isatty():
        print(render_text(sample.stats, model))
        return 0
    build_app(model, args.interval).run()
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale top`."""
    p = sub.add_parser(
        "top", help="live dashboard of a running server",
        description="A live terminal dashboard of a running Metrale server: slots in use "
                    "(request id, tokens so far, tokens/s), the waiting queue, throughput "
                    "and TTFT sparklines, compiles and errors. Reads GET /v1/metrale/stats "
                    "and /metrics. Keys: q quits, p pauses.")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None,
                   help="the server's --api-key (the stats endpoint is under /v1/)")
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between polls (default 1)")
    p.add_argument("--timeout", type=float, default=10.0,
                   help="seconds one poll may take (default 10)")
    p.add_argument("--once", action="store_true",
                   help="print one text snapshot and exit (the default when stdout is not a "
                        "terminal)")
    p.set_defaults(func=cmd_top)
