"""Stored transformers references for the fidelity tests on a host without torch.

A lent TPU or GPU host brings transformers but not torch, so `tests/models/test_fidelity_hf.py`
cannot build its tiny models or their references there. This module writes, for each family
`make device-check` runs (`FAMILIES`), the tiny model of `devtools/hf_models.py` into
`tests/data/fidelity/<family>/` (config.json, model.safetensors) and transformers' float32
logits on fixed prompts into `references.npz` beside it; `tests/models/test_fidelity_stored.py`
compares our logits with them, torch-free.

The weights are stored in float16 to keep the folder small (about 0.4 MB a family): the model
is `build_hf_model`'s with every parameter rounded to float16, and the references are
transformers' float32 logits of that rounded model, so loading the float16 file in float32
gives exactly the model the references were computed from.

    python -m devtools.fidelity_references      # regenerate (needs torch and transformers)

`tests/models/test_fidelity_hf.py::test_stored_references_are_current` checks, where torch is
there, that the stored logits still equal what transformers gives for the stored folder.
Importing this module needs neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "fidelity"
FAMILIES = ("llama3", "qwen3")  # `make device-check` runs these two families
LENGTHS = (1, 7, 24)  # prompt lengths, two rows each: test_fidelity_hf.py's FULL_LENGTHS
ROWS = 2
PROMPT_SEED = 1  # test_fidelity_hf.py's whole-prompt test draws its prompts so
REFERENCES = "references.npz"
KEEP = ("config.json", "model.safetensors", REFERENCES)


def prompts(vocab_size: int) -> dict[int, np.ndarray]:
    """The fixed prompts: {length: ids `[ROWS, length]` int32} for each of `LENGTHS`, drawn in
    order from `np.random.default_rng(PROMPT_SEED)` (the same ids test_fidelity_hf.py's
    whole-prompt test draws)."""
    rng = np.random.default_rng(PROMPT_SEED)
    return {n: rng.integers(0, vocab_size, size=(ROWS, n)).astype(np.int32) for n in LENGTHS}


def load_references(folder: Path) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """A stored folder's references: {length: (ids `[ROWS, length]` int32, transformers'
    logits `[ROWS, length, vocab]` float32)}."""
    with np.load(folder / REFERENCES) as z:
        return {n: (z[f"ids_{n}"], z[f"logits_{n}"]) for n in LENGTHS}


def transformers_logits(folder: Path, ids: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
    """transformers' float32 logits of the model saved in `folder` (loaded in float32) on
    each prompt batch of `ids` ({length: `[B, length]`} -> {length: `[B, length, V]`});
    needs torch."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return {n: model(torch.tensor(x, dtype=torch.long)).logits.float().numpy()
                for n, x in ids.items()}


def write_family(arch: str, folder: Path) -> None:
    """Writes `arch`'s tiny model (float16 weights) and its references into `folder`
    (replacing what is there); needs torch."""
    import torch

    from devtools.hf_models import build_hf_model

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    model = build_hf_model(arch, folder)
    with torch.no_grad():
        model.to(torch.float16)
    model.save_pretrained(folder)
    for extra in folder.iterdir():  # generation_config.json: not read by the tests
        if extra.name not in KEEP:
            extra.unlink()
    ids = prompts(model.config.vocab_size)
    logits = transformers_logits(folder, ids)
    np.savez_compressed(folder / REFERENCES, **{f"ids_{n}": x for n, x in ids.items()},
                        **{f"logits_{n}": v for n, v in logits.items()})


def main(argv: list[str] | None = None) -> None:
    """Regenerates `tests/data/fidelity/` (or `--out`) for `FAMILIES` (or those named)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help=f"some of {', '.join(FAMILIES)}")
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args(argv)
    unknown = set(args.families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}: choose from {', '.join(FAMILIES)}")
    for arch in args.families or FAMILIES:
        write_family(arch, args.out / arch)
        size = sum(p.stat().st_size for p in (args.out / arch).iterdir())
        print(f"{args.out / arch}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
