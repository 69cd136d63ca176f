"""What each compiled program of a warmed engine keeps resident (issue 38's memory goal).

    python bench/program_memory.py --quantization int4 --slots 4 --max-len 512
    python bench/program_memory.py --cache warm --cache-dir /tmp/pm-cache   # a second run
    python bench/program_memory.py --random --layers 30                    # bench's random model

Builds the engine as `metrale serve` does (the checkpoint via `load_checkpoint` with the
placement hook, then `Engine`), or from bench/engine_common's random model, then compiles the
programs `Engine.warmup` compiles one at a time, printing after each: the process's resident
memory (VmRSS), its anonymous executable mappings (the generated machine code), glibc's heap
(`mallinfo2`: bytes in use, free bytes the heap keeps), and the program's own figures from
`Compiled.memory_analysis()` (generated code, arguments, outputs, aliased, temporaries) and
the constants folded into its optimized HLO (`Compiled.as_text()`). Then it tries what might
give memory back: `malloc_trim(0)`, `jax.clear_caches()` + `gc.collect()`, and dropping the
engine's executables, and prints the RSS after each.

`--cache off|cold|warm`: the persistent compilation cache off, a fresh empty folder, or
`--cache-dir` as it is (run once with `cold` and the same `--cache-dir` first). XLA flags go
through the XLA_FLAGS environment variable as usual.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

MB = 1e6
CONSTANT = re.compile(r"=\s*(\w+)\[([\d,]*)\][^ ]*\s+constant\(")
DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
               "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "s4": 0.5, "u4": 0.5}


class MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (every field a size_t)."""

    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


LIBC = ctypes.CDLL("libc.so.6")
LIBC.mallinfo2.restype = MallInfo2


def memory() -> dict[str, float]:
    """The process's memory now, in MB: rss (VmRSS), anon and file (its anonymous and
    file-backed parts: RssAnon, RssFile), code (resident anonymous executable
    mappings: JIT-generated code), heap_used and heap_free (glibc's bytes in use, mmapped
    chunks included, and free bytes it keeps)."""
    status = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            status[key] = int(rest.split()[0]) * 1024 / MB
    code = 0.0
    executable_anon = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            executable_anon = "x" in fields[1] and len(fields) < 6
        elif executable_anon and fields[0] == "Rss:":
            code += int(fields[1]) * 1024 / MB
    info = LIBC.mallinfo2()
    return {"rss": status["VmRSS"], "anon": status["RssAnon"], "file": status["RssFile"],
            "code": code, "heap_used": (info.uordblks + info.hblkhd) / MB,
            "heap_free": info.fordblks / MB}


def hlo_constants(text: str) -> tuple[int, float, float]:
    """(count, total MB, largest MB) of the constants in an optimized HLO text."""
    sizes = []
    for dtype, dims in CONSTANT.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        sizes.append(n * DTYPE_BYTES.get(dtype, 4) / MB)
    return len(sizes), sum(sizes), max(sizes, default=0.0)


def program_figures(exe: Any) -> dict[str, float]:
    """A compiled program's own figures in MB: generated code, arguments, outputs, aliased,
    temporaries (`memory_analysis()`), and its HLO constants (count, MB, largest MB)."""
    out: dict[str, float] = {}
    try:
        m = exe.memory_analysis()
        out.update(code=m.generated_code_size_in_bytes / MB, args=m.argument_size_in_bytes / MB,
                   outs=m.output_size_in_bytes / MB, alias=m.alias_size_in_bytes / MB,
                   temp=m.temp_size_in_bytes / MB)
    except Exception as e:  # not every backend reports it
        print(f"  memory_analysis: {type(e).__name__}: {e}")
    try:
        text = exe.as_text()
        out["consts"], out["const_mb"], out["const_max"] = hlo_constants(text)
        out["hlo_kb"] = len(text) / 1e3
    except Exception as e:
        print(f"  as_text: {type(e).__name__}: {e}")
    return out


def build_engine(opts: argparse.Namespace, cache_dir: str | None) -> tuple[Any, Any]:
    """(engine, what keeps the params alive) as `metrale serve` builds it, or on bench's
    random model with `--random`."""
    from metrale_jax.engine import Engine, EngineConfig
    options: dict[str, Any] = {"compilation_cache_dir": cache_dir}
    if opts.quantization:
        options["quantization"] = opts.quantization
    config = EngineConfig(max_slots=opts.slots, max_len=opts.max_len, **options)
    if opts.random:
        import dataclasses

        from bench.engine_common import DEFAULT_SHAPE, random_model
        shape = dataclasses.replace(DEFAULT_SHAPE, num_layers=opts.layers)
        graphdef, params = random_model(shape)
        return Engine(shape, graphdef, params, config), params
    from metrale_jax.engine.placement import PlacementHook
    from metrale_jax.weights.checkpoint import load_checkpoint
    hook = PlacementHook(config)
    ckpt = load_checkpoint(opts.model, opts.dtype, shardings=hook,
                           quantization=opts.quantization)
    engine = Engine(ckpt.config, ckpt.graphdef, ckpt.params, placement=hook.placement,
                    vision=ckpt.vision)
    return engine, ckpt


