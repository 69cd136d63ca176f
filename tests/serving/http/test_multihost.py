"""Multi-host serving: two `metrale serve` processes on loopback, one (1, 8) mesh across both.

Each process has 4 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4),
jax.distributed over a loopback coordinator, CPU collectives through gloo. The model is a
tiny random Llama with 8 heads and 4 kv heads, so the mesh really splits heads over all 8
devices (kv heads replicated). Checked: a request to process 0 gives the tokens of a
single-process run, with and without a LoRA adapter (given at start-up, or loaded at runtime:
every process reads it); process 1 answers only /health; a process that dies makes the other fail
its in-flight request with a clear error and exit non-zero (`EXIT_PEER_LOST`) within a
timeout; a server of two models swaps them on every process in process 0's order.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import CACHE, REPO, xla_flags
from tests.serving.conftest import post

SHAPES = ["--max-slots", "2", "--max-len", "256", "--max-prefill-len", "16",
          "--prefix-cache-min-tokens", "0"]
PROMPT = "The quick brown fox"
EXIT_TIMEOUT_S = 90  # a process with a lost peer must be gone within this
EXIT_PEER_LOST = 3  # metrale_jax.multihost.EXIT_PEER_LOST


def _build_model(folder: Path) -> Path:
    """A tiny HF Llama with 8 query heads and 4 kv heads (2 layers) and the tiny tokenizer."""
    import torch
    import transformers

    from devtools.hf_models import COMMON, save_tiny_tokenizer
    config = transformers.LlamaConfig(**{**COMMON, "num_attention_heads": 8,
                                         "num_key_value_heads": 4, "head_dim": 16,
                                         "num_hidden_layers": 2})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = p.ndim == 1 and "norm" in name
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if norm else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return _build_model(tmp_path_factory.mktemp("tiny-h8"))


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> Path:
    """A PEFT adapter (rank 8, every projection) of `model`."""
    import transformers

    from tests.weights.test_lora import ATTN, MLP, make_adapter
    folder = tmp_path_factory.mktemp("tiny-h8-lora")
    make_adapter(transformers.LlamaForCausalLM.from_pretrained(model), folder, ATTN + MLP,
                 r=8, alpha=12, seed=3)
    return folder


def _free_port_pair() -> int:
    """A loopback port P with P + 1 free as well (the coordinator and the side channel)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two adjacent free ports")


class Pair:
    """Two `metrale serve` processes of one server; `urls[i]` once both printed theirs."""

    def __init__(self, model: Path, tmp_path: Path, extra: tuple[str, ...] = ()):
        port = _free_port_pair()
        env = {**os.environ, "XLA_FLAGS": xla_flags(4),
               "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
               "METRALE_JAX_CACHE": str(CACHE)}
        self.procs: list[subprocess.Popen] = []
        self.logs = [tmp_path / f"process{i}.log" for i in range(2)]
        for i in range(2):
            cmd = [sys.executable, "-m", "serving.cli", "serve", "--model", str(model),
                   "--port", "0", *SHAPES, "--mesh", "data=1,model=8",
                   "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                   "--process-id", str(i), "--request-timeout", "300", *extra]
            self.procs.append(subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
                stderr=self.logs[i].open("w")))
        self.urls = [self._url(i) for i in range(2)]

    def _url(self, i: int) -> str:
        """The URL process i prints once ready (gloo prints its own lines on stdout too)."""
        out = self.procs[i].stdout
        for line in out:  # blocks until ready (or the process ends)
            match = re.search(r"at (http://[0-9.:]+)", line)
            if match is not None:  # keep reading, so that a full pipe never blocks it
                threading.Thread(target=out.read, daemon=True).start()
                return match.group(1)
        self.kill()
        pytest.fail(f"process {i} printed no URL:\n{self.stderr(i)[-3000:]}")

    def stderr(self, i: int) -> str:
        return self.logs[i].read_text()

    def wait(self, i: int) -> int:
        """Process i's exit status; fails the test if it is still running after the timeout."""
        try:
            return self.procs[i].wait(timeout=EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"process {i} still runs {EXIT_TIMEOUT_S} s after its peer died:\n"
                        f"{self.stderr(i)[-3000:]}")

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()


LORA = ("--max-loras", "2", "--max-lora-rank", "8")


_REFERENCE = """
import json, sys
from metrale_jax import LLM, SamplingParams
model, adapter, cache, prompt = sys.argv[1:5]
llm = LLM(model, max_slots=2, max_len=256, max_prefill_len=16, compilation_cache_dir=cache,
          max_loras=2, max_lora_rank=8, loras={"sql": adapter})
ids = llm.tokenizer.encode(prompt)
out = llm.generate([ids, ids], [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                               lora=lora) for lora in (None, "sql")])
llm.close()
print(json.dumps({"prompt_ids": ids, "token_ids": list(out[0].token_ids),
                  "lora_token_ids": list(out[1].token_ids)}))
"""


@pytest.fixture(scope="module")
def reference(model, adapter) -> dict:
    """The single-process greedy run (one device, the same engine shapes), without and with
    the adapter. It runs in its own process, as the servers do: XLA:CPU twice crashed in
    this worker serializing this program for the persistent cache after a long run of other
    tests (never alone), and a crash must not take the worker's other tests with it."""
    env = {**os.environ, "XLA_FLAGS": xla_flags(), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-c", _REFERENCE, str(model), str(adapter),
                        str(CACHE), PROMPT], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = json.loads(r.stdout.strip().splitlines()[-1])
    assert ref["lora_token_ids"] != ref["token_ids"]
    return ref


