"""serving/http/dumps.py: request numbering, the writer thread, rotation, redaction and the
failure modes (unwritable folder, full disk, full queue). Pure Python, no server."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from serving.http.dumps import (
    RequestDumper,
    dump_entry,
    dump_files,
    last_dumped_seq,
    read_dump_lines,
    redact_body,
)

LOGGER = "serving.http.dumps"


def lines_of(folder: Path) -> list[dict]:
    """Every dump line of `folder`, file by file in the order the files were started."""
    return [line for path in dump_files(folder) for line in read_dump_lines(path)]


def entry(**kw) -> dict:
    body = kw.pop("body", {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    return dump_entry(route="/v1/chat/completions", status=200, body=body,
                      finish_reasons=["stop"], usage={"completion_tokens": 2}, **kw)


def test_sequence_numbers_are_unique_and_increasing_across_threads(tmp_path):
    with RequestDumper(tmp_path) as dumper:
        got: list[list[int]] = [[] for _ in range(8)]
        start = threading.Barrier(8)

        def take(mine: list[int]) -> None:
            start.wait()
            mine.extend(dumper.next_seq() for _ in range(500))

        threads = [threading.Thread(target=take, args=(mine,)) for mine in got]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for mine in got:
        assert mine == sorted(mine) and len(set(mine)) == 500  # increasing within a thread
    assert sorted(n for mine in got for n in mine) == list(range(1, 4001))


def test_a_line_has_seq_time_and_the_entry(tmp_path):
    with RequestDumper(tmp_path) as dumper:
        seq = dumper.next_seq()
        dumper.record(seq, entry(tenant="a", request_id="r1", texts=["ok"], ttft_s=0.5))
        assert dumper.flush()
    [line] = lines_of(tmp_path)
    assert list(line)[:2] == ["seq", "time"] and line["seq"] == 1
    assert line["time"].endswith("Z") and "T" in line["time"]
    assert line["route"] == "/v1/chat/completions" and line["method"] == "POST"
    assert line["tenant"] == "a" and line["request_id"] == "r1" and line["status"] == 200
    assert line["outcome"] == {"finish_reasons": ["stop"], "usage": {"completion_tokens": 2},
                               "error": None, "cancelled": False, "timed_out": False,
                               "texts": ["ok"]}
    assert line["timings"] == {"queue_s": None, "ttft_s": 0.5, "total_s": None}
    assert "redacted" not in line
    assert [p.name for p in dump_files(tmp_path)] == ["requests-1.jsonl"]


def test_numbering_continues_after_a_restart(tmp_path):
    with RequestDumper(tmp_path, max_file_bytes=300) as first:
        seqs = [first.next_seq() for _ in range(6)]
        for seq in reversed(seqs):  # lines land out of seq order, as requests end
            first.record(seq, entry())
    assert len(dump_files(tmp_path)) > 1
    assert last_dumped_seq(tmp_path) == 6
    with RequestDumper(tmp_path) as second:
        assert second.next_seq() == 7
    # a number taken but never recorded is not seen; one in a file's name or a line is
    (tmp_path / "requests-40.jsonl").write_text('{"seq":40}\n{"seq":52,"time":"x"}\n{"se')
    with RequestDumper(tmp_path) as third:
        assert third.next_seq() == 53


def test_rotation_by_size_keeps_every_line_once_in_order(tmp_path):
    limit = 1000
    with RequestDumper(tmp_path, max_file_bytes=limit) as dumper:
        seqs = [dumper.next_seq() for _ in range(60)]
        for seq in seqs:
            dumper.record(seq, entry(request_id=f"r{seq}"))
    files = dump_files(tmp_path)
    assert len(files) >= 5
    for path in files:
        assert path.stat().st_size <= limit
        first = json.loads(path.read_text().splitlines()[0])["seq"]
        assert path.name == f"requests-{first}.jsonl"  # named by the first seq it holds
        assert path.read_bytes().endswith(b"\n")
    assert [line["seq"] for line in lines_of(tmp_path)] == seqs


def test_a_line_larger_than_the_limit_gets_a_file_of_its_own(tmp_path):
    with RequestDumper(tmp_path, max_file_bytes=200) as dumper:
        for text in ("a", "b" * 1000, "c"):
            dumper.record(dumper.next_seq(), entry(texts=[text]))
    assert [p.name for p in dump_files(tmp_path)] == [
        "requests-1.jsonl", "requests-2.jsonl", "requests-3.jsonl"]
    assert [line["outcome"]["texts"] for line in lines_of(tmp_path)] == [["a"], ["b" * 1000],
                                                                        ["c"]]


def test_redact_body_keeps_parameters_and_replaces_prompts():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {
        "model": "m", "temperature": 0, "seed": 3, "max_tokens": 8,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "messages": [
            {"role": "system", "content": "secret"},
            {"role": "user", "content": [{"type": "text", "text": "look at"}, image,
                                         {"type": "input_audio", "input_audio": {"data": "x"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": '{"q": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"},
        ]}
    original = json.loads(json.dumps(body))
    out = redact_body(body)
    assert body == original  # not changed in place
    assert {k: out[k] for k in ("model", "temperature", "seed", "max_tokens", "tools")} == {
        k: body[k] for k in ("model", "temperature", "seed", "max_tokens", "tools")}
    system, user, assistant, tool = out["messages"]
    assert system == {"role": "system", "content": "<redacted 6 chars>"}
    assert user["content"] == [{"type": "text", "text": "<redacted 7 chars>"},
                               {"type": "image_url", "image_url": "<image>"},
                               {"type": "input_audio", "input_audio": "<input_audio>"}]
    assert assistant["content"] is None
    assert assistant["tool_calls"] == [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "<redacted 8 chars>"}}]
    assert tool == {"role": "tool", "tool_call_id": "c1", "content": "<redacted 2 chars>"}
    assert redact_body({"prompt": "abc", "n": 2}) == {"prompt": "<redacted 3 chars>", "n": 2}
    assert redact_body({"prompt": ["ab", [1, 2, 3]]})["prompt"] == [
        "<redacted 2 chars>", "<redacted 3 tokens>"]
    assert redact_body({"input": ["hello"]})["input"] == ["<redacted 5 chars>"]
    assert "hello" not in json.dumps(redact_body({"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "hello"}]}]}))
    rerank = redact_body({"query": "cat", "documents": ["a cat", {"text": "dogs"}], "top_n": 1})
    assert rerank == {"query": "<redacted 3 chars>", "top_n": 1,
                      "documents": ["<redacted 5 chars>", {"text": "<redacted 4 chars>"}]}
    assert redact_body({"text_1": "ab", "text_2": ["abc"]}) == {
        "text_1": "<redacted 2 chars>", "text_2": ["<redacted 3 chars>"]}


def test_a_redacting_dumper_redacts_body_and_texts(tmp_path):
    with RequestDumper(tmp_path, redact=True) as dumper:
        dumper.record(dumper.next_seq(), entry(texts=["the answer", None]))
    [line] = lines_of(tmp_path)
    assert line["redacted"] is True
    assert line["body"] == {"model": "m",
                            "messages": [{"role": "user", "content": "<redacted 2 chars>"}]}
    assert line["outcome"]["texts"] == ["<redacted 10 chars>", None]
    assert line["outcome"]["usage"] == {"completion_tokens": 2}


def _assert_disabled_once(dumper: RequestDumper, caplog) -> None:
    for _ in range(3):
        dumper.record(dumper.next_seq(), entry())  # never raises
    assert dumper.flush()
    assert not dumper.enabled
    errors = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "request dumps disabled" in errors[0].getMessage()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through chmod 0o500")
def test_a_read_only_folder_disables_dumping_with_one_error(tmp_path, caplog):
    folder = tmp_path / "dumps"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with RequestDumper(folder) as dumper:
            assert dumper.enabled  # found out at the first write
            _assert_disabled_once(dumper, caplog)
    finally:
        folder.chmod(0o700)
    assert list(folder.iterdir()) == []


def test_a_folder_that_cannot_be_created_starts_disabled(tmp_path, caplog):
    (tmp_path / "file").write_text("not a folder")
    dumper = RequestDumper(tmp_path / "file" / "sub")  # NotADirectoryError, an OSError
    assert not dumper.enabled
    assert dumper.next_seq() == 1  # numbers still given out
    _assert_disabled_once(dumper, caplog)
    dumper.close()
    dumper.close()


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_disables_dumping_with_one_error(tmp_path, caplog):
    (tmp_path / "requests-1.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    with RequestDumper(tmp_path) as dumper:
        assert dumper.enabled
        _assert_disabled_once(dumper, caplog)
        assert dumper.written == 0


class _StalledDumper(RequestDumper):
    """A dumper whose writer thread holds its first line until `release` is set."""

    def __init__(self, *args, **kw):
        self.writing = threading.Event()
        self.release = threading.Event()
        super().__init__(*args, **kw)

    def _write(self, seq: int, data: bytes) -> None:
        self.writing.set()
        assert self.release.wait(30)
        super()._write(seq, data)


def test_a_full_queue_drops_lines_without_blocking(tmp_path, caplog):
    dumper = _StalledDumper(tmp_path, max_queue=2)
    try:
        dumper.record(1, entry())
        assert dumper.writing.wait(30)  # the writer holds line 1; the queue is empty
        for seq in range(2, 7):
            dumper.record(seq, entry())  # 2 and 3 queued, 4 to 6 dropped, none waits
        assert dumper.dropped == 3
        warnings = [r for r in caplog.records if r.name == LOGGER
                    and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "queue full" in warnings[0].getMessage()
    finally:
        dumper.release.set()
        dumper.close()
    assert [line["seq"] for line in lines_of(tmp_path)] == [1, 2, 3]
    assert dumper.enabled and dumper.written == 3


def test_close_is_idempotent_and_later_records_are_ignored(tmp_path):
    dumper = RequestDumper(tmp_path)
    dumper.record(dumper.next_seq(), entry())
    dumper.close()
    dumper.close()
    dumper.record(dumper.next_seq(), entry())
    assert dumper.flush()
    assert [line["seq"] for line in lines_of(tmp_path)] == [1]
    assert dumper.stats()["written"] == 1


def test_an_entry_json_cannot_hold_is_dropped_and_others_written(tmp_path, caplog):
    loop: dict = {}
    loop["self"] = loop
    with RequestDumper(tmp_path) as dumper:
        dumper.record(1, entry(body=loop))
        dumper.record(2, entry(body={"model": "m", "when": object()}))  # str() of it is kept
    assert [line["seq"] for line in lines_of(tmp_path)] == [2]
    assert dumper.dropped == 1 and dumper.enabled


def test_a_lone_surrogate_is_dumped_as_its_json_escape(tmp_path):
    """A refused body with a lone surrogate (no UTF-8 for it) is written as the JSON escape,
    which reads back as the same string; the dumper stays enabled."""
    with RequestDumper(tmp_path) as dumper:
        for text in ("a\ud800b", "after"):
            dumper.record(dumper.next_seq(), entry(texts=[text]))
        assert dumper.flush()
    first, second = lines_of(tmp_path)
    assert first["outcome"]["texts"] == ["a\ud800b"]
    assert second["outcome"]["texts"] == ["after"]


def test_a_torn_last_line_is_skipped_with_a_warning_and_a_restart_goes_on(tmp_path, caplog):
    from serving.cli.replay import load_entries
    with RequestDumper(tmp_path) as first:
        for _ in range(3):
            first.record(first.next_seq(), entry())
    (path,) = dump_files(tmp_path)
    whole = path.read_bytes()
    line = whole.splitlines(keepends=True)[-1]
    path.write_bytes(whole + line.replace(b'"seq":3', b'"seq":4')[: len(line) // 2])  # killed
    with caplog.at_level(logging.WARNING, LOGGER):
        got = list(read_dump_lines(path))
    assert [g["seq"] if g else None for g in got] == [1, 2, 3, None]
    assert "cut short" in caplog.text and path.name in caplog.text
    with RequestDumper(tmp_path) as second:  # the restarted server: numbers go on, new file
        seq = second.next_seq()
        second.record(seq, entry())
    assert seq == 5 and len(dump_files(tmp_path)) == 2
    entries, unreadable = load_entries(tmp_path)  # what `metrale replay` reads
    assert [e["seq"] for e in entries] == [1, 2, 3, 5] and unreadable == 1
