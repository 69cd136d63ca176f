"""The int8 KV cache on the default model: quality and decode speed against a float32 cache.

    python bench/kv_cache.py                          # float32 weights
    python bench/kv_cache.py --quantization int8-all  # int8 weights, both caches

Per cache dtype, in one run on the same machine (needs `metrale pull`), with the same weights:
- bytes/token: the KV cache's bytes per token (all layers; int8 rows carry a float32 scale);
- logit err: max over the README positions of max|logits - float32's| / max|float32's|,
  every position's logits computed through the paged path in chunks of `--chunk` tokens
  (`models.ragged.sequence_logits`: later chunks read their context back from the pool);
- forced agree: how often the argmax at those positions equals float32's;
- ppl: the perplexity of the first `--ppl-tokens` README tokens, read that way, and its change;
- same prefix: of `--tokens` greedy tokens decoded by the engine from a chat prompt, how many
  come before the first that differs from float32's;
- tok/s: decode rate of 1 row and of `--rows` rows whose prompts hold `--context` README
  tokens (median of 5 rounds of `--steps` steps, after a warm-up), and the ratio to float32.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from metrale_jax.config import QUANTIZATIONS  # noqa: E402
from metrale_jax.engine import Engine, EngineConfig, SlotSettings  # noqa: E402
from metrale_jax.engine.memory_plan import token_bytes_per_device  # noqa: E402
from metrale_jax.models.ragged import sequence_logits  # noqa: E402
from metrale_jax.text import ChatTemplate  # noqa: E402
from metrale_jax.weights.checkpoint import load_checkpoint  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                                      "finds a message in a bottle."}]


def greedy(engine: Engine, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens from `prompt` in slot 0."""
    state = engine.init_decode_state()
    state, first = engine.add(state, [(0, prompt, SlotSettings())])
    out = [int(np.asarray(first.tokens)[0, 0])]
    active = np.arange(engine.config.max_slots) < 1
    while len(out) < tokens:
        state, step = engine.step(state, active)
        out.append(int(np.asarray(step.tokens)[0, 0]))
    return out


def decode_rates(engine: Engine, prompt: list[int], rows_list: list[int], steps: int,
                 rounds: int = 5) -> dict[int, float]:
    """Tokens/s of each row count decoding together after `prompt` (median of `rounds`)."""
    rates = {}
    for rows in rows_list:
        state = engine.init_decode_state()
        for r in range(rows):  # one at a time: the prompts are long
            state, first = engine.add(state, [(r, prompt, SlotSettings())])
        np.asarray(first.tokens)
        active = np.arange(engine.config.max_slots) < rows
        for _ in range(3):  # compile and warm up
            state, step = engine.step(state, active)
        np.asarray(step.tokens)
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(steps):
                state, step = engine.step(state, active)
                np.asarray(step.tokens)
            times.append(time.perf_counter() - t0)
        rates[rows] = rows * steps / statistics.median(times)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quantization", default=None, choices=[None, *QUANTIZATIONS],
                    help="the weights (both caches use the same)")
    ap.add_argument("--caches", nargs="+", default=["int8"], help="cache dtypes beside float32")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="README tokens scored")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk of the scoring")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens to compare")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens for the speed")
    ap.add_argument("--rows", type=int, default=16, help="rows decoding together")
    ap.add_argument("--steps", type=int, default=20, help="decode steps per timed round")
    args = ap.parse_args()
    ckpt = load_checkpoint("default", quantization=args.quantization)
    tok = ckpt.tokenizer
    chat = tok.encode(ChatTemplate(ckpt.chat_template).render(PROMPT, add_generation_prompt=True),
                      add_special_tokens=False)
    readme = tok.encode((ROOT / "README.md").read_text(), add_special_tokens=False)
    text, context = readme[:args.ppl_tokens], readme[:args.context]
    max_len = max(2048, args.context + 4 * args.steps + 16, len(chat) + args.tokens + 16)
    rows_list = sorted({1, args.rows})
    results = []
    for cache in ["float32", *args.caches]:
        engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params, EngineConfig(
            max_slots=max(rows_list), max_len=max_len, num_top_logprobs=1, cache_dtype=cache,
            quantization=args.quantization))
        logits = np.asarray(sequence_logits(engine.graph, engine.params, text,
                                            page_size=engine.config.page_size,
                                            cache_dtype=jnp.dtype(cache), chunk=args.chunk))
        logp = jax.nn.log_softmax(jnp.asarray(logits[:-1]), -1)
        nll = -float(jnp.mean(jnp.take_along_axis(logp, jnp.asarray(text[1:])[:, None], -1)))
        out = greedy(engine, chat, args.tokens)
        rates = decode_rates(engine, context, rows_list, args.steps)
        results.append(dict(cache=cache, logits=logits, ppl=float(np.exp(nll)), out=out,
                            rates=rates, bytes=token_bytes_per_device(
                                ckpt.config, jnp.dtype(cache).itemsize, (1, 1))))
        del engine
    base = results[0]
    print(f"default model, weights {args.quantization or 'float32'}, "
          f"{jax.devices()[0].platform}; {len(text)} README tokens scored in chunks of "
          f"{args.chunk}; {args.tokens} greedy tokens; decode after {len(context)} tokens")
    speed = "  ".join(f"{f'{r} row' + ('s' if r > 1 else '') + ' tok/s':>14} {'vs f32':>7}"
                      for r in rows_list)
    print(f"{'cache':8} {'bytes/token':>11} {'logit err':>10} {'forced agree':>13} "
          f"{'ppl':>8} {'ppl diff':>9} {'same prefix':>12}  {speed}")
    for r in results:
        err = float((np.abs(r["logits"] - base["logits"]).max(-1)
                     / np.abs(base["logits"]).max(-1)).max())
        agree = float(np.mean(r["logits"].argmax(-1) == base["logits"].argmax(-1)))
        same = next((i for i, (a, b) in enumerate(zip(r["out"], base["out"], strict=True))
                     if a != b), len(r["out"]))
        cells = "  ".join(f"{r['rates'][n]:14.1f} {r['rates'][n] / base['rates'][n]:6.2f}x"
                          for n in rows_list)
        print(f"{r['cache']:8} {r['bytes']:11d} {err:10.4f} {agree:13.3f} {r['ppl']:8.3f} "
              f"{r['ppl'] / base['ppl'] - 1:+9.2%} {same:12d}  {cells}")


if __name__ == "__main__":
    main()
