"""The parts of the device check (`bench/device_check.py`), each run in a child process.

Every part is `part(config, out) -> dict` with "status" ("pass", "fail" or "skipped"),
"summary" (one line), "details" (JSON-ready) and "markdown" (its section of the report);
raising is a fail (the runner catches it). config: the runner's settings (`tiny`, `tests`,
`limit` seconds, `backend` from `detect`, `server_model`). JAX is imported inside the parts,
never at the top: the runner's own process must not hold the accelerator.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from bench.device_specs import lookup, unknown_reason

ROOT = Path(__file__).resolve().parents[1]


class MissingAPIError(RuntimeError):
    """A JAX API a part needs is absent from the JAX installed."""


def require(part: str, *names: str) -> None:
    """Raises `MissingAPIError` naming the first dotted name (e.g. "jax.block_until_ready")
    that does not resolve: the longest importable module prefix, then attributes."""
    for name in names:
        bits = name.split(".")
        obj: Any = None
        for i in range(len(bits), 0, -1):
            try:
                obj = importlib.import_module(".".join(bits[:i]))
            except ImportError:
                continue
            rest = bits[i:]
            break
        else:
            rest = bits
        try:
            for attr in rest:
                obj = getattr(obj, attr)
        except AttributeError:
            obj = None
        if obj is None:
            raise MissingAPIError(
                f"missing API: the {part} part needs {name}, which JAX "
                f"{_version('jax')} (jaxlib {_version('jaxlib')}) does not have")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# ---- detect -------------------------------------------------------------------------------
PLUGIN = re.compile(r"^(jax[-_]cuda|jax[-_]rocm|libtpu|jax[-_]tpu|jax[-_]plugin)", re.I)


def detect(config: dict, out: Path) -> dict:
    """The backend: platform, device kind and count, versions, plugins, memory, known peaks."""
    require("detect", "jax.devices", "jax.default_backend")
    import jax
    devices = jax.devices()
    dev = devices[0]
    backend = jax.default_backend()
    plugins = sorted({f"{d.metadata['Name']} {d.version}"
                      for d in importlib.metadata.distributions()
                      if PLUGIN.match(d.metadata["Name"] or "")})
    memory = None
    try:
        stats = dev.memory_stats() or {}
        memory = stats.get("bytes_limit")
    except Exception:  # CPU and some plugins do not report memory
        memory = None
    spec = lookup(dev.device_kind)
    details = {"backend": backend, "device_kind": dev.device_kind, "device_count": len(devices),
               "platform_version": getattr(getattr(dev, "client", None), "platform_version", None),
               "jax": jax.__version__, "jaxlib": _version("jaxlib"), "plugins": plugins,
               "python": platform.python_version(), "memory_bytes": memory,
               "spec": spec.to_json() if spec else None,
               "spec_reason": None if spec else unknown_reason(dev.device_kind, backend)}
    gib = f", {memory / 2**30:.1f} GiB" if memory else ""
    summary = (f"{backend}: {len(devices)} x {dev.device_kind}{gib}; JAX {jax.__version__}, "
               f"jaxlib {details['jaxlib']}; plugins: {', '.join(plugins) or 'none'}")
    return {"status": "pass", "summary": summary, "details": details, "markdown": ""}


# ---- tests: the accelerator subset ----------------------------------------------------------
def _absent(module: str) -> bool:
    """True when `module`'s top-level package is not installed at all (torch on a lent
    host), False when it is and only the submodule is missing."""
    import importlib.util
    try:
        return importlib.util.find_spec(module.split(".")[0]) is None
    except ImportError:  # a finder that refuses it
        return True


def junit_counts(path: Path) -> dict:
    """A pytest JUnit XML report's outcome: passed (count), failed and errors ("test: first
    line of the message"), skipped ({reason: count}) and not_collected ({missing module:
    [test modules whose import failed for want of it]})."""
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    failed, errors, missing, skipped = [], [], {}, {}
    passed = 0
    for case in cases:
        name = f"{case.get('classname', '')}::{case.get('name', '')}".strip(":")
        fail, err, skip = case.find("failure"), case.find("error"), case.find("skipped")
        if fail is not None:
            failed.append(f"{name}: {(fail.get('message') or '').splitlines()[0][:200]}")
        elif err is not None:
            text = (err.get("message") or "") + "\n" + (err.text or "")
            found = re.search(r"No module named '([^']+)'", text)
            if found and _absent(found.group(1)):
                missing.setdefault(found.group(1).split(".")[0], []).append(name)
            elif found:  # a package that is there lacks the submodule: an API change
                errors.append(f"{name}: no module {found.group(1)} in the installed "
                              f"{found.group(1).split('.')[0]} (an API that moved?)")
            else:
                errors.append(f"{name}: {(err.get('message') or '').splitlines()[0][:200]}")
        elif skip is not None:
            reason = (skip.get("message") or "")[:160]
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            passed += 1
    return {"passed": passed, "failed": failed, "errors": errors, "skipped": skipped,
            "not_collected": missing}


def marked_files(root: Path = ROOT) -> list[str]:
    """The test files that hold `accelerator` tests: those spelling `mark.accelerator`, and
    tests/models' kernel contract files (tests/conftest.py marks their tests). Collecting
    only these keeps out the rest of the suite's imports (torch, openai, ...)."""
    out = [p for p in sorted((root / "tests").rglob("test_*.py"))
           if "mark.accelerator" in p.read_text(errors="replace")
           or (p.parent.name == "models" and "kernel_contract" in p.name)]
    return [str(p.relative_to(root)) for p in out]


