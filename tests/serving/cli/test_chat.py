"""`metrale chat`: the session's commands and Ctrl-C (in process, with a scripted backend),
and the command itself as a subprocess against the shared server, against a stub server that
keeps an answer open until the client leaves (a real SIGINT), and with an in-process model."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serving.cli.chat import ChatSession, run_session
from serving.cli.http_client import APIError
from tests.serving.conftest import MODEL, ROOT, run_main


class Scripted:
    """A backend that replays answers: a str is streamed word by word, an exception raised
    after the first word. Records what each turn was sent and whether its stream was closed."""

    name = "scripted"

    def __init__(self, *answers):
        self.answers = list(answers)
        self.sent: list[list[dict]] = []
        self.closed: list[bool] = []

    def stream(self, messages, temperature, max_tokens, seed):
        self.sent.append([dict(m) for m in messages])
        answer = self.answers.pop(0)
        turn = len(self.closed)
        self.closed.append(False)
        try:
            if isinstance(answer, BaseException):
                yield "partial "
                raise answer
            for word in answer.split(" "):
                yield word + " "
        finally:
            self.closed[turn] = True


def session(backend, **kw) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    return ChatSession(backend, out, err, **kw), out, err


def test_turns_carry_the_history_and_the_system_prompt():
    backend = Scripted("hi there", "fine thanks")
    s, out, _ = session(backend, system="be nice")
    s.handle("hello")
    s.handle("how are you?")
    assert out.getvalue() == "hi there \nfine thanks \n"
    assert backend.sent[1] == [{"role": "system", "content": "be nice"},
                               {"role": "user", "content": "hello"},
                               {"role": "assistant", "content": "hi there "},
                               {"role": "user", "content": "how are you?"}]


def test_ctrl_c_stops_the_answer_and_keeps_the_session():
    backend = Scripted(KeyboardInterrupt(), "second answer")
    s, out, err = session(backend)
    s.handle("first")
    assert backend.closed == [True]
    assert "[stopped]" in err.getvalue()
    assert s.history == [{"role": "user", "content": "first"},
                         {"role": "assistant", "content": "partial "}]
    s.handle("again")
    assert out.getvalue().endswith("second answer \n")
    assert len(s.history) == 4


def test_a_failed_turn_is_reported_and_left_out():
    backend = Scripted(APIError(400, "too long"), "ok")
    s, _, err = session(backend)
    s.handle("first")
    assert "error: too long" in err.getvalue()
    assert s.history == [] and s.failures == 1
    s.handle("second")
    assert backend.sent[1] == [{"role": "user", "content": "second"}]


@pytest.mark.parametrize("line, note, temperature", [
    ("/temp 0.2", "temperature 0.2", 0.2),
    ("/temp", "temperature 0.7", 0.7),
    ("/temp hot", "/temp needs a number from 0 to 2, not 'hot'", 0.7),
    ("/temp 3", "/temp needs a number from 0 to 2, not 3", 0.7),
    ("/temp -1", "/temp needs a number from 0 to 2, not -1", 0.7),
    ("/frobnicate", "unknown command /frobnicate; /help lists the commands", 0.7),
    ("/save", "/save needs a file name: /save FILE", 0.7),
    ("/save /no/such/dir/x.json", "cannot write /no/such/dir/x.json", 0.7),
])
def test_commands_answer_and_never_raise(line, note, temperature):
    s, out, err = session(Scripted())
    assert s.handle(line) is True
    assert note in err.getvalue()
    assert s.temperature == temperature and out.getvalue() == ""


def test_system_reset_save_and_exit(tmp_path):
    backend = Scripted("one", "two")
    s, _, _ = session(backend)
    s.handle("/system You are terse.")
    s.handle("a")
    s.handle("//slash")  # a message that starts with '/'
    s.handle(f"/save {tmp_path / 'c.json'}")
    saved = json.loads((tmp_path / "c.json").read_text())
    assert [m["role"] for m in saved["messages"]] == ["system", "user", "assistant", "user",
                                                      "assistant"]
    assert saved["messages"][3]["content"] == "/slash"
    s.handle("/reset")
    assert s.history == [] and s.system == "You are terse."
    s.handle("/system")
    assert s.system is None
    assert s.handle("/exit") is False


def test_piped_input_ends_at_eof_and_fails_on_a_failed_turn():
    s, out, _ = session(Scripted("fine", APIError(500, "boom")))
    assert run_session(s, io.StringIO("hello\n\n/temp 1\n"), interactive=False) == 0
    assert out.getvalue() == "fine \n" and s.temperature == 1.0
    assert run_session(s, io.StringIO("again\n"), interactive=False) == 1


# ---- the command ---------------------------------------------------------------------------
def chat(*args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serving.cli", "chat", *args], input=stdin,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


def test_scripted_chat_against_the_server(base_url, tmp_path):
    saved, cleared = tmp_path / "chat.json", tmp_path / "cleared.json"
    script = (f"Hello there\n/temp 0\n/temp 9\n/system Be brief.\n/nope\nAnd again\n"
              f"/save {saved}\n/reset\n/save {cleared}\n/exit\nnever sent\n")
    r = chat("--url", base_url, "--max-tokens", "6", "--temperature", "0.5", stdin=script)
    assert r.returncode == 0, r.stderr
    assert "unknown command /nope" in r.stderr and "not 9" in r.stderr
    conversation = json.loads(saved.read_text())
    assert conversation["temperature"] == 0.0 and conversation["system"] == "Be brief."
    assert conversation["backend"] == f"{MODEL} at {base_url}"
    roles = [m["role"] for m in conversation["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert json.loads(cleared.read_text())["messages"] == [
        {"role": "system", "content": "Be brief."}]
    assert r.stdout.endswith("\n")


class _HoldingHandler(BaseHTTPRequestHandler):
    """A stub OpenAI server: the first chat answer streams "hello" and stays open until the
    client leaves; later answers stream "world" and end."""

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        data = json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        def send(text: str) -> None:
            chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        if len(self.server.bodies) == 1:
            send("hello")
            self.connection.settimeout(60)
            with contextlib.suppress(OSError):
                self.rfile.read(1)  # returns once the client closes its end
            self.server.left.set()
        else:
            send("world")
            self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def holding_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _HoldingHandler)
    srv.bodies, srv.left = [], threading.Event()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_sigint_stops_the_answer_and_the_session_goes_on(holding_server, tmp_path):
    url = f"http://127.0.0.1:{holding_server.server_address[1]}"
    saved = tmp_path / "c.json"
    # started with SIGINT ignored (kept across exec), as a shell script's background job or a
    # CI runner starts it: the chat must still stop its answer on Ctrl-C
    chat_cmd = [sys.executable, "-m", "serving.cli", "chat", "--url", url]
    ignoring = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                "os.execv(sys.argv[1], sys.argv[1:])")
    proc = subprocess.Popen([sys.executable, "-c", ignoring, *chat_cmd],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        proc.stdin.write(f"first\nsecond\n/save {saved}\n".encode())
        proc.stdin.flush()
        assert proc.stdout.read(5) == b"hello"  # the first answer is streaming
        proc.send_signal(signal.SIGINT)
        assert holding_server.left.wait(30), "the client did not close the connection"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == b"\nworld\n" and b"[stopped]" in err
    assert holding_server.bodies[1]["messages"] == [
        {"role": "user", "content": "first"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "second"}]
    assert holding_server.bodies[1]["stream"] is True
    assert len(json.loads(saved.read_text())["messages"]) == 4


def test_chat_in_process_with_progress(tiny_model):
    r = chat("--model", str(tiny_model), "--max-len", "64", "--max-tokens", "4",
             "--temperature", "0", stdin="quick brown fox\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")
    assert "metrale: loading weights ..." in r.stderr
    assert "metrale: starting the engine: done in" in r.stderr


@pytest.mark.parametrize("args, code, needle", [
    (["--url", "http://127.0.0.1:9", "--model", "default"], 2, "not both"),
    (["--temperature", "5", "--url", "http://127.0.0.1:9"], 2, "--temperature"),
    (["--url", "http://127.0.0.1:9"], 1, "cannot reach http://127.0.0.1:9"),
    (["--url", "127.0.0.1:9"], 2, "give http://HOST:PORT"),
])
def test_exit_codes(args, code, needle, capsys):
    got, _, err = run_main(capsys, "chat", *args)
    assert got == code and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
