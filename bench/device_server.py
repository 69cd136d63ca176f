"""The device check's server part: `metrale serve` on a random model, `metrale bench` at 16
and 64 clients against it, the bench's table back.

The model is written as a Hugging Face folder (config.json, float16 safetensors, a small
byte-level BPE tokenizer trained on the bench's words) with numpy, `safetensors` and
`tokenizers` only: an accelerator host has no torch. Both commands run as
`python -m serving.cli ...` subprocesses (the repository on PYTHONPATH, no install needed).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.device_parts import ROOT, engine_shapes, model_shape

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex every "
         "jolly box of frozen pizza 0 1 2 3 4 5 6 7 8 9 : ")


def write_tokenizer(folder: Path) -> None:
    """A byte-level BPE `tokenizer.json` (about 300 tokens; the bench's words whole) and its
    `tokenizer_config.json` in `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([WORDS] * 50, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"}))


def write_model(folder: Path, tiny: bool) -> Path:
    """A random Llama of `model_shape(tiny)` as an HF folder (float16 weights); reused when
    `folder` already holds it. Returns `folder`."""
    import numpy as np
    from safetensors.numpy import save_file
    cfg = model_shape(tiny)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
              "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
              "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
              "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings,
              "rope_theta": cfg.rope_theta, "rms_norm_eps": 1e-6 if tiny else 1e-5,
              "hidden_act": "silu", "tie_word_embeddings": cfg.tie_word_embeddings,
              "torch_dtype": "float16",
              "bos_token_id": 0, "eos_token_id": 1}
    done = folder / "config.json"
    if done.is_file() and json.loads(done.read_text()) == config:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    block = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float16)

    def rand(*shape: int) -> np.ndarray:  # a repeated random block: quick to write
        return np.resize(block, shape)

    E, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, K = cfg.num_heads, cfg.num_kv_heads
    tensors = {"model.embed_tokens.weight": rand(cfg.vocab_size, E),
               "model.norm.weight": np.ones(E, np.float16)}
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = rand(cfg.vocab_size, E)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": rand(H * D, E),
                    p + "self_attn.k_proj.weight": rand(K * D, E),
                    p + "self_attn.v_proj.weight": rand(K * D, E),
                    p + "self_attn.o_proj.weight": rand(E, H * D),
                    p + "mlp.gate_proj.weight": rand(I, E), p + "mlp.up_proj.weight": rand(I, E),
                    p + "mlp.down_proj.weight": rand(E, I),
                    p + "input_layernorm.weight": np.ones(E, np.float16),
                    p + "post_attention_layernorm.weight": np.ones(E, np.float16)}
    save_file(tensors, str(folder / "model.safetensors"))
    write_tokenizer(folder)
    done.write_text(json.dumps(config))
    return folder


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    """Polls `url`/health until 200; raises when the server exits or the deadline passes."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"metrale serve exited with {proc.returncode} before it was "
                               "healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"timeout: {url} not healthy within the part's limit")


def _markdown(levels: list[dict[str, Any]]) -> str:
    from serving.cli.bench import HEAD, table_cells
    rows = table_cells([lv["summary"] for lv in levels])
    return "\n".join(["| " + " | ".join(HEAD) + " |", "|" + "---:|" * len(HEAD),
                      *("| " + " | ".join(r) + " |" for r in rows)])


def server(config: dict, out: Path) -> dict:
    """Serves the random model (or config["server_model"]) and runs `metrale bench` at 16
    and 64 clients; the bench table."""
    tiny = bool(config.get("tiny"))
    start = time.monotonic()
    deadline = start + float(config.get("limit", 120)) - 5
    # the backend as `detect` found it: this process must not open the device (a TPU takes
    # one process), the server's does
    backend = (config.get("backend") or {}).get("backend")
    dtype = "float32" if backend == "cpu" else "bfloat16"
    model = config.get("server_model") or str(write_model(out / "model", tiny))
    written_s = time.monotonic() - start
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    sh = engine_shapes(tiny)
    shapes = ["--max-slots", str(max(sh["batches"])), "--max-len", str(sh["max_len"]),
              "--max-prefill-len", str(sh["prefill"])]
    if tiny:  # compile only the programs the bench reaches
        shapes += ["--warmup", "none"]
    serve = [sys.executable, "-m", "serving.cli", "serve", "--model", model,
             "--served-model-name", "device-check", "--port", str(port), "--dtype", dtype,
             "--grace-period", "2", *shapes]
    log = (out / "logs" / "serve.log").open("w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.Popen(serve, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, deadline)
        ready_s = time.monotonic() - start - written_s
        raw = out / "server-bench.json"
        # tiny: 16 requests a level (the 64 level then has 16 in flight: no new shapes)
        n, prompt, output = ("16", "8", "4") if tiny else ("128", "128", "64")
        bench = [sys.executable, "-m", "serving.cli", "bench", "--url", url,
                 "--concurrency", "16", "64", "--requests", n, "--prompt-len", prompt,
                 "--output-len", output, "--timeout", "120", "--out", str(raw)]
        left = max(5.0, deadline - time.monotonic())
        try:
            # the client needs no device (a TPU is held by the server's process)
            res = subprocess.run(bench, cwd=ROOT, env={**env, "JAX_PLATFORMS": "cpu"},
                                 capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"timeout: metrale bench ran past {left:.0f} s") from None
        if res.returncode != 0:
            raise RuntimeError(f"metrale bench exited {res.returncode}: "
                               f"{(res.stderr or res.stdout)[-1500:]}")
        levels = json.loads(raw.read_text())["levels"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
    rows = [lv["summary"] for lv in levels]
    failed = sum(r["failed"] for r in rows)
    details = {"model": model, "dtype": dtype, "serve": " ".join(serve[3:]),
               "bench": " ".join(bench[3:]), "model_written_s": written_s,
               "ready_s": ready_s, "levels": rows}
    summary = ", ".join(f"{r['concurrency']} clients: {r['output_tok_s']:.1f} out tok/s, "
                        f"{r['failed']} failed" for r in rows)
    md = (f"`metrale {details['serve']}` (ready in {ready_s:.0f} s), then "
          f"`metrale {details['bench']}`:\n\n{_markdown(levels)}")
    return {"status": "fail" if failed else "pass", "summary": summary, "details": details,
            "markdown": md}
