"""The scale-out flags of `metrale generate` / `serve`: --mesh, --memory-gb, 0 = "choose",
the multi-host flags' checks, and a sharded orbax restore on 2 fake devices from the CLI.
Runs that read the log or need more devices than this process sees are subprocesses, as a
user runs them; the usage errors (exit 2 before loading), convert and the one-device run the
sharded one is compared with run `main()` in this process (tests/test_cli.py checks the
console script's path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devtools.hf_models import build_tiny_checkpoint
from tests.conftest import REPO, xla_flags
from tests.serving.conftest import run_main


def metrale(*args: str, devices: int = 1, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if devices > 1:
        env["XLA_FLAGS"] = xla_flags(devices)
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("scale-llama"))


GEN = ["--prompt", "quick brown", "--max-tokens", "6", "--temperature", "0", "--json"]


@pytest.mark.parametrize("args, needle", [
    (["--mesh", "data=1,model=2"], "needs 2 devices, but 1 is visible"),
    (["--mesh", "rows=2"], "unknown axis 'rows'"),
    (["--max-len", "0"], "--memory-gb"),  # CPU reports no memory: nothing to size the cache by
    (["--max-len", "64", "--memory-gb", "0.0001"], "per device"),
    (["--coordinator", "127.0.0.1:1234"], "give all of --coordinator"),
    (["--coordinator", "h", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"], "--process-id"),
])
def test_bad_scale_flags_exit_2_before_loading(args, needle, tiny, capsys):
    code, _, err = run_main(capsys, "generate", "--model", str(tiny), *GEN, *args)
    assert code == 2, err
    assert needle in err and "Traceback" not in err


def test_memory_plan_chooses_the_cache_length(tiny):
    r = metrale("-v", "generate", "--model", str(tiny), *GEN, "--max-len", "0",
                "--memory-gb", "2")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 6
    assert "memory plan: mesh data=1,model=1 (1 device); KV cache 1 slot x 256 tokens" \
        in r.stderr  # the tiny model's 256 positions fit


def test_serve_refuses_a_plan_that_does_not_fit(tiny, capsys):
    code, _, err = run_main(capsys, "serve", "--model", str(tiny), "--port", "0",
                            "--max-slots", "64", "--max-len", "256", "--memory-gb", "0.001")
    assert code == 2, err
    assert "metrale: error:" in err and "per device" in err


@pytest.mark.slow
def test_sharded_orbax_generate_matches_one_device(tiny, tmp_path, capsys):
    """`metrale convert` output, restored straight onto a (1, 2) mesh by load_checkpoint's
    placement hook, generates the single-device tokens."""
    native = tmp_path / "native"
    code, _, err = run_main(capsys, "convert", str(tiny), str(native))
    assert code == 0, err
    code, one, err = run_main(capsys, "generate", "--model", str(native), *GEN, "--max-len",
                              "64")
    assert code == 0, err
    two = metrale("-v", "generate", "--model", str(native), *GEN, "--max-len", "64",
                  "--mesh", "data=1,model=2", devices=2)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "orbax, sharded" in two.stderr and "mesh data=1,model=2" in two.stderr
    assert json.loads(two.stdout)["token_ids"] == json.loads(one)["token_ids"]


@pytest.mark.parametrize("share", ["1.5", "-0.1"])
def test_serve_refuses_a_prefix_cache_share_outside_0_to_1(share, tiny, capsys):
    code, _, err = run_main(capsys, "serve", "--model", str(tiny), "--port", "0",
                            "--prefix-cache-share", share)
    assert code == 2, err
    assert "--prefix-cache-share must be from 0 to 1" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("args, needle", [
    (["--lora", "no-equals-sign"], "expected NAME=PATH"),
    (["--lora", "a=/x", "--lora-modules", "a=/y"], "given twice"),
    (["--lora", "a=/x", "b=/y", "--max-loras", "1"], "--max-loras 1"),
    (["--lora", "a=/x", "--active-lora", "b"], "no --lora adapter is named 'b'"),
    (["--lora", "a=/x", "--active-lora", "a=big"], "expected NAME or NAME=SCALE"),
    (["--lora", "a=/x", "--active-lora", "a=inf"], "finite"),
])
def test_serve_refuses_bad_lora_flags(args, needle, tiny, capsys):
    code, _, err = run_main(capsys, "serve", "--model", str(tiny), "--port", "0", *args)
    assert code == 2, err
    assert needle in err and "Traceback" not in err