CONFTEST_MISSING = re.compile(r"ImportError while loading conftest '([^']+)'.*?"
                              r"No module named '([^']+)'", re.S)


def _run_logged(cmd: list[str], env: dict, log: Path, deadline: float) -> Any:
    """Runs `cmd` in the repository with its output in `log`, until `deadline`."""
    left = deadline - time.monotonic()
    with log.open("w") as f:
        try:
            return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(1.0, left), start_new_session=True)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"timeout: pytest ran past the part's limit (log: {log})") \
                from None


def tests(config: dict, out: Path) -> dict:
    """`pytest -m accelerator` over `marked_files()` (or the config's selection) in a
    subprocess; its counts."""
    junit = out / "accelerator-tests.xml"
    log = out / "logs" / "pytest.log"
    select = config.get("tests") or marked_files()
    # float32 products at full precision: TPUs (and GPUs' TF32) otherwise round float32
    # matmul inputs, and the float32 fidelity bounds are CPU's; bfloat16 tests are unchanged.
    env = {**os.environ, "JAX_DEFAULT_MATMUL_PRECISION": "highest"}
    deadline = time.monotonic() + max(10, int(config.get("limit", 150)) - 10)
    dropped: dict[str, list[str]] = {}
    while True:
        junit.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-m", "accelerator", "-q", "-p",
               "no:cacheprovider", "--continue-on-collection-errors", f"--junitxml={junit}",
               "-o", "addopts=-ra", *select]
        proc = _run_logged(cmd, env, log, deadline)
        if junit.is_file() or not select:
            break
        # a conftest that needs a module the host lacks (torch) stops the whole run: the
        # files under its folder go to "not collected" and pytest runs again without them
        text = log.read_text()
        found = CONFTEST_MISSING.search(text)
        if found is None:
            raise RuntimeError(f"pytest exited {proc.returncode} with no report:\n"
                               f"{text[-1500:]}")
        if not _absent(found.group(2)):
            raise RuntimeError(f"a conftest needs {found.group(2)}, missing from the installed "
                               f"{found.group(2).split('.')[0]} (an API that moved?):\n"
                               f"{text[-1500:]}")
        folder = Path(found.group(1)).parent.relative_to(ROOT)
        gone = [t for t in select if Path(t.split("::")[0]).is_relative_to(folder)]
        if not gone:
            raise RuntimeError(f"pytest exited {proc.returncode}:\n{text[-1500:]}")
        dropped.setdefault(found.group(2).split(".")[0], []).extend(gone)
        select = [t for t in select if t not in gone]
    counts = junit_counts(junit) if junit.is_file() else {
        "passed": 0, "failed": [], "errors": [], "skipped": {}, "not_collected": {}}
    for module, files in dropped.items():
        counts["not_collected"].setdefault(module, []).extend(files)
    counts["returncode"] = proc.returncode
    counts["command"] = "python " + " ".join(cmd[1:])
    n_missing = sum(len(v) for v in counts["not_collected"].values())
    # exit 1 with nothing failed in the report: only modules not collected (listed)
    status = "fail" if counts["failed"] or counts["errors"] or proc.returncode not in (0, 1, 5) \
        else "pass"
    if not counts["passed"] and not counts["failed"]:
        status = "fail" if status == "fail" else "skipped"
    summary = (f"{counts['passed']} passed, {len(counts['failed'])} failed, "
               f"{len(counts['errors'])} errors, {sum(counts['skipped'].values())} skipped")
    if n_missing:
        summary += (f"; not collected for want of "
                    f"{', '.join(sorted(counts['not_collected']))}: {n_missing}")
    lines = [f"`{counts['command']}` (JAX_DEFAULT_MATMUL_PRECISION=highest)", ""]
    lines += [f"- FAILED {x}" for x in counts["failed"]]
    lines += [f"- ERROR {x}" for x in counts["errors"]]
    lines += [f"- not collected (no module {m}): {', '.join(v)}"
              for m, v in counts["not_collected"].items()]
    lines += [f"- skipped x{n}: {r}" for r, n in counts["skipped"].items()]
    return {"status": status, "summary": summary, "details": counts,
            "markdown": "\n".join(lines)}


