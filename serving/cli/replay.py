"""`metrale replay`: sends the requests of a request dump again and compares the outcomes.

    metrale replay dumps/ --url http://127.0.0.1:8000 --concurrency 4 --show-diffs

Reads a dump (one `requests-*.jsonl` file, or a folder of them, as `metrale serve
--dump-requests DIR` writes them: the schema is in serving/http/dumps.py) in seq order and
POSTs every reproducible generation request (`/v1/chat/completions`, `/v1/completions`) to the
same route of `--url`. Streaming requests are sent with `"stream": false` (and without
`stream_options`): the answer then holds the texts, finish reasons and usage in one body.

What is compared: the HTTP status; then, for a request that succeeded, each choice's text when
the dump holds the texts (`outcome.texts`), the finish reasons (one per choice, by index) and
`usage.completion_tokens`. Only deterministic requests are compared on their output: greedy
ones (`temperature` 0 or `top_k` 1) and seeded ones (`seed` set); a dumped error (status ≥ 400)
is compared on its status whatever the sampling.

Skipped: redacted entries (their prompts are gone), routes other than the two above, sampled
requests, outcomes that depended on the moment (cancelled by the client, timed out, or
answered 408, 429, 499, 503 or 504) and those that answered the caller's key (401, 403: the
replay sends its own `--api-key`). Exit code 0 when every replayed request compared equal,
1 when some differ or failed, 2 for bad input (a missing or empty dump, a bad URL).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from metrale_jax.errors import InvalidParameterError
from serving.cli.http_client import APIError, Client, UnreachableError
from serving.http.dumps import dump_files, read_dump_lines

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
"""The routes replayed; every other route is skipped."""

UNREPRODUCIBLE_STATUSES = frozenset({408, 429, 499, 503, 504})
"""Statuses that say more about the server's load at the time than about the request."""

KEY_STATUSES = frozenset({401, 403})
"""Statuses that answered the caller's key (the replay sends its own `--api-key`)."""

SKIP_REDACTED = "redacted"
SKIP_NOT_GENERATION = "not generation"
SKIP_SAMPLED = "sampled"
SKIP_MOMENT = "cancelled / timed out / overloaded"
SKIP_KEY = "refused the key"
SKIP_NO_BODY = "no body"
SKIP_UNREADABLE = "unreadable line"

COUNT_COLUMNS = ("entries", "replayed", "same", "different", "failed", "skipped")


@dataclass
class Planned:
    """One dump entry to replay: its seq, route, the body to send and the dumped entry."""

    seq: int
    route: str
    body: dict[str, Any]
    entry: dict[str, Any]


@dataclass
class Outcome:
    """The result of replaying one entry. verdict: "same", "different" or "failed"; diffs:
    (field, dumped value, replayed value) for each field that differs; error: why it failed."""

    seq: int
    route: str
    verdict: str
    diffs: list[tuple[str, Any, Any]] = field(default_factory=list)
    error: str | None = None


@dataclass
class Report:
    """A whole replay: every outcome by seq, the skipped entries' reasons, the entry count."""

    entries: int
    outcomes: list[Outcome]
    skipped: Counter[str]

    def counts(self) -> dict[str, int]:
        """{"entries", "replayed", "same", "different", "failed", "skipped"} -> count."""
        verdicts = Counter(o.verdict for o in self.outcomes)
        return {"entries": self.entries, "replayed": len(self.outcomes),
                "same": verdicts["same"], "different": verdicts["different"],
                "failed": verdicts["failed"], "skipped": sum(self.skipped.values())}


# ---- reading the dump --------------------------------------------------------------------------

def dump_paths(path: Path) -> list[Path]:
    """The dump files to read: `path` itself, or a folder's `requests-*.jsonl` files (any
    `*.jsonl` when it has none). Raises InvalidParameterError when there is nothing to read."""
    if path.is_dir():
        try:
            files = dump_files(path) or sorted(p for p in path.glob("*.jsonl") if p.is_file())
        except OSError as e:
            raise InvalidParameterError(f"{path}: {e.strerror or e}") from None
        if not files:
            raise InvalidParameterError(f"{path}: no dump files (requests-*.jsonl) in it")
        return files
    if not path.exists():
        raise InvalidParameterError(f"{path}: no such file or folder")
    return [path]