def warmup_jobs(engine: Any) -> list[Any]:
    """The jobs `Engine.warmup` runs (decoder-only models), in its order."""
    return [*engine.step_programs.init_jobs(), *engine.packer.jobs(), *engine.beams.jobs(),
            *engine.step_programs.step_jobs()]


def show(label: str, mem: dict[str, float], base: dict[str, float] | None = None) -> None:
    """One line of memory figures, with the change from `base`."""
    line = (f"{label:<34} rss {mem['rss']:7.1f}  anon {mem['anon']:7.1f}  file "
            f"{mem['file']:6.1f}  code {mem['code']:5.1f}  heap used "
            f"{mem['heap_used']:8.1f}  heap free {mem['heap_free']:7.1f}")
    if base is not None:
        line += f"  (rss {mem['rss'] - base['rss']:+7.1f})"
    print(line, flush=True)


def trim() -> None:
    """gc.collect() then glibc's malloc_trim(0)."""
    gc.collect()
    LIBC.malloc_trim(0)


def main(argv: list[str] | None = None) -> int:
    """Runs the investigation; prints a line per stage and per program (MB)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--random", action="store_true", help="bench's random model instead")
    p.add_argument("--layers", type=int, default=30, help="layers of the random model")
    p.add_argument("--cache", default="off", choices=["off", "cold", "warm"])
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--trim-each", action="store_true",
                   help="malloc_trim(0) after every program (does the heap keep it?)")
    p.add_argument("--limit", type=int, default=0, help="compile only the first N programs")
    p.add_argument("--no-figures", action="store_true",
                   help="skip memory_analysis() and as_text() (they allocate too)")
    opts = p.parse_args(argv)
    cache_dir = None
    if opts.cache != "off":
        cache_dir = opts.cache_dir or tempfile.mkdtemp(prefix="pm-cache-")
    print(f"cache: {opts.cache} ({cache_dir})")

    start = memory()
    show("start", start)
    import jax
    show("import jax", memory(), start)
    engine, keep = build_engine(opts, cache_dir)
    jax.block_until_ready(jax.tree.leaves(engine.params))
    loaded = memory()
    show("engine built (params loaded)", loaded, start)

    jobs = warmup_jobs(engine)
    if opts.limit:
        jobs = jobs[:opts.limit]
    figures = []
    before = loaded
    t_all = time.perf_counter()
    for job in jobs:
        known = set(engine.programs.compiled_keys())
        t0 = time.perf_counter()
        job()
        seconds = time.perf_counter() - t0
        if opts.trim_each:
            trim()
        mem = memory()
        new = [k for k in engine.programs.compiled_keys() if k not in known]
        for key in new:
            fig = {} if opts.no_figures else program_figures(engine.programs.get(key))
            figures.append((key, mem["rss"] - before["rss"], fig))
            show(f"{key!s:<22} {seconds:5.1f} s", mem, before)
            print("    program: " + "  ".join(f"{k} {v:.2f}" for k, v in fig.items()))
        before = mem
    warm = memory()
    print(f"\n{len(figures)} programs in {time.perf_counter() - t_all:.1f} s")
    show("all compiled", warm, loaded)
    if figures:
        rss = sum(f[1] for f in figures) / len(figures)
        code = sum(f[2].get("code", 0) for f in figures) / len(figures)
        const = sum(f[2].get("const_mb", 0) for f in figures) / len(figures)
        temp = sum(f[2].get("temp", 0) for f in figures) / len(figures)
        print(f"per program (mean): rss {rss:.1f}  generated code {code:.2f}  "
              f"HLO constants {const:.2f}  temporaries {temp:.2f}")

    LIBC.malloc_trim(0)
    show("malloc_trim(0)", memory(), loaded)
    jax.clear_caches()
    trim()
    show("jax.clear_caches + gc + trim", memory(), loaded)
    engine.programs.__init__(engine.programs.replicated)  # drop every executable
    trim()
    show("executables dropped + gc + trim", memory(), loaded)
    del engine, keep
    trim()
    show("engine and params dropped", memory(), start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
