"""`metrale replay` against a loopback server of canned OpenAI-shaped answers: what is replayed,
skipped and compared, the counts it prints and its exit codes. (The end-to-end replay against
our own server comes with the dump wiring of the HTTP layer.)"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from serving.cli.replay import Planned, is_deterministic, plan, replay_body
from serving.http.dumps import RequestDumper, dump_entry
from tests.serving.conftest import run_main


@dataclass
class Canned:
    """A loopback server: POSTs answer `answers[key]` = (status, JSON), where key is the
    first message's content or the prompt; every request is kept in `received`."""

    url: str = ""
    answers: dict[str, tuple[int, Any]] = field(default_factory=dict)
    received: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def _key(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][0]["content"])
    return str(body.get("prompt"))


@pytest.fixture
def canned() -> Iterator[Canned]:
    state = Canned()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.received.append({"path": self.path, "body": body,
                                       "auth": self.headers.get("Authorization")})
            status, answer = state.answers.get(
                _key(body), (404, {"error": {"message": "no canned answer", "type": "x"}}))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                              daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def chat_answer(texts: list[str], reasons: list[str] | None = None,
                completion_tokens: int = 3) -> dict[str, Any]:
    reasons = reasons or ["stop"] * len(texts)
    return {"id": "chatcmpl-1", "object": "chat.completion", "model": "m",
            "choices": [{"index": i, "message": {"role": "assistant", "content": t},
                         "finish_reason": r}
                        for i, (t, r) in enumerate(zip(texts, reasons, strict=True))],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion_tokens,
                      "total_tokens": 5 + completion_tokens}}


def completion_answer(text: str, reason: str = "length",
                      completion_tokens: int = 4) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "m",
            "choices": [{"index": 0, "text": text, "finish_reason": reason, "logprobs": None}],
            "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens,
                      "total_tokens": 2 + completion_tokens}}


def chat(content: str, **params: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **params}


def line(seq: int, body: Any, *, route: str = "/v1/chat/completions", status: int = 200,
         texts: list[str] | None = None, reasons: list[str] | None = None,
         completion_tokens: int | None = 3, **extra: Any) -> dict[str, Any]:
    usage = {} if completion_tokens is None else {"completion_tokens": completion_tokens}
    entry = dump_entry(route=route, status=status, body=body, finish_reasons=reasons,
                       usage=usage, texts=texts)
    return {"seq": seq, "time": "2025-01-01T00:00:00.000Z", **entry, **extra}


def write_dump(path: Path, lines: list[Any]) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n"
                            for x in lines))
    return path


def mixed_dump(tmp_path: Path) -> Path:
    """Eight entries, written out of seq order: four replayed, four skipped."""
    return write_dump(tmp_path / "requests-1.jsonl", [
        line(3, {"model": "m", "prompt": "count", "temperature": 0, "max_tokens": 4},
             route="/v1/completions", texts=[" 1 2 3"], reasons=["length"], completion_tokens=4),
        line(1, chat("hi", temperature=0, stream=True, stream_options={"include_usage": True}),
             texts=["Hello!"], reasons=["stop"]),
        line(2, chat("seeded", seed=7, n=2), reasons=["stop", "length"]),  # no texts dumped
        line(4, chat("sampled", temperature=0.8), texts=["whatever"]),
        line(5, chat("bad", temperature=-1), status=400, completion_tokens=None),
        line(6, chat("secret", temperature=0), texts=["x"], redacted=True),
        line(7, None, route="/v1/models", status=200) | {"method": "GET"},
        line(8, chat("slow", temperature=0), status=429, completion_tokens=None),
    ])


def answer_all(canned: Canned) -> None:
    canned.answers.update({
        "hi": (200, chat_answer(["Hello!"])),
        "count": (200, completion_answer(" 1 2 3")),
        "seeded": (200, chat_answer(["a", "b"], ["stop", "length"])),
        "bad": (400, {"error": {"message": "temperature must be ≥ 0", "type": "x"}}),
    })


