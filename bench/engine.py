"""Engine benchmark on a default-model-shaped config (SmolLM2-135M: llama, 30 layers, E 576).

Random weights (speed does not depend on them). Prints one table: prefill tokens/s per
bucket, decode tokens/s at 1/4/8/16 concurrent requests (in an engine of `--slots` slots, and
in one sized to the concurrency), time to first token, warmup cold (empty persistent cache) and
warm, and transformers' greedy `generate` (torch, CPU, float32) at batch 1 and 16.

    .venv/bin/python bench/engine.py                     # the full table (a few minutes)
    .venv/bin/python bench/engine.py --max-len 512 --steps 8 --no-hf --no-warmup
    .venv/bin/python bench/engine.py --sampling          # decode step time per sampling control
    .venv/bin/python bench/engine.py --mesh              # overhead table, meshes (1,1) (1,2) (2,1)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_common import DEFAULT_SHAPE, decode_rate, engine_config, random_model
from metrale_jax.engine import Engine, SlotSettings
from metrale_jax.weights.checkpoint import load_checkpoint
from metrale_jax.weights.default_model import default_model_path


def timed(fn, repeat: int) -> float:
    """Median seconds of `fn()` (which must block) over `repeat` runs after one warm run."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


SAMPLED = {"temperature": 1.0}
CONTROLS: dict[str, dict] = {
    "repetition_penalty": {"repetition_penalty": 1.1},
    "presence/frequency": {"presence_penalty": 0.5, "frequency_penalty": 0.5},
    "DRY": {"dry_multiplier": 0.8, "dry_breaker_ids": (13, 28, 30)},
    "LZ penalty": {"lz_penalty": 0.2},
    "logit_bias (64 ids)": {"logit_bias": tuple((i * 7, 1.5) for i in range(64))},
    "bad_words + min_tokens": {"bad_words": ((5, 6), (7, 8, 9)), "banned_ids": (11,),
                               "min_tokens": 10_000, "stop_ids": (2,)},
    "top_n_sigma": {"top_n_sigma": 1.5},
    "top_k 50": {"top_k": 50},
    "top_p 0.9": {"top_p": 0.9},
    "min_p 0.05": {"min_p": 0.05},
    "typical_p 0.9": {"typical_p": 0.9},
    "XTC": {"xtc_threshold": 0.1, "xtc_probability": 0.5},
}


STORY = ("Write a long story about a lighthouse keeper who finds a message in a bottle. "
         "Describe the sea, the weather, the island and the people of the nearby village.")


def sampling_engine(args, cache_dir: str) -> tuple[Engine, list[list[int]], str]:
    """The engine for the sampling table: the default model's real weights when pulled (which
    sampler path runs depends on how peaked the logits are), else random weights."""
    if default_model_path().is_file():
        ckpt = load_checkpoint("default")
        engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params,
                        engine_config(args, args.slots, cache_dir))
        text = ckpt.tokenizer.encode(f"<|im_start|>user\n{STORY}<|im_end|>\n"
                                     "<|im_start|>assistant\n")
        return engine, [text] * args.slots, "default model weights"
    graphdef, params = random_model()
    engine = Engine(DEFAULT_SHAPE, graphdef, params, engine_config(args, args.slots, cache_dir))
    rng = np.random.default_rng(0)
    return engine, [rng.integers(0, 2000, 200).tolist() for _ in range(args.slots)], \
        "random weights"


