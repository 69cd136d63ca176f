"""Speculative decoding with prompt lookup, on and off: single-stream decode speed on the default
model.

One engine (`LLM("default", max_slots=1, speculative_tokens=K)`, float32, or int8 weights with
`--quantization int8` where the engine has that option) serves each workload twice, one request
at a time, greedy: once with `speculative_tokens=0` (plain decoding) and once with K; the order
alternates between repeats. Workloads (chat template of the default model):

1. copying: "repeat this text" over a ~300-token passage (the output copies from the prompt, as
   summaries, edits and quotes do);
2. free: an open question (the output rarely repeats itself).

Decode tok/s = (tokens - 1) / (time of the last token - time of the first token): prefill is
left out. The acceptance rate is accepted / drafted tokens (the scheduler's counters). The
texts must be equal (greedy is exact with or without speculation); the table says if not.

    .venv/bin/python bench/speculative.py
    .venv/bin/python bench/speculative.py --tokens 4 --max-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PASSAGE = (
    "Metrale-JAX is an inference server for large language models written with JAX and Flax "
    "NNX. The models run as pure jit-compiled steps over a fixed grid of shapes, a host loop "
    "feeds them, and an asynchronous HTTP layer speaks the OpenAI API to the world. The key "
    "and value cache is stored in pages: per layer one pool of fixed-size pages, and a page "
    "table per sequence says which pages hold its positions. One ragged step runs every "
    "decoding sequence's next token together with chunks of the prompts that wait, so a long "
    "prompt never stops the sequences that decode. Full pages are cached by their content and "
    "shared by the prompts that start with them. Sampling runs on the device, per sequence, "
    "with the sequence's own random key folded with its step index, so a seeded request gives "
    "the same tokens whatever else is in the batch. Every request parameter is data, never a "
    "static argument, so no request causes a compile. Warm-up compiles every shape before the "
    "server answers, and the persistent compilation cache makes a second start fast.")
WORKLOADS = {
    "copying": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "free": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def run_one(llm, prompt_ids: list[int], k: int, max_tokens: int) -> dict:
    """One greedy request: decode tok/s (first to last token), tokens, text and counters."""
    # beside main's LLM import: nothing of JAX before --help
    from metrale_jax.scheduler import Failed, GenerationRequest, SamplingParams, Token
    sched = llm.scheduler
    before = dict(sched.stats)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative_tokens=k)
    handle = sched.submit(GenerationRequest.make(prompt_ids, params))
    times, ids, text = [], [], []
    for event in handle:
        if isinstance(event, Token):
            now = time.perf_counter()
            times += [now] * len(event.token_ids)
            ids += list(event.token_ids)
            text.append(event.text)
        elif isinstance(event, Failed):
            raise event.error
    after = sched.stats
    span = times[-1] - times[0]
    return {"rate": (len(ids) - 1) / span if span > 0 else float("nan"), "tokens": len(ids),
            "text": "".join(text),
            "drafted": after.get("spec_drafted", 0) - before.get("spec_drafted", 0),
            "accepted": after.get("spec_accepted", 0) - before.get("spec_accepted", 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4, help="K, draft tokens per step")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--quantization", default=None, help="e.g. int8 (if the engine has it)")
    args = ap.parse_args()

    # heavy imports after parsing: --help starts at once
    from metrale_jax import LLM
    extra = {"quantization": args.quantization} if args.quantization else {}
    llm = LLM("default", max_slots=1, max_len=args.max_len, speculative_tokens=args.tokens,
              **extra)
    t0 = time.perf_counter()
    llm.warmup()
    print(f"# warmup {time.perf_counter() - t0:.1f} s; default model, K={args.tokens}, "
          f"{args.max_tokens} tokens max, greedy, {args.repeats} repeats (median)",
          file=sys.stderr)
    rows = []
    for name, question in WORKLOADS.items():
        ids = llm.tokenizer.encode(llm.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True))
        run_one(llm, ids, 0, 8)  # the first request's one-off costs
        results: dict[int, list[dict]] = {0: [], args.tokens: []}
        for r in range(args.repeats):
            order = (0, args.tokens) if r % 2 == 0 else (args.tokens, 0)
            for k in order:
                results[k].append(run_one(llm, ids, k, args.max_tokens))
        plain = statistics.median(x["rate"] for x in results[0])
        spec = statistics.median(x["rate"] for x in results[args.tokens])
        drafted = sum(x["drafted"] for x in results[args.tokens])
        accepted = sum(x["accepted"] for x in results[args.tokens])
        same = all(a["text"] == b["text"] for a, b in zip(results[0], results[args.tokens],
                                                          strict=True))
        rows.append((name, len(ids), results[0][0]["tokens"], plain, spec, spec / plain,
                     accepted / drafted if drafted else float("nan"),
                     drafted / max(1, sum(x["tokens"] for x in results[args.tokens])), same))
    llm.close()
    head = ("workload", "prompt", "tokens", "plain tok/s", "lookup tok/s", "speedup",
            "accepted", "drafts/token", "same text")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name, p, n, a, b, s, acc, dpt, same in rows:
        print(f"| {name} | {p} | {n} | {a:.1f} | {b:.1f} | {s:.2f}x | {acc:.0%} | {dpt:.2f} | "
              f"{'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
