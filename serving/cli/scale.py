"""The scale-out flags of `metrale serve` and `metrale generate`: the mesh, the memory plan and
the processes of a multi-host run (`jax.distributed`).

    --mesh data=2,model=4      the device mesh (default: chosen for the model and the devices)
    --memory-gb 15             memory per device for the plan (CPU reports none)
    --max-slots 0 / --max-len 0   0 = as many / as long as fit (the memory plan)
    --coordinator HOST:PORT --num-processes N --process-id I   one process of N

On a Cloud TPU VM of several hosts the process layout comes from the TPU environment
(`jax.distributed.initialize()` with no arguments): the flags are for machines without one
(GPU hosts). `init_distributed` must run before anything else touches JAX's backends.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from metrale_jax.errors import MetraleError

log = logging.getLogger("metrale")

HEARTBEAT_TIMEOUT_S = 30  # jax's own dead-process detection (ours is the side channel: faster)


def add_quantization_flag(parser: argparse.ArgumentParser) -> None:
    """Adds --quantization (int8 or int4 weights, `metrale_jax/models/quant.py` and
    `quant4.py`); a value not in the choices exits 2 with argparse's message naming them."""
    from metrale_jax.config import QUANTIZATIONS
    parser.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                        help="quantize the weights while loading: 'int8' the linear layers "
                             "(per-output-channel scales), 'int8-all' the embedding and LM "
                             "head too; 'int4' the linear layers 4-bit in blocks of 32 "
                             "(llama.cpp's Q4_1: a Q4_1 GGUF keeps its own values) with the "
                             "embedding and LM head int8 (default: as stored)")


def add_kv_cache_flag(parser: argparse.ArgumentParser) -> None:
    """Adds --kv-cache-dtype (the KV cache's element type; int8 rows with per-token, per-head
    scales: `metrale_jax/models/kv_quant.py`); a value not in the choices exits 2."""
    from metrale_jax.config import KV_CACHE_DTYPES
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES),
                        help="the KV cache's dtype: 'int8' stores each token's key and value "
                             "heads int8 with a float32 scale each (about a quarter of "
                             "float32's bytes: more tokens per GiB, faster long-context "
                             "decode); 'auto' (default) = the compute dtype")


def add_scale_flags(parser: argparse.ArgumentParser, processes: bool = True) -> None:
    """Adds --mesh, --memory-gb, --layer-loop and --sliding-cache (and, with `processes`,
    the multi-host flags)."""
    parser.add_argument("--layer-loop", default="auto", choices=("auto", "unrolled", "scan"),
                        help="how a decoder-only model's layers are compiled: 'unrolled' (a "
                             "copy of the layer per layer), 'scan' (one loop over stacked "
                             "layers: compile time nearly flat in depth); 'auto' (default) = "
                             "scan on TPU and GPU and for int4 weights on CPU, unrolled for "
                             "float and int8 weights on CPU")
    parser.add_argument("--sliding-cache", default="window", choices=("window", "full"),
                        help="the KV cache of sliding-window layers beside global ones (Gemma "
                             "2 and 3): 'window' (default) = a ring per sequence that does not "
                             "grow with the context (no prefix cache, no beam search for the "
                             "model); 'full' = every position's page (as llama.cpp's "
                             "--swa-full)")
    parser.add_argument("--mesh", default=None,
                        help="the device mesh, e.g. data=2,model=4 (slots over data, heads and "
                             "MLP over model; default: chosen for the model and devices)")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="GiB of memory per device for the memory plan (default: what "
                             "the devices report; CPU reports none)")
    if not processes:
        return
    parser.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                        help="multi-host: process 0's address for jax.distributed (process 0 "
                             "also listens on PORT+1 for the engine calls it broadcasts)")
    parser.add_argument("--num-processes", type=int, default=None,
                        help="multi-host: the number of processes")
    parser.add_argument("--process-id", type=int, default=None,
                        help="multi-host: this process's index (0 serves HTTP)")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the flags set."""
    options: dict[str, Any] = {}
    if args.mesh is not None:
        options["mesh"] = args.mesh
    if args.memory_gb is not None:
        options["memory_gb"] = args.memory_gb
    if getattr(args, "quantization", None) is not None:
        options["quantization"] = args.quantization
    if getattr(args, "layer_loop", "auto") != "auto":
        options["layer_loop"] = args.layer_loop
    if getattr(args, "sliding_cache", "window") != "window":
        options["sliding_cache"] = args.sliding_cache
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        options["cache_dtype"] = args.kv_cache_dtype
    return options


def shape_flag(value: int | None) -> int | None:
    """--max-slots / --max-len: 0 means "choose" (None)."""
    return None if value == 0 else value


def _tpu_multihost_env() -> bool:
    """True on a Cloud TPU VM that is one host of several (its environment lists them)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h.strip()]) > 1


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """Starts jax.distributed when the flags or the TPU environment ask for it; returns
    (process id, number of processes), (0, 1) for a single process.

    Explicit flags need all three of --coordinator, --num-processes and --process-id. On CPU,
    the collectives between processes go through gloo.
    """
    given = [args.coordinator, args.num_processes, args.process_id]
    if all(v is None for v in given) and not _tpu_multihost_env():
        return 0, 1
    import jax
    if any(v is None for v in given) and not all(v is None for v in given):
        raise MetraleError("multi-host: give all of --coordinator HOST:PORT, --num-processes "
                           "N and --process-id I (or none, on a Cloud TPU VM)")
    if args.num_processes is not None:
        if args.num_processes < 1 or not 0 <= args.process_id < args.num_processes:
            raise MetraleError(f"--process-id must be in [0, {args.num_processes}) and "
                               "--num-processes at least 1")
        if ":" not in args.coordinator:
            raise MetraleError(f"--coordinator {args.coordinator!r}: expected HOST:PORT")
    if not jax.config.jax_cpu_collectives_implementation:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {} if args.coordinator is None else dict(
        coordinator_address=args.coordinator, num_processes=args.num_processes,
        process_id=args.process_id)
    jax.distributed.initialize(**kwargs, heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    pid, n = jax.process_index(), jax.process_count()
    log.info("process %d of %d: %d local of %d devices", pid, n, jax.local_device_count(),
             jax.device_count())
    return pid, n