def _completion(url: str, served: Path, **fields) -> tuple[int, dict]:
    """A greedy completion of the model served from folder `served` (or `model=` another)."""
    status, _, body = post(url, "/v1/completions", {
        "model": str(served), "prompt": PROMPT, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **fields})
    return status, body


def _status(url: str, path: str) -> int:
    try:
        with urllib.request.urlopen(url + path, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class _Stream:
    """A streaming completion whose first chunk has arrived."""

    def __init__(self, url: str, body: dict):
        u = urlparse(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=EXIT_TIMEOUT_S)
        self.conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                          {"Content-Type": "application/json"})
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200, self.resp.read()
        self.events = [self._next()]

    def _next(self):
        for raw in self.resp:
            line = raw.decode().strip()
            if line.startswith("data: "):
                payload = line[len("data: "):]
                return payload if payload == "[DONE]" else json.loads(payload)
        return None

    def rest(self) -> list:
        """Every event after the first (the connection may also just close)."""
        try:
            while (event := self._next()) is not None:
                self.events.append(event)
        except (OSError, http.client.HTTPException):
            pass
        finally:
            self.conn.close()
        return self.events


@pytest.mark.slow
def test_two_processes_serve_like_one_and_fail_cleanly_when_one_dies(model, adapter,
                                                                     reference, tmp_path):
    pair = Pair(model, tmp_path, (*LORA, "--lora", f"sql={adapter}",
                                  "--enable-lora-runtime-updates"))
    try:
        leader, follower = pair.urls
        status, body = _completion(leader, model, max_tokens=16)
        assert status == 200, body
        choice = body["choices"][0]
        assert body["choices"][0]["prompt_token_ids"] == reference["prompt_ids"]
        assert choice["token_ids"] == reference["token_ids"]
        # The prompt and answer's first page is cached now: a prompt that starts with them
        # shares it on both processes (the follower repeats the leader's page calls, or the
        # heads on its devices would read another page) and continues the same way.
        longer = reference["prompt_ids"] + reference["token_ids"][:15]
        status, body = _completion(leader, model, max_tokens=1, prompt=longer)
        assert status == 200, body
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 16
        assert body["choices"][0]["token_ids"] == reference["token_ids"][15:16]
        # An adapter, from start-up and loaded at runtime (the follower loads it too, into
        # the same slot, or its heads would compute without it).
        status, body = _completion(leader, model, max_tokens=16, model="sql")
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference["lora_token_ids"]
        status, _, body = post(leader, "/v1/load_lora_adapter",
                               {"lora_name": "sql2", "lora_path": str(adapter)})
        assert status == 200, body
        status, body = _completion(leader, model, max_tokens=16, model="sql2")
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == reference["lora_token_ids"]
        # the follower: /health only
        assert _status(follower, "/health") == 200
        assert _status(follower, "/v1/models") == 404
        status, _, err = post(follower, "/v1/completions", {"prompt": "x"})
        assert status == 404 and "only /health" in err["error"]["message"]

        # process 1 dies while a long request streams from process 0
        stream = _Stream(leader, {"model": str(model), "prompt": PROMPT, "max_tokens": 230,
                                  "temperature": 0, "ignore_eos": True})
        pair.procs[1].send_signal(signal.SIGKILL)
        events = stream.rest()
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors, events[-3:]
        assert errors[0]["error"]["code"] == "peer_lost", errors[0]
        assert "process 1 of 2" in errors[0]["error"]["message"]
        assert pair.wait(0) == EXIT_PEER_LOST, pair.stderr(0)[-3000:]
        assert "process 1 of 2 of this multi-host server is gone" in pair.stderr(0)
    finally:
        pair.kill()


@pytest.mark.slow
def test_several_models_swap_in_step_then_followers_exit_when_process_0_dies(
        model, reference, tmp_path):
    """A multi-host server of two models (the same weights under a second name): a request
    to the unloaded one makes every process unload the loaded one and load it, in process
    0's order (one model at a time), and it answers with the same tokens. Then process 0
    dies: the follower exits."""
    pair = Pair(model, tmp_path, ("--model", f"twin={model}", "--warmup", "none"))
    try:
        leader, _ = pair.urls
        for served in (model, "twin"):
            status, body = _completion(leader, served, max_tokens=16)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == reference["token_ids"], served
        states = {m["id"]: m["state"] for m in json.loads(urllib.request.urlopen(
            leader + "/v1/metrale/models", timeout=30).read())["data"]}
        assert states == {str(model): "on_disk", "twin": "loaded"}
        assert pair.procs[1].poll() is None
        assert "twin loaded, replaying process 0's calls" in pair.stderr(1)
        pair.procs[0].send_signal(signal.SIGKILL)
        code = pair.wait(1)
        assert code != 0
        if code == EXIT_PEER_LOST:  # (jax's coordination client may abort it first)
            assert "process 0 of this multi-host server is gone" in pair.stderr(1)
    finally:
        pair.kill()