# ---- throughput ------------------------------------------------------------------------------
def model_shape(tiny: bool) -> Any:
    """Llama-3.2-1B's shape (random weights), or a tiny one for a quick CPU run."""
    from metrale_jax.config import ModelConfig
    if tiny:  # devtools/hf_models.py's tiny Llama (the suite's shared server serves it)
        return ModelConfig("llama", vocab_size=1024, hidden_size=64, intermediate_size=128,
                           num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                           max_position_embeddings=256)
    return ModelConfig("llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                       num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
                       rope_theta=500000.0, tie_word_embeddings=True,
                       max_position_embeddings=131072)


def engine_shapes(tiny: bool) -> dict:
    """The throughput engine's shapes, which the server part serves too (tiny: those of
    tests/serving's shared server, whose programs the suite's compilation cache may hold)."""
    if tiny:  # batch 1 / 4 / 8 of the suite's shared server's shapes: a quick CPU run
        return dict(batches=(1, 4, 8), context=16, steps=4, max_len=256, prefill=64)
    return dict(batches=(1, 16, 64), context=512, steps=16, max_len=1024, prefill=512)


def _layer_flops_per_token(cfg: Any) -> int:
    E, I, H, K, D = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.head_dim)
    return 2 * (E * H * D + 2 * E * K * D + H * D * E + 3 * E * I)


