"""Translation throughput of an NLLB-shaped model, against transformers' `generate` in one run.

A random M2M100 with NLLB-200-distilled-600M's shape (d_model 1024, 12 + 12 layers, 16
heads, FFN 4096, vocabulary 256,206; float32 on both sides; `--small` for a quarter-width
model that runs in seconds) and a tiny real NLLB tokenizer. 8 sentences translated
concurrently, greedy (num_beams 1) and beam search (num_beams 4), `--max-tokens` new tokens
(random weights rarely say eos, so nearly every translation runs to the limit).
Ours: one `LLM` with 32 rows (8 requests x 4 beams): the encoder runs once per request at
admission, decoder rows decode in the ragged paged steps and beams fork their pages;
transformers: one batched `generate(forced_bos_token_id=...)` (right-padded sources).
Prints sentences/s and generated tokens/s of each, their ratio, and how many of the 8
translations have transformers' ids.

    .venv/bin/python bench/translate.py
    .venv/bin/python bench/translate.py --small --max-tokens 48 --rounds 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.tables import print_beams_table

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, how are you today?",
    "Machine translation is useful for reading news in other languages.",
    "Translation models map sentences between many languages.",
    "The dog jumps over the fox.",
    "How are you?",
    "Reading the news in other languages is useful.",
    "The lazy dog sleeps today.",
]
NLLB_600M = dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                 decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                 vocab_size=256206, max_position_embeddings=1024, scale_embedding=True)
SMALL = dict(NLLB_600M, d_model=256, encoder_ffn_dim=1024, decoder_ffn_dim=1024,
             encoder_layers=6, decoder_layers=6, vocab_size=32000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2, help="timed runs per case (median)")
    p.add_argument("--small", action="store_true", help="a quarter-width 6 + 6 layer model")
    args = p.parse_args()

    # heavy imports after parsing: --help starts at once
    import torch
    import transformers

    from devtools.nllb_models import nllb_config, randomize, write_nllb_tokenizer
    from metrale_jax import LLM, SamplingParams

    shape = SMALL if args.small else NLLB_600M
    folder = Path(tempfile.mkdtemp(prefix="nllb-bench-"))
    pieces = write_nllb_tokenizer(folder)
    hf = transformers.M2M100ForConditionalGeneration(nllb_config(pieces, **shape)).eval()
    randomize(hf, 0, scale=0.05)
    hf.save_pretrained(folder)
    torch.set_flush_denormal(True)
    llm = LLM(folder, max_slots=32, max_len=64, max_source_len=32, max_prefill_len=64,
              max_prefill_batch=8, source_lang="eng_Latn", target_lang="fra_Latn")
    tok = llm.tokenizer
    sources = [tok.encode_source(s, "eng_Latn") for s in SENTENCES]
    width = max(map(len, sources))
    batch = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in sources])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sources])
    eos = [2]

    def ours(beams: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, num_beams=beams)
        return [list(c.token_ids) for c in llm.translate(SENTENCES, sampling_params=params)]

    def theirs(beams: int) -> list[list[int]]:
        with torch.no_grad():
            out = hf.generate(batch, attention_mask=mask, num_beams=beams, do_sample=False,
                              max_new_tokens=args.max_tokens + 1, pad_token_id=1,
                              eos_token_id=eos, forced_bos_token_id=tok.lang_id("fra_Latn"))
        rows = []
        for row in out[:, 2:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            rows.append(row[:cut])
        return rows

    size = sum(p.numel() for p in hf.parameters()) / 1e6
    print(f"\n8 sentences, at most {args.max_tokens} new tokens, random M2M100 of {size:.0f}M "
          f"params ({'small' if args.small else 'NLLB-200-distilled-600M'} shape), float32, "
          f"median of {args.rounds}\n")
    print_beams_table(ours, theirs, args.rounds, count=8)
    llm.close()


if __name__ == "__main__":
    main()