def sampling_table(engine: Engine, prompts: list[list[int]], args) -> list[tuple[str, str]]:
    """Decode step time at every slot busy: controls off, each alone, all on (interleaved
    rounds, medians; ratios against 'all off, sampled')."""
    B = engine.config.max_slots
    configs = {"all off, greedy": {}, "all off, sampled": SAMPLED}
    configs.update({name: {**SAMPLED, **c} for name, c in CONTROLS.items()})
    configs["all on"] = {k: v for c in (SAMPLED, *CONTROLS.values()) for k, v in c.items()}
    states = {}
    for name, fields in configs.items():
        items = [(s, prompts[s], SlotSettings(seed=s, **fields)) for s in range(B)]
        states[name], _ = engine.add(engine.init_decode_state(), items)
    mask = np.ones(B, np.bool_)
    times: dict[str, list[float]] = {name: [] for name in configs}
    compiles = engine.compile_count
    for _ in range(args.rounds):
        for name in configs:
            state = states[name]
            state, out = engine.step(state, mask)
            jax.block_until_ready(out.tokens)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, out = engine.step(state, mask)
            jax.block_until_ready(out.tokens)
            times[name].append((time.perf_counter() - t0) / args.steps)
            states[name] = state
    base = float(np.median(times["all off, sampled"]))
    rows = []
    for name in configs:
        t = float(np.median(times[name]))
        rows.append((f"decode step, {B} slots: {name}", f"{t * 1000:7.1f} ms   "
                     f"{t / base:5.2f}x"))
    rows.append(("compiles during the table", str(engine.compile_count - compiles)))
    return rows


def warmup_only(args) -> None:
    """Child process: builds an engine and prints its warmup seconds as JSON."""
    graphdef, params = random_model()
    engine = Engine(DEFAULT_SHAPE, graphdef, params,
                    engine_config(args, args.slots, args.cache_dir))
    seconds = engine.warmup()
    print(json.dumps({"warmup_s": seconds, "programs": engine.compile_count}))


def warmup_times(args) -> tuple[float, float, int]:
    with tempfile.TemporaryDirectory() as folder:
        out = []
        for _ in range(2):
            cmd = [sys.executable, __file__, "--warmup-only", "--cache-dir", folder,
                   "--slots", str(args.slots), "--max-len", str(args.max_len),
                   "--max-prefill", str(args.max_prefill),
                   "--prefill-batch", str(args.prefill_batch),
                   "--decode-steps", str(args.decode_steps)]
            res = subprocess.run(cmd, capture_output=True, text=True, check=True)
            out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out[0]["warmup_s"], out[1]["warmup_s"], out[0]["programs"]


