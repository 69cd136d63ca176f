"""`metrale convert`: a checkpoint (HF folder, GGUF, default) into Metrale's orbax format."""

from __future__ import annotations

import argparse

from metrale_jax.errors import MetraleError


def cmd_convert(args: argparse.Namespace) -> int:
    """Converts a checkpoint (HF folder, GGUF, default) into Metrale's orbax format."""
    from pathlib import Path

    from metrale_jax.weights.checkpoint import load_checkpoint
    from metrale_jax.weights.orbax_store import save_orbax
    from serving.progress import StageProgress, progress_kwargs, stage
    if Path(args.dst).expanduser().exists():  # before the slow part
        raise MetraleError(f"{args.dst}: already exists; choose a new folder")
    with StageProgress() as progress:
        with stage(progress, "loading weights") as step:
            ckpt = load_checkpoint(args.src, args.dtype, quantization=args.quantization,
                                   **progress_kwargs(load_checkpoint, step))
        with stage(progress, "writing orbax checkpoint") as step:
            out = save_orbax(ckpt, args.dst, **progress_kwargs(save_orbax, step))
    print(out)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale convert`."""
    from serving.cli.scale import add_quantization_flag
    conv = sub.add_parser("convert", help="convert a checkpoint to Metrale's orbax format")
    conv.add_argument("src", help="'default', a HF folder, a .gguf file, or a "
                      "Hugging Face name org/repo[:QUANT][@revision]")
    conv.add_argument("dst", help="output folder (must not exist)")
    conv.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                      help="params dtype to store (default float32)")
    add_quantization_flag(conv)  # stores the quantized arrays: no float copy to load
    conv.set_defaults(func=cmd_convert)
