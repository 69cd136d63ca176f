"""Weight-only quantization on the default model: quality, decode and prefill speed vs float32.

    python bench/quantization.py                  # float32, int8, int8-all and int4
    python bench/quantization.py --modes int8     # float32 and int8 only

Per weight mode, in one run on the same machine (needs `metrale pull`):
- logit err: max over the prompt's positions of max|logits - float32| / max|float32 logits|;
- greedy: of `--tokens` greedy tokens decoded by the engine from a chat prompt, how many come
  before the first token that differs from float32's, and the agreement teacher-forced (the
  mode's argmax on float32's own greedy sequence, position by position);
- ppl: the perplexity of the first `--ppl-tokens` tokens of the project's README.md (windows
  of `--window` tokens, each scored from its second token on), and its change vs float32;
- tok/s: single-stream greedy decode through the engine (one slot), after a warm-up;
- TTFT: time to the first token of a `--prefill-tokens` prompt (README tokens) through the
  same engine (the default `max_prefill_len`, 512: one chunk), best of 3 after a warm-up.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.logits import rows_logits  # noqa: E402
from metrale_jax.config import QUANTIZATIONS  # noqa: E402
from metrale_jax.engine import Engine, EngineConfig, SlotSettings  # noqa: E402
from metrale_jax.models.unrolled import split_layers  # noqa: E402
from metrale_jax.text import ChatTemplate  # noqa: E402
from metrale_jax.weights.checkpoint import load_checkpoint  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a short story about a lighthouse keeper who "
                                      "finds a message in a bottle."}]


_LAYERS: dict[int, tuple] = {}  # id(checkpoint) -> its params split per layer


def logits_of(ckpt, ids: list[int]) -> np.ndarray:
    """Logits `[T, V]` of the whole sequence `ids`, prefilled in one chunk as the engine
    prefills a prompt."""
    if id(ckpt) not in _LAYERS:
        _LAYERS[id(ckpt)] = split_layers(ckpt.graphdef, ckpt.params)
    return rows_logits(*_LAYERS[id(ckpt)], [ids])[0]


def perplexity(ckpt, ids: list[int], window: int) -> float:
    """exp(mean NLL) of `ids` scored in windows of `window` tokens."""
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start:start + window]
        if len(chunk) < 2:
            break
        if len(chunk) < window:  # pad the last window: one compile for all
            chunk = chunk + [0] * (window - len(chunk))
        n = min(window, len(ids) - start)
        logp = jax.nn.log_softmax(jnp.asarray(logits_of(ckpt, chunk)), axis=-1)
        target = jnp.asarray(chunk[1:n])
        nll -= float(jnp.sum(jnp.take_along_axis(logp[:n - 1], target[:, None], -1)))
        count += n - 1
    return float(np.exp(nll / count))


def make_engine(ckpt, max_len: int) -> Engine:
    """A one-slot engine for `ckpt` (the default prefill chunk, 512 tokens)."""
    return Engine(ckpt.config, ckpt.graphdef, ckpt.params, EngineConfig(
        max_slots=1, max_len=max_len, num_top_logprobs=1))


def time_to_first_token(engine: Engine, prompt: list[int], rounds: int = 3) -> float:
    """Seconds from `engine.add` of `prompt` to its first token on the host, best of
    `rounds` after a warm-up (the compile)."""
    state = engine.init_decode_state()
    best = float("inf")
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        state, first = engine.add(state, [(0, prompt, SlotSettings())])
        np.asarray(first.tokens)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def greedy_decode(engine: Engine, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """`tokens` greedy tokens through the engine (one slot) and the decode tokens/s (the
    decode steps after the first two, timed on the device)."""
    state = engine.init_decode_state()
    state, first = engine.add(state, [(0, prompt, SlotSettings())])
    out = [int(np.asarray(first.tokens)[0, 0])]
    active = np.ones(1, bool)
    for _ in range(2):  # compile and warm up
        state, step = engine.step(state, active)
        out.append(int(np.asarray(step.tokens)[0, 0]))
    t0 = time.perf_counter()
    for _ in range(tokens - 3):
        state, step = engine.step(state, active)
        out.append(int(np.asarray(step.tokens)[0, 0]))
    rate = (tokens - 3) / (time.perf_counter() - t0)
    return out, rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", default=list(QUANTIZATIONS), choices=QUANTIZATIONS,
                    help="quantization modes beside float32")
    ap.add_argument("--tokens", type=int, default=256, help="greedy tokens to decode")
    ap.add_argument("--ppl-tokens", type=int, default=2048, help="README tokens scored")
    ap.add_argument("--window", type=int, default=512, help="perplexity window")
    ap.add_argument("--prefill-tokens", type=int, default=500,
                    help="prompt length (README tokens) for the time to first token")
    args = ap.parse_args()
    rows = []
    base = None
    for mode in [None, *args.modes]:
        ckpt = load_checkpoint("default", quantization=mode)
        tok = ckpt.tokenizer
        if base is None:
            template = ChatTemplate(ckpt.chat_template)
            prompt = tok.encode(template.render(PROMPT, add_generation_prompt=True),
                                add_special_tokens=False)
            text = tok.encode((ROOT / "README.md").read_text(), add_special_tokens=False)
            text = text[:args.ppl_tokens]
        engine = make_engine(ckpt, 1024)
        out, rate = greedy_decode(engine, prompt, args.tokens)
        ttft = time_to_first_token(engine, text[:args.prefill_tokens])
        del engine
        ppl = perplexity(ckpt, text, args.window)
        logits = logits_of(ckpt, prompt)
        if base is None:
            base = dict(logits=logits, out=out, ppl=ppl, rate=rate, ttft=ttft)
            rows.append(("float32", 0.0, len(out), 1.0, ppl, 0.0, rate, 1.0, ttft, 1.0))
            continue
        err = float((np.abs(logits - base["logits"]).max(-1)
                     / np.abs(base["logits"]).max(-1)).max())
        same = next((i for i, (a, b) in enumerate(zip(out, base["out"], strict=True)) if a != b),
                    len(out))
        forced = logits_of(ckpt, prompt + base["out"][:-1])[len(prompt) - 1:].argmax(-1)
        agree = float(np.mean(forced == np.asarray(base["out"])))
        rows.append((mode, err, same, agree, ppl, ppl / base["ppl"] - 1, rate,
                     rate / base["rate"], ttft, ttft / base["ttft"]))
        del ckpt
    print(f"default model, {jax.devices()[0].platform}, {args.tokens} greedy tokens, "
          f"ppl over {len(text)} README tokens (window {args.window}), TTFT of a "
          f"{min(args.prefill_tokens, len(text))}-token prompt")
    print(f"{'weights':9} {'logit err':>10} {'same prefix':>12} {'forced agree':>13} "
          f"{'ppl':>8} {'ppl diff':>9} {'tok/s':>7} {'vs f32':>7} {'TTFT ms':>8} {'vs f32':>7}")
    for mode, err, same, agree, ppl, dppl, rate, ratio, ttft, tratio in rows:
        print(f"{mode:9} {err:10.4f} {same:12d} {agree:13.3f} {ppl:8.3f} {dppl:+9.2%} "
              f"{rate:7.1f} {ratio:7.2f}x {ttft * 1e3:8.0f} {tratio:7.2f}x")


if __name__ == "__main__":
    main()
