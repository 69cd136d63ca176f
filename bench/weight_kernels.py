"""The weight products of a decode step, by weight format: float32, int8 and int4, on the CPU.

    python bench/weight_kernels.py                 # rows 1, 4 and 5; 30 layers
    python bench/weight_kernels.py --rows 1 --repeats 41

The default model's (SmolLM2-135M) seven products per layer (q, k, v, o, gate, up, down) for
`--layers` layers, each with its own random weights (so they stream from memory as a model's
do), chained in one jitted program per format; per row count, the formats alternate run by
run and the table gives each one's median ms per step and its speed against float32:
- float32: XLA's dot;
- int8: the C++ kernel (`kernels/int8_matmul.py`), per-output-channel scales;
- int4: the C++ kernel (`kernels/int4_matmul.py`), blocks of 32 with float16 (d, m);
- int4, XLA form: the dequantized weight's float dot (what meshes, TPU and GPU run).
The "weights MB" column is the bytes a step reads. A "resident" row repeats one layer's
weights `--layers` times: they stay in cache, so it shows the kernels' arithmetic alone.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metrale_jax.kernels import int4_matmul, int8_matmul
from metrale_jax.models.quant import quantize
from metrale_jax.models.quant4 import dequantize4, quantize4

SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536),
          (1536, 576)]  # [in, out]: q, k, v, o, gate, up, down


def weights(layers: int, distinct: int, seed: int = 0) -> dict[str, list]:
    """Per format, the `layers * 7` weights (`distinct` layers' worth, repeated)."""
    rng = np.random.default_rng(seed)
    out: dict[str, list] = {"float32": [], "int8": [], "int4": []}
    for _ in range(distinct):
        for k, n in SHAPES:
            w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
            out["float32"].append(jnp.asarray(w))
            out["int8"].append(tuple(map(jnp.asarray, quantize(w, (0,)))))
            out["int4"].append(tuple(map(jnp.asarray, quantize4(w, (0,)))))
    return {f: (ws * layers)[:layers * len(SHAPES)] for f, ws in out.items()}


def step(fmt: str):
    """A jitted chain of the products in format `fmt` (each fed x's first `in` columns)."""
    def run(x, ws):
        acc = jnp.zeros((), jnp.float32)
        for i, w in enumerate(ws):
            k = SHAPES[i % len(SHAPES)][0]
            xi = x[:, :k]
            if fmt == "float32":
                y = xi @ w
            elif fmt == "int8":
                y = int8_matmul.int8_matmul(xi, *w)
            elif fmt == "int4":
                y = int4_matmul.int4_matmul(xi, *w)
            else:  # int4, XLA's form
                y = xi @ dequantize4(*w).T
            acc = acc + y.sum()
        return acc
    return jax.jit(run)


def nbytes(ws) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(ws))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 5])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args()
    assert int8_matmul.available() and int4_matmul.available(), "the kernels need g++"
    fmts = ["float32", "int8", "int4", "int4 (XLA)"]
    print(f"{args.layers} layers of the default model's products, {os.cpu_count()} CPUs, "
          f"median of {args.repeats}, ms per step")
    print(f"{'weights':11} {'rows':>5} " + " ".join(f"{f:>16}" for f in fmts))
    for label, distinct in (("streamed", args.layers), ("resident", 1)):
        ws = weights(args.layers, distinct)
        ws["int4 (XLA)"] = ws["int4"]
        runs = {f: step(f if f != "int4 (XLA)" else "xla4") for f in fmts}
        mb = {f: nbytes(ws[f]) / 2 ** 20 / (args.layers / distinct) for f in fmts}
        for m in args.rows:
            x = jnp.asarray(np.random.default_rng(m).standard_normal((m, 1536)), jnp.float32)
            times: dict[str, list[float]] = {f: [] for f in fmts}
            for f in fmts:
                runs[f](x, ws[f]).block_until_ready()
            for _ in range(args.repeats):
                for f in fmts:
                    t = time.perf_counter()
                    runs[f](x, ws[f]).block_until_ready()
                    times[f].append(time.perf_counter() - t)
            med = {f: float(np.median(t)) * 1e3 for f, t in times.items()}
            cells = " ".join(f"{med[f]:7.2f} ({med['float32'] / med[f]:4.2f}x)" for f in fmts)
            print(f"{label:11} {m:5d} {cells}")
        if label == "streamed":
            print(f"{'weights MB':17} " + " ".join(f"{mb[f]:16.1f}" for f in fmts))


if __name__ == "__main__":
    main()
