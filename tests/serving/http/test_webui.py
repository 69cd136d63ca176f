"""The web chat page (serving/http/routes/webui.py, serving/http/webui/) in headless Chromium.

Playwright drives Debian's chromium against the shared tiny server (its weights are random, so
its text is noise: the tests check structure, not words): the page loads and lists the models,
streams an answer with its speed, stops a long answer (the server frees the slot), asks for a
key on a keyed server, and `--no-webui` takes `GET /` away. Without chromium or playwright the
browser tests are skipped, saying loudly that the page was NOT tested.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.serving.conftest import MODEL, get_json, post, wait_healthy
from tests.step_gate import gated

CHROMIUM = Path("/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000  # the first answer of a session may wait for compiles


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for the module (skipped, loudly, when it cannot run)."""
    if not CHROMIUM.exists() and shutil.which("chromium") is None:
        pytest.skip(f"{CHROMIUM} is missing: the web chat page was NOT tested")
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        pytest.skip("the playwright package is missing: the web chat page was NOT tested")
    expect.set_options(timeout=TIMEOUT_MS)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser):
    """A page in a fresh context (its own localStorage)."""
    context = browser.new_context()
    context.set_default_timeout(TIMEOUT_MS)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, f"the page's scripts failed: {errors}"


def _expect():
    from playwright.sync_api import expect
    return expect


def _send(page, text: str, max_tokens: int | None, extra: dict | None = None) -> None:
    """Fills the settings (max tokens None: left empty) and the message, then presses
    Enter."""
    if not page.locator("details.settings").evaluate("d => d.open"):
        page.locator("summary", has_text="Settings").click()
    page.get_by_label("Max tokens").fill("" if max_tokens is None else str(max_tokens))
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Extra request parameters (JSON)").fill(json.dumps(extra or {}))
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def _poll_stats(url: str, done, what: str, timeout: float = 30.0) -> dict:
    """GETs /v1/metrale/stats until `done(stats)`, with a deadline."""
    deadline = time.monotonic() + timeout
    while True:
        stats = get_json(url, "/v1/metrale/stats")
        if done(stats):
            return stats
        assert time.monotonic() < deadline, f"{what} not seen in {timeout} s: {stats}"
        time.sleep(0.05)


def test_the_page_lists_the_models_and_streams_an_answer(page, base_url, tmp_path):
    expect = _expect()
    page.goto(base_url + "/")
    expect(page).to_have_title("Metrale chat")
    ids = [m["id"] for m in get_json(base_url, "/v1/models")["data"]]
    expect(page.locator("#model option")).to_have_count(len(ids))
    expect(page.get_by_label("Model")).to_have_value(MODEL)
    expect(page.locator("#image-picker")).to_be_hidden()  # the tiny model reads text only

    _send(page, "Say hello", 12, {"ignore_eos": True})
    expect(page.locator("article.msg.user")).to_have_count(1)
    answer = page.locator("article.msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done")
    expect(answer.locator(".stats")).to_have_text(
        re.compile(r"^12 tokens · \d+(\.\d)? tokens/s · TTFT \d+ ms · cut at max tokens$"))
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()
    page.screenshot(path=str(tmp_path / "webui-exchange.png"), full_page=True)
    page.emulate_media(color_scheme="dark")
    page.screenshot(path=str(tmp_path / "webui-exchange-dark.png"), full_page=True)
    assert (tmp_path / "webui-exchange.png").stat().st_size > 0

    # The conversation is kept in localStorage: a reload shows it; New chat and Delete work.
    page.reload()
    expect(page.locator("#conversations li")).to_have_count(1)
    expect(page.locator("#conversations .open")).to_have_text("Say hello")
    expect(page.locator("article.msg")).to_have_count(2)
    page.get_by_role("button", name="New chat").click()
    expect(page.locator("#conversations li")).to_have_count(2)
    expect(page.locator("article.msg")).to_have_count(0)
    page.get_by_role("button", name="Delete conversation Say hello").click()
    expect(page.locator("#conversations li")).to_have_count(1)

    # The markdown renderer builds elements from text: no model-made HTML ever runs.
    html = page.evaluate("""() => {
        const box = document.createElement('div');
        box.append(renderMarkdown('<img src=x onerror=alert(1)> **b** *i* `c`\\n\\n'
            + '- one\\n- two\\n\\n1. first\\n\\n```py\\nx = 1 < 2\\n```\\n'
            + '[site](javascript:alert(1))'));
        return box.innerHTML;
    }""")
    assert "&lt;img src=x onerror=alert(1)&gt;" in html and "<img" not in html
    assert "<strong>b</strong>" in html and "<em>i</em>" in html and "<code>c</code>" in html
    assert "<ul><li>one</li><li>two</li></ul>" in html and "<ol><li>first</li></ol>" in html
    assert '<pre><code data-lang="py">x = 1 &lt; 2</code></pre>' in html
    # Reasoning comes folded under its own summary.
    folded = page.evaluate("""() => {
        const node = renderMessage({role: 'assistant', content: 'answer', reasoning: 'think',
                                    state: 'done'});
        const details = node.querySelector('details.reasoning');
        return [details.open, details.querySelector('summary').textContent,
                details.textContent, node.querySelector('.content').textContent];
    }""")
    assert folded == [False, "Reasoning", "Reasoningthink", "answer"]
    assert not re.search(r"<a[\s>]", html)  # a link is shown as text, never followed
    assert '<span class="link-url"> (javascript:alert(1))</span>' in html


