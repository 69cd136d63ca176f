"""The usage log (`--usage-log FILE`): per-tenant usage that outlives the server process.

Without it, `GET /v1/metrale/usage` and the tenant counters start from zero at every start, and
a server killed (`kill -9`, an out-of-memory kill, a `--exit-on-stall` restart) loses the usage
of its retention window. With it, `UsageBook.record` appends one JSON line per finished
request, `{"t": unix seconds, "tenant": name or null, "requests": 1, "prompt_tokens": ...,
"cached_tokens": ..., "completion_tokens": ..., "rejected_requests": ..., "error_requests":
...}` (the `Tally` fields), and the next start reads the file back into the book.

- Each line goes out in one `os.write` on a file opened with `O_APPEND`: a killed process
  leaves every line it wrote whole, except at most the last one being written; no `fsync`
  per line (only a machine crash loses what the page cache held).
- Reading skips a line that does not parse (a torn last line, a disk that filled) with one
  warning naming the file and the count; it never stops the server.
- At start the file is compacted: lines older than the retention are dropped and the rest are
  summed per tenant and minute (one line each, `t` the minute's start), written to a
  temporary file and renamed into place, so the file holds at most one line per tenant and
  minute of the retention plus the requests since the last start.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class UsageLog:
    """An append-only JSON-lines file of usage records (see the module docstring).

    path: the file (created with its folder when missing). Thread-safe: `append` is one
    `os.write` per record.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._lock = threading.Lock()

    def read(self) -> Iterator[dict[str, Any]]:
        """The records in the file, oldest first; lines that do not parse as a JSON object
        with a numeric `t` are skipped (one warning with their count)."""
        try:
            text = self.path.read_bytes().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return
        bad = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                bad += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("t"), int | float):
                bad += 1
                continue
            yield record
        if bad:
            log.warning("%s: skipped %d unreadable usage line(s) (a write cut short by a "
                        "killed process)", self.path, bad)

    def rewrite(self, records: list[dict[str, Any]]) -> None:
        """Replaces the file's content with `records` (a temporary file renamed into place:
        a kill leaves the old file or the new one, whole)."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                for record in records:
                    f.write(json.dumps(record, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        """Appends one record as one line, in one write. An OSError (a full disk) is logged,
        never raised: usage accounting must not fail a request."""
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        try:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                os.write(self._fd, data)
        except OSError as e:
            log.error("%s: could not write a usage record: %s", self.path, e)

    def close(self) -> None:
        """Closes the file (it is reopened by the next `append`)."""
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
                os.close(self._fd)
                self._fd = None