def hf_rate(batch: int, new_tokens: int) -> float:
    import torch
    import transformers
    c = DEFAULT_SHAPE
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim, rope_theta=c.rope_theta,
        tie_word_embeddings=True, max_position_embeddings=c.max_position_embeddings)
    torch.manual_seed(0)
    torch.set_flush_denormal(True)  # random-init activations are tiny; denormals are slow
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.ones((batch, 16), dtype=torch.long)
    kw = dict(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        t0 = time.perf_counter()
        model.generate(ids, **kw)
    return batch * new_tokens / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--max-prefill", type=int, default=512)
    p.add_argument("--prefill-batch", type=int, default=4)
    p.add_argument("--decode-steps", type=int, default=1, help="k steps per generate call")
    p.add_argument("--steps", type=int, default=16, help="timed generate calls per figure")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-sized", action="store_true", help="skip engines sized to each figure")
    p.add_argument("--warmup-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--hf-only", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--sampling", action="store_true",
                   help="only the sampling-controls table (decode step time per control)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (--sampling)")
    p.add_argument("--mesh", nargs="*", default=None, metavar="MESH",
                   help="only the mesh overhead table, one child process per mesh (default: "
                        "data=1,model=1 data=1,model=2 data=2,model=1; bench/engine_mesh.py)")
    p.add_argument("--real-devices", action="store_true",
                   help="--mesh on the machine's devices instead of fake CPU ones")
    p.add_argument("--mesh-child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.mesh_child is not None:
        from bench.engine_mesh import child  # the mesh table's code, only when asked
        print(json.dumps(child(args, args.mesh_child)))
        return
    if args.mesh is not None:
        from bench.engine_mesh import DEFAULT_MESHES, table
        args.mesh = args.mesh or list(DEFAULT_MESHES)
        table(args)
        return
    if args.warmup_only:
        warmup_only(args)
        return
    if args.hf_only:
        print(json.dumps({"rate": hf_rate(args.hf_only, max(8, args.steps))}))
        return

    rows: list[tuple[str, str]] = []
    cache_dir = args.cache_dir or str(Path(tempfile.gettempdir()) / "metrale-bench-cache")
    if args.sampling:
        engine, prompts, what = sampling_engine(args, cache_dir)
        t0 = time.perf_counter()
        engine.warmup()
        rows.append(("warmup (this run's cache)", f"{time.perf_counter() - t0:.1f} s"))
        rows.append(("weights", what))
        rows += sampling_table(engine, prompts, args)
        _print(rows, args)
        return
    graphdef, params = random_model()
    engine = Engine(DEFAULT_SHAPE, graphdef, params, engine_config(args, args.slots, cache_dir))
    t0 = time.perf_counter()
    engine.warmup()
    rows.append(("warmup (this run's cache)", f"{time.perf_counter() - t0:.1f} s, "
                 f"{engine.compile_count} programs"))
    cfg = engine.config
    for C in cfg.chunk_buckets:  # one prompt of C tokens: one ragged step's chunk
        def prefill(C=C) -> None:
            state = engine.init_decode_state()
            _, first = engine.add(state, [(0, [1] * C, SlotSettings())])
            np.asarray(first.tokens)
        dt = timed(prefill, 3 if C < 256 else 1)
        rows.append((f"prefill chunk C={C}", f"{C / dt:,.0f} tok/s ({dt * 1000:.0f} ms)"))

    def ttft() -> None:
        state = engine.init_decode_state()
        jax.block_until_ready(state.positions)
        t0 = time.perf_counter()
        state, first = engine.add(state, [(0, [1] * 100, SlotSettings())])
        np.asarray(first.tokens)
        times.append(time.perf_counter() - t0)

    times: list[float] = []
    for _ in range(4):
        ttft()
    rows.append(("time to first token (100-token prompt)", f"{np.median(times[1:]) * 1000:.0f} ms"))

    concurrency = [int(c) for c in args.concurrency.split(",") if int(c) <= args.slots]
    ours: dict[int, float] = {}
    for c in concurrency:
        r = decode_rate(engine, c, args.steps)
        ours[c] = r
        line = f"{r:,.1f} tok/s"
        if not args.no_sized and c != args.slots:
            sized = Engine(DEFAULT_SHAPE, graphdef, params, engine_config(args, c, cache_dir))
            rs = decode_rate(sized, c, args.steps)
            ours[c] = rs
            line += f"   (engine of {c} slots: {rs:,.1f} tok/s)"
        rows.append((f"decode, {c} concurrent, {args.slots} slots, S={args.max_len}", line))
    if not args.no_warmup:
        cold, warm, n = warmup_times(args)
        rows.append(("warmup cold (empty cache)", f"{cold:.1f} s ({n} programs)"))
        rows.append(("warmup warm (persistent cache)", f"{warm:.1f} s"))
    if not args.no_hf:
        for b in (1, 16):
            if b in ours:
                # A fresh process: torch would share the two cores with JAX's thread pools.
                res = subprocess.run([sys.executable, __file__, "--hf-only", str(b),
                                      "--steps", str(args.steps)], capture_output=True,
                                     text=True, check=True)
                hf = json.loads(res.stdout.strip().splitlines()[-1])["rate"]
                rows.append((f"transformers generate batch {b}",
                             f"{hf:,.1f} tok/s; engine/transformers = {ours[b] / hf:.2f}x"))
    _print(rows, args)


def _print(rows: list[tuple[str, str]], args) -> None:
    width = max(len(k) for k, _ in rows)
    print(f"Metrale-JAX engine, {DEFAULT_SHAPE.architecture} default-model shape, "
          f"{jax.devices()[0].platform}, float32, decode_steps={args.decode_steps}")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


if __name__ == "__main__":
    main()
