"""Beam search throughput on the default model, against transformers' `generate` in the same run.

SmolLM2-135M-Instruct (the default GGUF, float32 on both sides): 8 concurrent prompts, greedy
(num_beams 1) and beam search (num_beams 4), `--max-tokens` new tokens at most. Ours: one
`LLM` with 32 rows (8 requests x 4 beams) serving the 8 requests together (beam rows decode
in the decode tier; a forked beam shares its parent's full pages and copies the last one);
transformers: one
batched `generate` (left padding). Prints sentences/s and generated tokens/s of each, their
ratio, and how many of the 8 answers have transformers' ids (batched padding may move a near
tie; `tests/scheduler/test_beam_search.py` checks equality unbatched).

    .venv/bin/python bench/beam_search.py
    .venv/bin/python bench/beam_search.py --max-tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tables import print_beams_table

PROMPTS = [
    "The capital of France is", "Photosynthesis is the process by which",
    "In 1969, the first humans", "A good way to learn a language is",
    "The main ingredients of bread are", "Water boils at a temperature of",
    "The largest planet in the solar system is", "To make a cup of tea, first",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="timed runs per case (median)")
    args = p.parse_args()

    # heavy imports after parsing: --help starts at once
    import torch
    from transformers import AutoModelForCausalLM

    from metrale_jax import LLM, SamplingParams
    from metrale_jax.weights.default_model import default_model_path

    gguf = default_model_path()
    llm = LLM("default", max_slots=32, max_len=256, max_prefill_len=256, max_prefill_batch=32)
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                              dtype=torch.float32).eval()
    torch.set_flush_denormal(True)
    ids = [llm.tokenizer.encode(t) for t in PROMPTS]
    eos = list(llm.scheduler.eos_token_ids)
    width = max(len(i) for i in ids)
    batch = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])

    def ours(beams: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, num_beams=beams)
        return [list(c.token_ids) for c in llm.generate(ids, params)]

    def theirs(beams: int) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(batch, attention_mask=mask, num_beams=beams, do_sample=False,
                              max_new_tokens=args.max_tokens, pad_token_id=0,
                              eos_token_id=eos)
        rows = []
        for row in out[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    print(f"\n8 prompts, at most {args.max_tokens} new tokens, default model float32, "
          f"median of {args.rounds}\n")
    print_beams_table(ours, theirs, args.rounds, count=8)
    llm.close()


if __name__ == "__main__":
    main()
