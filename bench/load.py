"""How long `load_checkpoint("default")` takes: the gguf library's reading against the fast one.

Each measurement is a fresh Python process (as a server's start is), the GGUF file already in
the page cache (one untimed load first). The two readers alternate, round after round, so both
see the same machine: "library" is `read_gguf(..., reference=True)` (`gguf.GGUFReader` and
`gguf.quants.dequantize`, the reading before #38), "fast" the default (`gguf_header` and
gguf's row codecs on large chunks). Each process times the first `load_checkpoint("default")`
(config, params on the device, tokenizer) and then `read_gguf` alone. Prints one markdown table:
every round, then the medians and their ratio.

    .venv/bin/python bench/load.py
    .venv/bin/python bench/load.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

READERS = ("library", "fast")


def child(reader: str) -> None:
    """Runs in the measured process: prints `{"load": s, "read_gguf": s}` as JSON."""
    import functools

    import metrale_jax.weights.checkpoint as checkpoint
    from metrale_jax.weights.default_model import default_model_path
    from metrale_jax.weights.gguf_reader import read_gguf

    reference = reader == "library"
    checkpoint.read_gguf = functools.partial(read_gguf, reference=reference)  # type: ignore
    t0 = time.perf_counter()
    ckpt = checkpoint.load_checkpoint("default")
    load = time.perf_counter() - t0
    del ckpt
    t0 = time.perf_counter()
    read_gguf(default_model_path(), reference=reference)
    print(json.dumps({"load": load, "read_gguf": time.perf_counter() - t0}))


def measure(reader: str) -> dict[str, float]:
    """One fresh process of `reader`; its figures."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS=os.environ.get(
        "JAX_PLATFORMS", "cpu"))
    out = subprocess.run([sys.executable, __file__, "--child", reader], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=READERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    measure("fast")  # the file into the page cache
    rows: dict[str, list[dict[str, float]]] = {r: [] for r in READERS}
    print("| round | reader | load_checkpoint s | read_gguf s |")
    print("|---|---|---|---|")
    for i in range(1, args.rounds + 1):
        for reader in READERS if i % 2 else reversed(READERS):
            got = measure(reader)
            rows[reader].append(got)
            print(f"| {i} | {reader} | {got['load']:.2f} | {got['read_gguf']:.2f} |", flush=True)
    med = {r: {k: statistics.median(x[k] for x in rows[r]) for k in ("load", "read_gguf")}
           for r in READERS}
    for r in READERS:
        print(f"| median | {r} | {med[r]['load']:.2f} | {med[r]['read_gguf']:.2f} |")
    print(f"| library / fast | | {med['library']['load'] / med['fast']['load']:.1f}x | "
          f"{med['library']['read_gguf'] / med['fast']['read_gguf']:.1f}x |")


if __name__ == "__main__":
    main()
