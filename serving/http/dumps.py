"""Request dumps (`--dump-requests DIR`): one JSON line per request, written off the event loop.

`RequestDumper` numbers requests (`next_seq()`, thread-safe, continuing after the largest
number already in the folder) and takes one entry per finished request (`record(seq, entry)`,
which only queues it: a background thread writes the lines). The core API has no Quart in it,
so the HTTP layer calls it from its hooks; `metrale replay` (serving/cli/replay.py) reads the
files back.

Files: `DIR/requests-<first seq>.jsonl`, one JSON object a line, rotated when the next line
would take the file past `max_file_bytes` (the new file is named by the seq of the first line
it holds). Lines are written in the order `record` was called (a request's seq is taken when it
starts and its line written when it ends, so seqs within a file are not sorted; a reader sorts
by `seq`). Each line goes to the file in one `write` of the whole line on an unbuffered file
(repeated only for what a short write left), so a process killed at any moment (SIGKILL, a
crash) leaves whole lines and at most one line cut short at the end of the file: readers
(`read_dump_lines`) skip that one with a warning, and a restarted server starts a new file.
No fsync per line: a killed process loses nothing it wrote (the kernel holds it); only a
machine crash can lose the last lines. A file is fsynced when it is closed (rotation, stop).
Lines still queued for the writer thread when the process is killed are lost.

A line (the entry the HTTP layer passes, with `seq` and `time` put first):

    {
      "seq": 41,                              # from next_seq(); unique across restarts
      "time": "2025-01-31T12:00:00.123Z",     # when record() was called, ISO-8601 UTC
      "request_id": "cmpl-...",               # the id answered to the client (or null)
      "route": "/v1/chat/completions",        # the request's path, without the query
      "method": "POST",
      "tenant": "team-a",                     # the key's tenant, or null; never the key
      "status": 200,                          # the HTTP status answered
      "body": {...},                          # the parsed request JSON (null if none/unparsable)
      "outcome": {
        "finish_reasons": ["stop"],           # one per choice, by choice index ([] on error)
        "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
        "error": null,                        # or {"type": ..., "code": ..., "message": ...}
        "cancelled": false,                   # the client left before the end
        "timed_out": false,                   # the per-request timeout fired
        "texts": ["Hello!"]                   # optional: each choice's generated text, by
                                              # choice index (completions: `text`; chat:
                                              # `message.content`, null when it had none);
                                              # what `metrale replay` compares when present
      },
      "timings": {"queue_s": 0.002, "ttft_s": 0.051, "total_s": 0.240},   # null if unknown
      "redacted": true                        # only with redact=True (see redact_body)
    }

`dump_entry(...)` builds such an entry from keyword arguments. With `redact=True` the writer
thread replaces the prompt-bearing fields of `body` (see `redact_body`) and the output `texts`
by markers that keep only their lengths, and adds `"redacted": true`.

Failures never reach the caller: an `OSError` opening or writing a file (a read-only folder, a
full disk), or creating the folder, logs one error and disables the dumper (`enabled` becomes
False and later `record` calls do nothing). A full queue drops the line, counts it in
`dropped` and logs a warning once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, NotRequired, TypedDict

log = logging.getLogger(__name__)

DEFAULT_MAX_FILE_BYTES = 64 * 1024 * 1024
"""Rotate a dump file before it would pass this size (64 MiB)."""

DEFAULT_MAX_QUEUE = 10_000
"""Lines waiting for the writer thread before `record` starts dropping them."""

FILE_NAME = re.compile(r"^requests-(\d+)\.jsonl$")
"""A dump file's name; group 1 is the seq of its first line."""

_SEQ_AT_LINE_START = re.compile(rb'^\{"seq": ?(\d+)', re.MULTILINE)

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
"""Content part types that carry an image (as serving/http/protocol.py reads them)."""

MEDIA_PART_TYPES = ("input_audio", "audio_url", "file", "video_url")
"""Other non-text content part types: redacted to `"<input_audio>"`, `"<file>"`, ..."""

_KEEP_KEYS = frozenset({"type", "role", "name", "id", "tool_call_id"})
"""Keys of a message, content part or tool call kept as they are by `redact_body`."""

_PROMPT_KEYS = ("prompt", "input", "suffix", "query", "documents", "text_1", "text_2")
"""Top-level body fields that carry prompt text (besides `messages`): a generation's, an
embedding request's inputs, a rerank's query and documents, a score's texts."""