def counts_of(out: str) -> dict[str, int]:
    """The counts line of the plain table: {"entries": .., "replayed": .., ...}."""
    lines = out.splitlines()
    i = next(i for i, text in enumerate(lines) if text.split()[:2] == ["entries", "replayed"])
    return dict(zip(lines[i].split(), map(int, lines[i + 1].split()), strict=True))


def test_equal_outcomes_exit_0(canned, tmp_path, capsys):
    answer_all(canned)
    code, out, err = run_main(capsys, "replay", str(mixed_dump(tmp_path)), "--url", canned.url,
                              "--api-key", "k1")
    assert code == 0, err
    assert counts_of(out) == {"entries": 8, "replayed": 4, "same": 4, "different": 0,
                              "failed": 0, "skipped": 4}
    assert "skipped:" in out and "1 sampled" in out and "1 redacted" in out
    assert "1 not generation" in out and "1 cancelled / timed out / overloaded" in out
    got = canned.received
    assert [r["path"] for r in got] == ["/v1/chat/completions", "/v1/chat/completions",
                                        "/v1/completions", "/v1/chat/completions"]  # seq order
    assert [_key(r["body"]) for r in got] == ["hi", "seeded", "count", "bad"]
    assert all(r["auth"] == "Bearer k1" for r in got)
    assert got[0]["body"]["stream"] is False and "stream_options" not in got[0]["body"]
    assert got[0]["body"]["messages"] == [{"role": "user", "content": "hi"}]


def test_different_outcomes_exit_1_and_show_diffs(canned, tmp_path, capsys):
    answer_all(canned)
    canned.answers["hi"] = (200, chat_answer(["Hello there!"]))  # another text
    canned.answers["seeded"] = (200, chat_answer(["a", "b"], completion_tokens=9))
    canned.answers["bad"] = (200, chat_answer(["ok"]))  # was a 400
    dump = mixed_dump(tmp_path)
    code, out, err = run_main(capsys, "replay", str(dump), "--url", canned.url)
    assert code == 1
    assert counts_of(out)["same"] == 1 and counts_of(out)["different"] == 3
    assert "--show-diffs" in err and "\n1 " not in out
    code, out, _ = run_main(capsys, "replay", str(dump), "--url", canned.url + "/v1",
                            "--show-diffs", "--concurrency", "3")
    assert code == 1
    diffs = {tuple(text.split()[:3]) for text in out.splitlines()[4:] if text.strip()}
    assert diffs >= {("1", "/v1/chat/completions", "texts"),
                     ("2", "/v1/chat/completions", "finish_reasons"),
                     ("2", "/v1/chat/completions", "completion_tokens"),
                     ("5", "/v1/chat/completions", "status")}
    assert not any(d[0] == "3" for d in diffs)  # the completion still compares equal
    assert "'Hello!'" in out and "'Hello there!'" in out


def test_a_folder_written_by_the_dumper_is_read_in_seq_order(canned, tmp_path, capsys):
    folder = tmp_path / "dumps"
    with RequestDumper(folder, max_file_bytes=400) as dumper:
        seqs = [dumper.next_seq() for _ in range(6)]
        for seq in reversed(seqs):  # requests end in another order than they started
            dumper.record(seq, dump_entry(route="/v1/chat/completions", status=200,
                                          body=chat(f"q{seq}", temperature=0),
                                          finish_reasons=["stop"], texts=[f"a{seq}"]))
    assert len(list(folder.iterdir())) > 1
    (folder / "notes.txt").write_text("not a dump")
    for seq in seqs:
        canned.answers[f"q{seq}"] = (200, chat_answer([f"a{seq}"]))
    code, out, err = run_main(capsys, "replay", str(folder), "--url", canned.url,
                              "--model", "other")
    assert code == 0, err
    assert counts_of(out)["same"] == 6
    assert [_key(r["body"]) for r in canned.received] == [f"q{s}" for s in seqs]
    assert {r["body"]["model"] for r in canned.received} == {"other"}


