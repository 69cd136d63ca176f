"""The usage log (`--usage-log`, serving/http/usage_log.py): a new `UsageBook` reads back what
the last one recorded within the retention, skips a line cut short by a kill, and compacts
the file to one line per tenant and minute."""

from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry

from serving.http.usage import UsageBook
from serving.http.usage_log import UsageLog

DAY = 86400.0
USAGE = {"prompt_tokens": 5, "completion_tokens": 3,
         "prompt_tokens_details": {"cached_tokens": 2}}


class Clock:
    """A settable Unix clock."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def _book(path, clock) -> UsageBook:
    return UsageBook(CollectorRegistry(), retention=DAY, clock=clock, usage_log=UsageLog(path))


def test_a_new_book_reads_back_the_usage_within_the_retention(tmp_path):
    path, clock = tmp_path / "usage.jsonl", Clock(1_000_000.0)
    book = _book(path, clock)
    book.record("acme", USAGE, 200)
    clock.now += 30
    book.record("acme", USAGE, 200)
    book.record(None, USAGE, 429, rejected_by="requests")
    clock.now += 2 * DAY  # past the retention: the first three are dropped ...
    book.record("acme", USAGE, 200)
    book.usage_log.close()
    clock.now += 60
    again = _book(path, clock)  # ... the last one is read back
    totals = again.query(["acme", "anonymous"])
    assert totals["acme"].as_dict() == {"requests": 1, "prompt_tokens": 5, "cached_tokens": 2,
                                        "completion_tokens": 3, "rejected_requests": 0,
                                        "error_requests": 0, "total_tokens": 8}
    assert totals["anonymous"].requests == 0
    assert again.started <= clock.now - 60
    assert again.query(["acme"], since=clock.now - 120)["acme"].requests == 1


def test_a_torn_last_line_is_skipped_and_the_file_compacted(tmp_path, caplog):
    path, clock = tmp_path / "usage.jsonl", Clock(2_000_000.0)
    book = _book(path, clock)
    for _ in range(3):
        book.record("acme", USAGE, 200)
    book.record("beta", USAGE, 500)
    book.usage_log.close()
    with open(path, "ab") as f:
        f.write(b'{"t": 2000000.5, "tenant": "acme", "requ')  # a write cut by a kill
    with caplog.at_level(logging.WARNING, logger="serving.http.usage_log"):
        again = _book(path, clock)
    assert "skipped 1 unreadable usage line" in caplog.text
    totals = again.query(["acme", "beta"])
    assert totals["acme"].requests == 3 and totals["acme"].completion_tokens == 9
    assert totals["beta"].error_requests == 1
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert sorted(x["tenant"] for x in lines) == ["acme", "beta"]  # one per tenant and minute
    again.record("acme", USAGE, 200)  # appends after the compacted lines
    again.usage_log.close()
    assert _book(path, clock).query(["acme"])["acme"].requests == 4
