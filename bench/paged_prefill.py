"""Long prompts beside a decoding stream: this checkout's engine and an older commit's, one run.

For each engine (a child process importing `metrale_jax` from its checkout): the default
model through `LLM` (max_slots 4, max_len 8192, max_prefill_len 512, every program compiled
first). One greedy stream decodes; once it has made 16 tokens a prompt of 512 / 2,048 /
8,000 random tokens arrives (max_tokens 1). Measured: the prompt's time to first token, its
prompt tokens/s, and the longest gap between two tokens of the decoding stream while the
prompt was being prefilled (in seconds and in the stream's median inter-token times); and the
same prompt's tokens/s with nothing decoding (the throughput the latency target must keep).
One unmeasured request goes first; each length then runs once alone and once beside the
stream. Each engine runs with its defaults (this checkout: the latency target,
`--max-itl-ms` 300). The engines run one after the other, alternating lengths is not possible
across processes: run it on a quiet machine. Prints one table.

    .venv/bin/python bench/paged_prefill.py --old /tmp/old-engine [--lengths 512,2048]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
LENGTHS = (512, 2048, 8000)


def _beside_stream(scheduler, rng, n: int) -> dict:
    """One greedy stream decodes; after its 16th token an `n`-token prompt arrives: its time
    to first token, the stream's longest gap meanwhile and its median gap before."""
    from metrale_jax import SamplingParams
    from metrale_jax.scheduler import GenerationRequest
    from metrale_jax.scheduler.events import Token

    times: list[float] = []
    started = threading.Event()
    stream = scheduler.submit(GenerationRequest.make(
        rng.integers(100, 40000, 32).tolist(),
        SamplingParams(max_tokens=8192 - 64, temperature=0.0, ignore_eos=True)))

    def read(handle=stream, times=times, started=started) -> None:
        for event in handle:
            if isinstance(event, Token) and event.token_ids:
                times.append(time.perf_counter())
                if len(times) == 16:
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    started.wait()
    t0 = time.perf_counter()
    long = scheduler.submit(GenerationRequest.make(
        rng.integers(100, 40000, n).tolist(),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    first = None
    for event in long:
        if isinstance(event, Token) and event.token_ids and first is None:
            first = time.perf_counter()
    # A few more stream tokens after the prompt's first, then stop the stream.
    while len([t for t in times if t > first]) < 8:
        time.sleep(0.05)
    stream.cancel()
    reader.join()
    before = [b - a for a, b in itertools.pairwise(times) if b <= t0]
    during = [b - a for a, b in itertools.pairwise(times)
              if b > t0 and a < first + 1e-9]
    stall = max(during) if during else first - t0
    tpot = statistics.median(before)
    return {"ttft": first - t0, "stall": stall, "tpot": tpot}


def _child(root: str, lengths: tuple[int, ...]) -> None:
    sys.path.insert(0, root)  # the checkout under test: imported only after this
    import numpy as np

    from metrale_jax import LLM, SamplingParams
    from metrale_jax.scheduler import GenerationRequest
    from metrale_jax.scheduler.events import Token

    llm = LLM("default", max_slots=4, max_len=8192, max_prefill_len=512, warmup=True)
    scheduler = llm.scheduler
    rng = np.random.default_rng(0)
    # One request first: the first after warmup pays one-time costs (allocations, caches).
    for _ in scheduler.submit(GenerationRequest.make(
            rng.integers(100, 40000, 512).tolist(), SamplingParams(max_tokens=4))):
        pass
    out = {}
    for n in lengths:
        t0 = time.perf_counter()  # nothing decoding: the prompt alone
        for event in scheduler.submit(GenerationRequest.make(
                rng.integers(100, 40000, n).tolist(),
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))):
            if isinstance(event, Token) and event.token_ids:
                alone = time.perf_counter() - t0
                break
        out[str(n)] = {**_beside_stream(scheduler, rng, n), "alone": alone}
    llm.close()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None,
                    help="checkout of the older engine (a worktree); without it, this one only")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="prompt lengths, comma-separated (default 512,2048,8000)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    lengths = tuple(int(x) for x in args.lengths.split(","))
    if args.child:
        _child(args.child, lengths)
        return
    roots = {"old": args.old, "new": str(HERE)} if args.old else {"new": str(HERE)}
    got = {}
    for name, root in roots.items():
        env = dict(os.environ)
        env.setdefault("METRALE_CHECKPOINTS", str(HERE / "checkpoints"))
        res = subprocess.run([sys.executable, __file__, "--child", root, "--lengths",
                              args.lengths], cwd=root, env=env, capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(f"{name} failed:\n{res.stderr[-3000:]}")
        got[name] = json.loads(res.stdout.strip().splitlines()[-1])
    print("| prompt tokens | engine | time to first token beside a stream | prompt tok/s "
          "beside it | longest stall of the stream | prompt tok/s alone |\n"
          "|---|---|---|---|---|---|")
    for n in lengths:
        for name in roots:
            r = got[name][str(n)]
            print(f"| {n} | {name} | {r['ttft']:.2f} s | {n / r['ttft']:.0f} | "
                  f"{r['stall']:.2f} s ({r['stall'] / r['tpot']:.1f}x its median gap) | "
                  f"{n / r['alone']:.0f} |")
    for name in roots:
        base = lengths[0] / got[name][str(lengths[0])]["ttft"]
        ratios = " / ".join(f"{n / got[name][str(n)]['ttft'] / base:.2f}" for n in lengths[1:])
        print(f"{name}: prompt tok/s beside a stream of {lengths[1:]} tokens over that of "
              f"{lengths[0]}: {ratios}")
    if "old" in roots:
        ratios = " / ".join(f"{got['old'][str(n)]['alone'] / got['new'][str(n)]['alone']:.2f}"
                            for n in lengths)
        print(f"prompt tok/s alone, new over old, at {lengths}: {ratios}")


if __name__ == "__main__":
    main()