def throughput(config: dict, out: Path) -> dict:
    """Decode tokens/s at batch 1/16/64 with the achieved fraction of the memory bandwidth
    (weights + KV bytes read per step / step time), and one prefill chunk's fraction of
    peak FLOP/s; random weights."""
    require("throughput", "jax.block_until_ready", "jax.devices", "jax.tree.leaves")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from bench.engine_common import timed_steps
    from metrale_jax.engine import Engine, EngineConfig, SlotSettings
    from metrale_jax.models.transformer import Transformer
    backend = jax.default_backend()
    dtype = "float32" if backend == "cpu" else "bfloat16"
    tiny = bool(config.get("tiny"))
    cfg, sh = model_shape(tiny), engine_shapes(tiny)
    spec = lookup(jax.devices()[0].device_kind)
    reason = None if spec else unknown_reason(jax.devices()[0].device_kind, backend)
    t0 = time.perf_counter()
    model = Transformer(cfg, getattr(jnp, dtype), rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    del model
    slots = max(sh["batches"])
    engine = Engine(cfg, graphdef, params, EngineConfig(
        max_slots=slots, max_len=sh["max_len"], max_prefill_len=sh["prefill"], dtype=dtype))
    del params
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params))
    kv_item = jnp.dtype(engine.config.cache_dtype or dtype).itemsize
    kv_per_pos = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
    build_s = time.perf_counter() - t0
    rows, rng = [], np.random.default_rng(0)
    for b in sh["batches"]:
        state = engine.init_decode_state()
        prompts = [(s, rng.integers(0, cfg.vocab_size, sh["context"]).tolist(), SlotSettings())
                   for s in range(b)]
        for i in range(0, b, engine.config.max_prefill_batch):
            state, _ = engine.add(state, prompts[i:i + engine.config.max_prefill_batch])
        _, dt = timed_steps(engine, state, np.arange(slots) < b, sh["steps"])
        print(f"throughput: batch {b}: {dt / sh['steps'] * 1e3:.2f} ms a step", flush=True)
        step = dt / sh["steps"]
        mean_ctx = sh["context"] + 2 + sh["steps"] / 2
        read = weight_bytes + b * mean_ctx * kv_per_pos
        gbps = read / step / 1e9
        rows.append({"batch": b, "step_ms": step * 1e3, "tokens_per_s": b / step,
                     "bytes_per_step": read, "achieved_gbps": gbps,
                     "bandwidth_fraction": gbps / spec.hbm_gbps if spec else None})
    # prefill: one prompt of a whole chunk, timed after a first (compiling) run
    C = sh["prefill"]
    prompt = rng.integers(0, cfg.vocab_size, C).tolist()
    times = []
    for _ in range(3):
        state = engine.init_decode_state()
        t = time.perf_counter()
        state, first = engine.add(state, [(0, prompt, SlotSettings())])
        jax.block_until_ready(first.tokens)
        times.append(time.perf_counter() - t)
    prefill_s = float(np.median(times[1:]))
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * C * (C + 1) / 2
    flops = C * cfg.num_layers * _layer_flops_per_token(cfg) + attn \
        + 2 * cfg.vocab_size * cfg.hidden_size
    tflops = flops / prefill_s / 1e12
    prefill = {"tokens": C, "seconds": prefill_s, "tokens_per_s": C / prefill_s,
               "flops": flops, "achieved_tflops": tflops,
               "flops_fraction": tflops / spec.bf16_tflops if spec else None}
    details = {"model": "tiny llama" if tiny else "Llama-3.2-1B shape (random weights)",
               "dtype": dtype, "weight_bytes": weight_bytes, "kv_bytes_per_position":
               kv_per_pos, "context": sh["context"], "timed_steps": sh["steps"],
               "build_seconds": build_s, "compile_count": engine.compile_count,
               "decode": rows, "prefill": prefill,
               "spec": spec.to_json() if spec else None, "fraction_reason": reason}

    def frac(v: float | None) -> str:
        return "null" if v is None else f"{v:.1%}"

    md = [f"{details['model']}, {dtype}, {weight_bytes / 2**20:.1f} MiB of weights, context "
          f"{sh['context']}; fractions against "
          f"{spec.name if spec else 'nothing: ' + str(reason)}", "",
          "| batch | step ms | tokens/s | GB/s read | of peak bandwidth |",
          "|---:|---:|---:|---:|---:|"]
    md += [f"| {r['batch']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.1f} | "
           f"{r['achieved_gbps']:.2f} | {frac(r['bandwidth_fraction'])} |" for r in rows]
    md += ["", f"prefill of {C} tokens: {prefill_s * 1e3:.1f} ms, {C / prefill_s:.0f} tokens/s, "
               f"{tflops:.3f} TFLOP/s, {frac(prefill['flops_fraction'])} of peak"]
    summary = ", ".join(f"b{r['batch']} {r['tokens_per_s']:.0f} tok/s "
                        f"({frac(r['bandwidth_fraction'])} bw)" for r in rows)
    return {"status": "pass", "summary": summary + f"; prefill {frac(prefill['flops_fraction'])}"
            " of peak FLOP/s", "details": details, "markdown": "\n".join(md)}
