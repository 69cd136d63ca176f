"""Max relative logit error against transformers, per architecture, in float32 and bfloat16.

    python bench/fidelity.py            # tiny random models of every architecture
    python bench/fidelity.py --default  # also the default model (needs `metrale pull`)

Error = max|ours - transformers| / max|transformers| over random prompts; the reference is
transformers on PyTorch in float32 on the CPU.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM

from devtools.hf_models import ARCH_CONFIGS, build_hf_model
from devtools.logits import stacked_logits
from metrale_jax.weights.assemble import assemble_params
from metrale_jax.weights.checkpoint import load_checkpoint
from metrale_jax.weights.default_model import default_model_path
from metrale_jax.weights.hf_config import read_hf_config


def rel_error(graphdef, params, hf, ids: np.ndarray) -> float:
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.float().numpy()
    ours = stacked_logits(graphdef, params, ids)  # the engine's prefill, one chunk per row
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--default", action="store_true", help="also measure the default model")
    args = ap.parse_args()
    rows = []
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for arch in sorted(ARCH_CONFIGS):
            folder = Path(tmp) / arch
            hf = build_hf_model(arch, folder)
            cfg = read_hf_config(folder)
            tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
            ids = rng.integers(0, cfg.vocab_size, size=(2, 32))
            errs = []
            for dtype in (jnp.float32, jnp.bfloat16):
                g, p = assemble_params(cfg, tensors, arch, dtype)
                errs.append(rel_error(g, p, hf, ids))
            rows.append((arch, *errs))
    if args.default:

        path = default_model_path()
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  torch_dtype=torch.float32).eval()
        ids = rng.integers(0, 49152, size=(1, 64))
        errs = []
        for dtype in ("float32", "bfloat16"):
            t0 = time.perf_counter()
            ck = load_checkpoint("default", dtype)
            print(f"default model load ({dtype}): {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr)
            errs.append(rel_error(ck.graphdef, ck.params, hf, ids))
        rows.append(("default (SmolLM2 GGUF)", *errs))
    print(f"| {'architecture':24} | float32  | bfloat16 |")
    print(f"|{'-' * 26}|----------|----------|")
    for name, e32, e16 in rows:
        print(f"| {name:24} | {e32:.1e}  | {e16:.1e}  |")


if __name__ == "__main__":
    main()