def test_stop_ends_the_answer_and_frees_the_slot(page, server, base_url):
    """Esc aborts the fetch mid-stream; the server notices and frees the slot. The engine's
    steps are held (StepGate) so the answer is surely mid-stream when it is stopped."""
    expect = _expect()
    page.goto(base_url + "/")
    expect(page.get_by_label("Model")).to_have_value(MODEL)
    engine = server.state.runtime.scheduler.engine
    with gated(engine) as gate:
        _send(page, "Tell me a long story", 200, {"ignore_eos": True})
        answer = page.locator("article.msg.assistant").last
        expect(answer).to_have_attribute("data-state", "streaming")
        assert gate.entered.wait(60), "the request never reached the engine"
        stats = answer.locator(".stats")
        for _ in range(150):  # until the page shows a piece (noise may decode to nothing)
            gate.next()
            text = stats.text_content() if stats.count() else ""
            if re.search(r"[1-9]\d* tokens?", text):
                break
        expect(stats).to_contain_text(re.compile(r"[1-9]\d* tokens?"))
        expect(page.get_by_role("button", name="Stop")).to_be_enabled()
        page.keyboard.press("Escape")
        expect(answer).to_have_attribute("data-state", "stopped")
        expect(answer.locator(".stats")).to_contain_text("stopped")
        # The server sees the disconnect while the engine is still held mid-answer.
        held = _poll_stats(base_url, lambda s: s["requests_active"] == 0,
                           "the aborted request's end")
        assert all(r["tokens"] < 200 for r in held["slots"]["running"]), held
    _poll_stats(base_url, lambda s: s["slots"]["used"] == 0, "a free slot")
    expect(page.get_by_role("button", name="Send")).to_be_enabled()
    expect(page.get_by_role("button", name="Stop")).to_be_disabled()


def _chat_bodies(page) -> list[dict]:
    """The bodies of the page's POST /v1/chat/completions requests, as they are sent."""
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data))
            if r.url.endswith("/v1/chat/completions") and r.method == "POST" else None)
    return bodies


def test_max_tokens_is_the_servers_unless_set_and_then_clamped(page, base_url):
    """Max tokens left empty (the default): the request has none and the server gives the
    rest of the context (no 400 on a small --max-len); a value over the context is clamped
    to what the prompt leaves (POST /tokenize)."""
    expect = _expect()
    bodies = _chat_bodies(page)
    page.goto(base_url + "/")
    expect(page.get_by_label("Model")).to_have_value(MODEL)
    expect(page.get_by_label("Max tokens")).to_have_value("")
    _send(page, "Hello there", None)
    answer = page.locator("article.msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done")
    assert "max_tokens" not in bodies[-1], bodies[-1]

    card = next(m for m in get_json(base_url, "/v1/models")["data"] if m["id"] == MODEL)
    _send(page, "Again", 100_000, {"ignore_eos": True})
    expect(page.locator("article.msg.assistant")).to_have_count(2)
    answer = page.locator("article.msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done")
    sent = bodies[-1]
    status, _, counted = post(base_url, "/tokenize", {"model": MODEL,
                                                      "messages": sent["messages"]})
    assert status == 200, counted
    assert sent["max_tokens"] == card["max_model_len"] - counted["count"], sent
    expect(answer.locator(".stats")).to_contain_text(f"{sent['max_tokens']} tokens")


@pytest.fixture(scope="module")
def keyed_url(server):
    """A server with one API key (`--api-key sk-web`), borrowing the shared runtime."""
    from serving.http.server import ServerThread
    srv = ServerThread(dataclasses.replace(server.settings, api_key="sk-web"),
                       runtime=server.state.runtime).start()
    assert srv.wait_ready(timeout=60)
    wait_healthy(srv.url)
    yield srv.url
    srv.stop()


def test_a_keyed_server_serves_the_page_and_the_page_asks_for_the_key(page, keyed_url):
    expect = _expect()
    with urllib.request.urlopen(keyed_url + "/webui/app.js", timeout=30) as r:  # no key
        assert r.status == 200 and r.headers["content-type"].startswith("text/javascript")
    status, _, body = post(keyed_url, "/webui/secrets.txt", b"", method="GET")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"
    status, _, body = post(keyed_url, "/v1/models", b"", method="GET")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"

    page.goto(keyed_url + "/")
    expect(page).to_have_title("Metrale chat")
    dialog = page.get_by_role("dialog", name="API key needed")
    expect(dialog).to_be_visible()  # /v1/models answered 401
    dialog.get_by_label("API key").fill("sk-wrong")
    dialog.get_by_role("button", name="Save key").click()
    expect(dialog).to_contain_text("refused")
    dialog.get_by_label("API key").fill("sk-web")
    dialog.get_by_role("button", name="Save key").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_label("Model")).to_have_value(MODEL)
    assert page.evaluate("localStorage.getItem('metrale.apiKey')") == "sk-web"

    _send(page, "Hi", 4, {"ignore_eos": True})
    answer = page.locator("article.msg.assistant").last
    expect(answer).to_have_attribute("data-state", "done")
    expect(answer.locator(".stats")).to_contain_text("4 tokens")


def test_no_webui_takes_the_page_away(server):
    from serving.http.server import ServerThread
    srv = ServerThread(dataclasses.replace(server.settings, webui=False),
                       runtime=server.state.runtime).start()
    try:
        assert srv.wait_ready(timeout=60)
        for path in ("/", "/webui/app.js"):
            status, _, body = post(srv.url, path, b"", method="GET")
            assert status == 404, path
            assert set(body["error"]) == {"message", "type", "param", "code"}
        with urllib.request.urlopen(srv.url + "/health", timeout=30) as r:
            assert r.status == 200
    finally:
        srv.stop()
    with urllib.request.urlopen(server.url + "/", timeout=30) as r:  # the default: on
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        assert "Content-Security-Policy" in r.headers and b"<title>Metrale chat" in r.read()