def test_a_redacting_dumper_s_lines_are_all_skipped(canned, tmp_path, capsys):
    with RequestDumper(tmp_path, redact=True) as dumper:
        dumper.record(dumper.next_seq(), dump_entry(route="/v1/completions", status=200,
                                                    body={"prompt": "p", "temperature": 0}))
    code, out, err = run_main(capsys, "replay", str(tmp_path), "--url", canned.url)
    assert code == 0 and "nothing to replay" in err
    assert counts_of(out) == {"entries": 1, "replayed": 0, "same": 0, "different": 0,
                              "failed": 0, "skipped": 1}
    assert canned.received == []


def test_unreadable_lines_are_counted_and_skipped(canned, tmp_path, capsys):
    answer_all(canned)
    dump = write_dump(tmp_path / "d.jsonl", [
        "{not json", '{"no": "seq"}', "[1, 2]",
        line(1, chat("hi", temperature=0), texts=["Hello!"], reasons=["stop"])])
    code, out, _ = run_main(capsys, "replay", str(dump), "--url", canned.url)
    assert code == 0
    assert counts_of(out) == {"entries": 4, "replayed": 1, "same": 1, "different": 0,
                              "failed": 0, "skipped": 3}
    assert "3 unreadable line" in out


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_server_fails_every_request_exit_1(tmp_path, capsys):
    dump = mixed_dump(tmp_path)
    code, out, err = run_main(capsys, "replay", str(dump), "--url",
                              f"http://127.0.0.1:{_closed_port()}", "--timeout", "10")
    assert code == 1
    assert counts_of(out)["failed"] == 4
    assert "metrale: failed: every replayed request failed" in err and "Traceback" not in err


@pytest.mark.parametrize("make_args, needle", [
    (lambda d, u: [str(d / "missing.jsonl"), "--url", u], "no such file or folder"),
    (lambda d, u: [str(d / "empty"), "--url", u], "no dump files"),
    (lambda d, u: [str(d / "junk.jsonl"), "--url", u], "no dump entries"),
    (lambda d, u: [str(d / "requests-1.jsonl"), "--url", "ftp://127.0.0.1:1"], "--url"),
    (lambda d, u: [str(d / "requests-1.jsonl"), "--url", u, "--concurrency", "0"],
     "--concurrency"),
])
def test_bad_input_exits_2_with_one_line(make_args, needle, canned, tmp_path, capsys):
    mixed_dump(tmp_path)
    (tmp_path / "empty").mkdir()
    write_dump(tmp_path / "junk.jsonl", ["nope", "{}"])
    code, _, err = run_main(capsys, "replay", *make_args(tmp_path, canned.url))
    assert code == 2
    assert err.startswith("metrale: error:") and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert canned.received == []


def test_help_documents_every_flag(capsys):
    code, out, _ = run_main(capsys, "replay", "--help")
    assert code == 0 and out.startswith("usage: metrale replay")
    for flag in ("--url", "--api-key", "--model", "--concurrency", "--timeout", "--show-diffs"):
        assert flag in out


def test_what_is_replayed():
    assert is_deterministic({"temperature": 0}) and is_deterministic({"temperature": 0.0})
    assert is_deterministic({"seed": 0, "temperature": 1}) and is_deterministic({"top_k": 1})
    assert not is_deterministic({}) and not is_deterministic({"temperature": 0.5})
    assert not is_deterministic({"temperature": False}) and not is_deterministic({"seed": None})
    assert replay_body({"stream": True, "stream_options": {}, "model": "a"}, "b") == {
        "stream": False, "model": "b"}
    assert plan(line(1, chat("x", temperature=0), route="/v1/chat/completions/")).route == (
        "/v1/chat/completions")
    assert plan(line(1, chat("x", temperature=0), status=504)) == (
        "cancelled / timed out / overloaded")
    cancelled = line(1, chat("x", temperature=0))
    cancelled["outcome"]["cancelled"] = True
    assert plan(cancelled) == "cancelled / timed out / overloaded"
    assert plan(line(1, "not a dict")) == "no body"
    for status in (401, 403):  # the replay's own key answers these, not the request
        assert plan(line(1, chat("x", temperature=0), status=status)) == "refused the key"
    assert isinstance(plan(line(1, chat("x", temperature=0), status=400)), Planned)