class DumpError(TypedDict):
    """The OpenAI error answered, as in the error body: type, code (or null), message."""

    type: str
    code: str | None
    message: str


class DumpOutcome(TypedDict):
    """What came of a request. `finish_reasons`, `texts` (optional): one per choice, by
    index. `usage`: OpenAI's usage object ({} when there is none)."""

    finish_reasons: list[str | None]
    usage: dict[str, Any]
    error: DumpError | None
    cancelled: bool
    timed_out: bool
    texts: NotRequired[list[str | None] | None]


class DumpTimings(TypedDict):
    """Seconds spent waiting for a slot, to the first token, and in all (null if unknown)."""

    queue_s: float | None
    ttft_s: float | None
    total_s: float | None


class DumpEntry(TypedDict):
    """The entry `RequestDumper.record` takes (the module docstring shows a full line)."""

    request_id: str | None
    route: str
    method: str
    tenant: str | None
    status: int
    body: Any
    outcome: DumpOutcome
    timings: DumpTimings


def dump_entry(*, route: str, method: str = "POST", status: int, body: Any = None,
               tenant: str | None = None, request_id: str | None = None,
               finish_reasons: list[str | None] | None = None,
               usage: Mapping[str, Any] | None = None, error: DumpError | None = None,
               cancelled: bool = False, timed_out: bool = False,
               texts: list[str | None] | None = None, queue_s: float | None = None,
               ttft_s: float | None = None, total_s: float | None = None) -> DumpEntry:
    """One `DumpEntry` from keyword arguments (the schema in the module docstring); `texts`
    goes into `outcome` only when given."""
    outcome: DumpOutcome = {"finish_reasons": list(finish_reasons or []),
                            "usage": dict(usage or {}), "error": error,
                            "cancelled": cancelled, "timed_out": timed_out}
    if texts is not None:
        outcome["texts"] = list(texts)
    return {"request_id": request_id, "route": route, "method": method, "tenant": tenant,
            "status": status, "body": body, "outcome": outcome,
            "timings": {"queue_s": queue_s, "ttft_s": ttft_s, "total_s": total_s}}


# ---- redaction ---------------------------------------------------------------------------------

def redacted_text(text: str) -> str:
    """The marker that replaces a redacted string: `"<redacted N chars>"`."""
    return f"<redacted {len(text)} chars>"