def load_entries(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The dump's entries sorted by seq, and how many lines could not be read (not JSON
    objects, or without an integer `seq`). Raises InvalidParameterError for a dump that
    can't be read or holds no entry."""
    entries: list[dict[str, Any]] = []
    unreadable = 0
    for file in dump_paths(path):
        try:
            for line in read_dump_lines(file):
                seq = line.get("seq") if line is not None else None
                if isinstance(seq, int) and not isinstance(seq, bool):
                    entries.append(line)  # type: ignore[arg-type]
                else:
                    unreadable += 1
        except OSError as e:
            raise InvalidParameterError(f"{file}: {e.strerror or e}") from None
    if not entries:
        raise InvalidParameterError(f"{path}: no dump entries in it")
    entries.sort(key=lambda e: e["seq"])
    return entries, unreadable


# ---- choosing what to replay -------------------------------------------------------------------

def _number(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def is_deterministic(body: dict[str, Any]) -> bool:
    """Whether the request's output is reproducible: greedy (`temperature` 0, or `top_k` 1)
    or seeded (`seed` set). A body without `temperature` samples (OpenAI's default is 1)."""
    return (_number(body.get("temperature")) == 0.0 or _number(body.get("top_k")) == 1.0
            or _number(body.get("seed")) is not None)


def replay_body(body: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """The body to send: a copy with `"stream": false` (and no `stream_options`) and, when
    `model` is given, that model."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    if "stream" in out:
        out["stream"] = False
    if model is not None:
        out["model"] = model
    return out


def plan(entry: dict[str, Any], model: str | None = None) -> Planned | str:
    """The request to replay for one dump entry, or the reason it is skipped (one of the
    SKIP_* strings)."""
    route = str(entry.get("route") or "").split("?", 1)[0].rstrip("/")
    method = str(entry.get("method") or "POST").upper()
    if route not in GENERATION_ROUTES or method != "POST":
        return SKIP_NOT_GENERATION
    if entry.get("redacted"):
        return SKIP_REDACTED
    body = entry.get("body")
    if not isinstance(body, dict):
        return SKIP_NO_BODY
    outcome = entry.get("outcome") if isinstance(entry.get("outcome"), dict) else {}
    status = entry.get("status")
    if (outcome.get("cancelled") or outcome.get("timed_out")
            or status in UNREPRODUCIBLE_STATUSES):
        return SKIP_MOMENT
    if status in KEY_STATUSES:
        return SKIP_KEY
    errored = isinstance(status, int) and status >= 400
    if not errored and not is_deterministic(body):
        return SKIP_SAMPLED
    return Planned(seq=entry["seq"], route=route, body=replay_body(body, model), entry=entry)


# ---- replaying and comparing -------------------------------------------------------------------

def choice_text(choice: dict[str, Any]) -> str | None:
    """A choice's generated text: `text` (completions) or `message.content` (chat)."""
    if "text" in choice:
        return choice["text"]
    message = choice.get("message")
    return message.get("content") if isinstance(message, dict) else None


def compare(entry: dict[str, Any], status: int, answer: Any) -> list[tuple[str, Any, Any]]:
    """The fields where the replayed answer (`status`, parsed JSON body or None) differs from
    the dumped entry: `status`; then, both having succeeded, `texts` (when dumped),
    `finish_reasons` (when dumped) and `completion_tokens` (when dumped)."""
    dumped_status = entry.get("status")
    if isinstance(dumped_status, int) and dumped_status != status:
        return [("status", dumped_status, status)]
    if status >= 400:
        return []
    if not isinstance(answer, dict):
        return [("body", "a JSON object", type(answer).__name__)]
    outcome = entry.get("outcome") if isinstance(entry.get("outcome"), dict) else {}
    raw = answer.get("choices")
    choices = sorted((c for c in raw if isinstance(c, dict)) if isinstance(raw, list) else [],
                     key=lambda c: c.get("index") or 0)
    diffs: list[tuple[str, Any, Any]] = []
    if outcome.get("texts") is not None:
        texts = [choice_text(c) for c in choices]
        if list(outcome["texts"]) != texts:
            diffs.append(("texts", outcome["texts"], texts))
    if outcome.get("finish_reasons"):
        reasons = [c.get("finish_reason") for c in choices]
        if list(outcome["finish_reasons"]) != reasons:
            diffs.append(("finish_reasons", outcome["finish_reasons"], reasons))
    dumped_usage = outcome.get("usage") if isinstance(outcome.get("usage"), dict) else {}
    usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else {}
    if (dumped_usage.get("completion_tokens") is not None
            and dumped_usage["completion_tokens"] != usage.get("completion_tokens")):
        diffs.append(("completion_tokens", dumped_usage["completion_tokens"],
                      usage.get("completion_tokens")))
    return diffs


def replay_one(client: Client, item: Planned) -> Outcome:
    """POSTs one planned request and compares its answer with the dump. Never raises: a
    server that can't be reached or answers something that is not JSON is a "failed"."""
    try:
        answer, status = client.post_json(item.route, item.body), 200
    except APIError as e:
        if e.status is None:
            return Outcome(item.seq, item.route, "failed", error=str(e))
        answer, status = None, e.status
    except UnreachableError as e:
        return Outcome(item.seq, item.route, "failed", error=str(e))
    except ValueError as e:  # the answer was not JSON
        return Outcome(item.seq, item.route, "failed", error=f"answer is not JSON: {e}")
    except Exception as e:  # anything else from the connection: one failed request
        return Outcome(item.seq, item.route, "failed", error=f"{type(e).__name__}: {e}")
    diffs = compare(item.entry, status, answer)
    return Outcome(item.seq, item.route, "different" if diffs else "same", diffs=diffs)


def run_replay(client: Client, entries: list[dict[str, Any]], *, concurrency: int = 1,
               model: str | None = None, unreadable: int = 0,
               progress: Callable[[str, int, int], None] | None = None) -> Report:
    """Replays `entries` (sorted by seq) with up to `concurrency` requests in flight; sends them
    in seq order and reports the outcomes by seq."""
    skipped: Counter[str] = Counter()
    if unreadable:
        skipped[SKIP_UNREADABLE] = unreadable
    todo: list[Planned] = []
    for entry in entries:
        planned = plan(entry, model)
        if isinstance(planned, str):
            skipped[planned] += 1
        else:
            todo.append(planned)
    name = f"replaying {len(todo)} requests"
    done = 0
    outcomes: list[Outcome] = []
    if todo:
        if progress is not None:
            progress(name, 0, len(todo))
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            for outcome in pool.map(lambda item: replay_one(client, item), todo):
                outcomes.append(outcome)
                done += 1
                if progress is not None:
                    progress(name, done, len(todo))
    return Report(entries=len(entries) + unreadable, outcomes=outcomes, skipped=skipped)


# ---- output ------------------------------------------------------------------------------------

def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else repr(value)
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[:width - 1] + "…"


def diff_rows(report: Report) -> list[tuple[str, str, str, str, str]]:
    """(seq, route, field, dumped, replayed) for each differing field and each failure."""
    rows = []
    for o in report.outcomes:
        if o.verdict == "failed":
            rows.append((str(o.seq), o.route, "failed", "", _short(o.error or "")))
        for name, dumped, replayed in o.diffs:
            rows.append((str(o.seq), o.route, name, _short(dumped), _short(replayed)))
    return rows


def skipped_note(report: Report) -> str:
    """`skipped: 2 sampled, 1 redacted` (most first), or "" when nothing was skipped."""
    if not report.skipped:
        return ""
    return "skipped: " + ", ".join(f"{n} {why}" for why, n in report.skipped.most_common())


def render_plain(report: Report, show_diffs: bool = False) -> str:
    """The counts (and with `show_diffs` the differences) as aligned plain text."""
    counts = report.counts()
    widths = [max(len(c), len(str(counts[c]))) for c in COUNT_COLUMNS]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COUNT_COLUMNS, widths, strict=True)),
             "  ".join(str(counts[c]).rjust(w) for c, w in zip(COUNT_COLUMNS, widths,
                                                                strict=True))]
    if note := skipped_note(report):
        lines.append(note)
    rows = diff_rows(report)
    if show_diffs and rows:
        head = ("seq", "route", "field", "dumped", "replayed")
        cols = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        lines.append("")
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, cols, strict=True)).rstrip())
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, cols, strict=True)).rstrip()
                  for r in rows]
    return "\n".join(lines)