def _is_token_ids(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def _redact_value(value: Any) -> Any:
    """A prompt-bearing value with its text replaced: strings by `<redacted N chars>`, token id
    lists by `<redacted N tokens>`, image parts by `<image>`, other media parts by `<KIND>`;
    dicts keep their `_KEEP_KEYS` (type, role, name, ids) and everything else is redacted."""
    if isinstance(value, str):
        return redacted_text(value)
    if isinstance(value, list):
        if _is_token_ids(value):
            return f"<redacted {len(value)} tokens>"
        return [_redact_value(v) for v in value]
    if isinstance(value, dict):
        kind = value.get("type")
        if kind in IMAGE_PART_TYPES:
            return {"type": kind, kind: "<image>"}
        if kind in MEDIA_PART_TYPES:
            return {"type": kind, kind: f"<{kind.removesuffix('_url')}>"}
        return {k: v if k in _KEEP_KEYS else _redact_value(v) for k, v in value.items()}
    return value  # numbers, booleans, null: no text in them


def redact_body(body: dict[str, Any]) -> dict[str, Any]:
    """A copy of a request body with its prompt-bearing fields replaced (`body` is not changed).

    `messages[*]`: every field but `role`, `name` and `tool_call_id` (so `content`, as a string
    or as parts, `tool_calls[*].function.arguments`, `reasoning_content`): strings and text
    parts become `"<redacted N chars>"`, image parts `{"type": T, T: "<image>"}`, audio, video
    and file parts `{"type": T, T: "<audio>"}` and so on. `prompt`, `input` and `suffix`
    likewise (strings, lists of strings, token ids as `"<redacted N tokens>"`), and the
    pooling routes' `query`, `documents` and `text_1` / `text_2`. Everything else
    (model, sampling parameters, tools, response_format) is kept.
    """
    out = dict(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        out["messages"] = [
            {k: v if k in _KEEP_KEYS else _redact_value(v) for k, v in m.items()}
            if isinstance(m, dict) else _redact_value(m) for m in messages]
    elif messages is not None:
        out["messages"] = _redact_value(messages)
    for key in _PROMPT_KEYS:
        if body.get(key) is not None:
            out[key] = _redact_value(body[key])
    return out


def _redact_line(line: dict[str, Any]) -> None:
    """Redacts a dump line in place (its body and its output texts) and marks it redacted."""
    if isinstance(line.get("body"), dict):
        line["body"] = redact_body(line["body"])
    outcome = line.get("outcome")
    if isinstance(outcome, Mapping) and outcome.get("texts") is not None:
        line["outcome"] = {**outcome, "texts": [t if t is None else _redact_value(t)
                                                for t in outcome["texts"]]}
    line["redacted"] = True


# ---- files -------------------------------------------------------------------------------------

def dump_file_name(first_seq: int) -> str:
    """The name of the dump file whose first line has seq `first_seq`."""
    return f"requests-{first_seq}.jsonl"


def dump_files(folder: Path) -> list[Path]:
    """The dump files of `folder` (regular files named `requests-<seq>.jsonl`), in the order
    they were started (by the seq in their name). Raises OSError if the folder can't be read."""
    found = []
    for path in Path(folder).iterdir():
        match = FILE_NAME.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def last_dumped_seq(folder: Path) -> int:
    """The largest seq of `folder`'s dump files (0 when there are none): the largest of their
    names and of the seqs at the start of their lines. Every file is read (the largest seq can
    be in any of them, as lines are written when requests end), in chunks."""
    best = 0
    for path in dump_files(folder):
        best = max(best, int(FILE_NAME.match(path.name).group(1)))  # type: ignore[union-attr]
        with path.open("rb") as f:
            rest = b""
            while chunk := f.read(8 << 20):
                data = rest + chunk
                cut = data.rfind(b"\n") + 1
                rest = data[cut:]
                best = max([best, *map(int, _SEQ_AT_LINE_START.findall(data, 0, cut))])
            best = max([best, *map(int, _SEQ_AT_LINE_START.findall(rest))])
    return best


def _utc_now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


_STOP = object()


class RequestDumper:
    """Writes one JSON line per request into `folder` from a background thread.

    `RequestDumper(folder, max_file_bytes=64 MiB, redact=False, max_queue=10_000)`:
    `next_seq()` numbers a request, `record(seq, entry)` queues its line and returns at once,
    `flush()` waits for what is queued, `close()` drains and stops. Attributes: `enabled`
    (False once a file error disabled it), `dropped` (lines lost to a full queue or an entry
    that is not JSON), `written` (lines written), `folder`, `redact`, `max_file_bytes`.
    Usable as a context manager (closes on exit). The entry schema is in the module docstring.
    """

    def __init__(self, folder: Path | str, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
                 redact: bool = False, max_queue: int = DEFAULT_MAX_QUEUE):
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes must be ≥ 1, not {max_file_bytes}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be ≥ 1, not {max_queue}")
        self.folder = Path(folder)
        self.max_file_bytes = max_file_bytes
        self.redact = redact
        self.enabled = True
        self.dropped = 0
        self.written = 0
        self._lock = threading.Lock()
        self._seq = 0
        self._closed = False
        self._drop_logged = False
        self._bad_entry_logged = False
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._file: IO[bytes] | None = None
        self._path: Path | None = None
        self._file_bytes = 0
        self._thread = threading.Thread(target=self._run, name="request-dumper", daemon=True)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._seq = last_dumped_seq(self.folder)
        except OSError as e:
            self._disable(f"cannot use the dump folder {self.folder}: {e}")
            return
        self._thread.start()

    # -- the caller's side (any thread, the event loop included) --------------------------------

    def next_seq(self) -> int:
        """The next request number: 1, 2, ... after the largest already in the folder; unique
        and increasing across threads. Numbers are given out even when dumping is disabled
        (they also name requests in headers and logs)."""
        with self._lock:
            self._seq += 1
            return self._seq

    def record(self, seq: int, entry: Mapping[str, Any]) -> None:
        """Queues the line `{"seq": seq, "time": now, **entry}` and returns at once (the entry
        must not be changed afterwards: it is serialized by the writer thread). Does nothing
        once disabled or closed; a full queue drops the line (counted in `dropped`, one
        warning). Never raises."""
        if not self.enabled or self._closed:
            return
        try:
            self._queue.put_nowait((seq, _utc_now(), entry))
        except queue.Full:
            with self._lock:
                self.dropped += 1
                first, self._drop_logged = not self._drop_logged, True
            if first:
                log.warning("request dump queue full (%d lines): dropping lines; the writer "
                            "can't keep up with %s", self._queue.maxsize, self.folder)

    def flush(self, timeout: float | None = 5.0) -> bool:
        """Waits until every line queued before this call is written (or dropped by a disabled
        dumper); False if that took longer than `timeout` seconds."""
        if not self._thread.is_alive():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        return done.wait(left)

    def close(self, timeout: float = 5.0) -> None:
        """Writes what is queued, closes the file and stops the thread (at most `timeout`
        seconds; a writer still busy then is left to finish on its own). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if not self._thread.is_alive():
            return
        deadline = time.monotonic() + timeout
        with contextlib.suppress(queue.Full):  # a writer stuck on a full queue: join times out
            self._queue.put(_STOP, timeout=timeout)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            log.warning("request dump writer still busy after %.1f s; %d lines not written yet",
                        timeout, self._queue.qsize())

    def stats(self) -> dict[str, Any]:
        """A JSON-able snapshot: enabled, folder, current file, written, dropped, queued."""
        return {"enabled": self.enabled, "folder": str(self.folder),
                "file": str(self._path) if self._path else None, "written": self.written,
                "dropped": self.dropped, "queued": self._queue.qsize()}

    def __enter__(self) -> RequestDumper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread ---------------------------------------------------------------------

    def _disable(self, reason: str) -> None:
        with self._lock:
            if not self.enabled:
                return
            self.enabled = False
        log.error("request dumps disabled: %s", reason)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            if isinstance(item, threading.Event):
                item.set()
                continue
            if not self.enabled:
                continue  # disabled: drain without writing
            seq, stamp, entry = item
            try:
                data = self._encode(seq, stamp, entry)
            except Exception as e:  # a value JSON can't hold (e.g. a circular reference)
                with self._lock:
                    self.dropped += 1
                    first, self._bad_entry_logged = not self._bad_entry_logged, True
                if first:
                    log.warning("request dump line %d dropped: %s: %s", seq,
                                type(e).__name__, e)
                continue
            try:
                self._write(seq, data)
                self.written += 1
            except OSError as e:
                self._disable(f"writing {self._path}: {e}")
                self._close_file()
            except Exception as e:  # never let the thread die with lines queued behind it
                self._disable(f"writing {self._path}: {type(e).__name__}: {e}")
                self._close_file()
        self._close_file()

    def _encode(self, seq: int, stamp: str, entry: Mapping[str, Any]) -> bytes:
        line: dict[str, Any] = {"seq": seq, "time": stamp}
        line.update((k, v) for k, v in entry.items() if k not in ("seq", "time"))
        if self.redact:
            _redact_line(line)
        text = json.dumps(line, ensure_ascii=False, separators=(",", ":"), default=str)
        # A lone surrogate (a 400 body's, kept for replay) has no UTF-8: it is written as its
        # JSON escape, which reads back as the same string.
        return text.encode("utf-8", "backslashreplace") + b"\n"

    def _write(self, seq: int, data: bytes) -> None:
        """Writes one line (bytes ending in a newline) and flushes it; rotates first when the
        line would take a non-empty file past `max_file_bytes`."""
        if (self._file is not None and self._file_bytes > 0
                and self._file_bytes + len(data) > self.max_file_bytes):
            self._close_file()
        if self._file is None:
            self._path = self.folder / dump_file_name(seq)
            self._file = self._path.open("ab", buffering=0)
            self._file_bytes = self._file.tell()
        view = memoryview(data)
        while view:  # one write of the whole line; a short write is continued
            view = view[self._file.write(view) or 0:]
        self._file_bytes += len(data)

    def _close_file(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                os.fsync(self._file.fileno())
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
            self._file_bytes = 0


def read_dump_lines(path: Path) -> Iterator[dict[str, Any] | None]:
    """The lines of one dump file, each parsed (None for a line that is not a JSON object, e.g.
    one cut short by a full disk). A last line without its newline (a process killed while
    writing it) is None with a warning. Raises OSError if the file can't be read."""
    with Path(path).open("rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            if not raw.endswith(b"\n"):
                log.warning("%s: its last line is cut short (%d bytes: a process stopped "
                            "while writing it); skipped", path, len(raw))
                yield None
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                yield None
                continue
            yield line if isinstance(line, dict) else None