def _print_rich(report: Report, title: str, show_diffs: bool) -> None:
    from rich.console import Console
    from rich.table import Table
    console = Console()
    counts = report.counts()
    t = Table(title=title, title_justify="left")
    for c in COUNT_COLUMNS:
        t.add_column(c, justify="right")
    style = {"different": "red", "failed": "red", "same": "green"}
    t.add_row(*(f"[{style[c]}]{counts[c]}[/]" if c in style and counts[c] else str(counts[c])
                for c in COUNT_COLUMNS))
    console.print(t)
    if note := skipped_note(report):
        console.print(note, highlight=False)
    rows = diff_rows(report)
    if show_diffs and rows:
        d = Table(title="differences", title_justify="left")
        for h in ("seq", "route", "field", "dumped", "replayed"):
            d.add_column(h, justify="right" if h == "seq" else "left")
        for r in rows:
            d.add_row(*r)
        console.print(d)


def cmd_replay(args: argparse.Namespace) -> int:
    """Replays the dump; prints the counts (and `--show-diffs` the differences); 0 when every
    replayed request compared equal, 1 when some differ or failed."""
    from serving.progress import StageProgress
    if args.concurrency < 1:
        raise InvalidParameterError("--concurrency must be ≥ 1")
    if args.timeout <= 0:
        raise InvalidParameterError("--timeout must be > 0")
    client = Client(args.url, api_key=args.api_key, timeout=args.timeout)
    entries, unreadable = load_entries(Path(args.dump).expanduser())
    with StageProgress() as progress:
        report = run_replay(client, entries, concurrency=args.concurrency, model=args.model,
                            unreadable=unreadable, progress=progress)
    title = f"replay of {args.dump} against {client.url}"
    if sys.stdout.isatty():
        _print_rich(report, title, args.show_diffs)
    else:
        print(title)
        print(render_plain(report, args.show_diffs))
    counts = report.counts()
    if not counts["replayed"]:
        print("metrale: nothing to replay (every entry was skipped)", file=sys.stderr)
        return 0
    if counts["failed"] == counts["replayed"]:
        first = next(o.error for o in report.outcomes if o.error)
        print(f"metrale: failed: every replayed request failed, e.g. {first}", file=sys.stderr)
        return 1
    if counts["different"] or counts["failed"]:
        if not args.show_diffs:
            print("metrale: some outcomes differ or failed; --show-diffs lists them",
                  file=sys.stderr)
        return 1
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale replay`."""
    p = sub.add_parser(
        "replay", help="replay a request dump against a server and compare the outcomes",
        description="Replay the generation requests of a request dump (a requests-*.jsonl "
                    "file or a folder of them, from `metrale serve --dump-requests DIR`) "
                    "against any OpenAI-compatible server, in seq order, and compare: the "
                    "status, and for greedy or seeded requests the texts (when dumped), "
                    "finish reasons and completion tokens. Streaming requests are sent with "
                    "stream false. Redacted, sampled and non-generation entries are skipped. "
                    "Exit code 0 when all compare equal, 1 when some differ or failed.")
    p.add_argument("dump", metavar="FILE",
                   help="a dump file (requests-N.jsonl) or a folder of them")
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="base URL of the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--model", default=None,
                   help="send every request to this model instead of the dumped one")
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight at once (default 1)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take (default 600)")
    p.add_argument("--show-diffs", action="store_true",
                   help="list each differing or failed seq with the fields that differ")
    p.set_defaults(func=cmd_replay)
