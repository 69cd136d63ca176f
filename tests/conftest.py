"""Shared test setup: one OpenMP thread per test process, XLA:CPU's quick compile mode, JAX's
persistent compilation cache, and the default-model fixture."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

# `make test` runs three xdist workers on a 2-core machine, and the subprocesses of the mesh,
# multi-host and notebook tests share those cores too. torch's OpenMP threads spin while
# they wait for work, so with one thread per core in every process the transformers
# references slowed down about 11x (test_default_model_greedy: 27 s alone, 430 s beside the
# notebooks; 39 s with one thread). Set before torch is imported; inherited by subprocesses.
os.environ["OMP_NUM_THREADS"] = "1"

# Compiling dominates the suite's time, and the tests' programs are small: XLA:CPU's LLVM
# backend at -O0 compiles them about a quarter faster (tests/engine/test_greedy_hf.py plus
# test_engine_sampling.py, cold cache: 116 s -> 99 s). It changes how fast the code runs, not
# what it computes (no fast-math either way). Set before jax is imported; subprocesses
# inherit it, and `xla_flags` adds the fake-device count for the multi-device children.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
# XLA:CPU's older (non-MLIR) fusion emitters compile the sampling graph that every engine
# program carries (processors, top-k, sorts, truncation) in half the time: tests/engine plus
# tests/scheduler, cold cache, 321 s -> 246 s. The same float32 operations (no fast-math
# either way), within every fidelity bound. jaxlib aborts on a flag it does not know, so it
# is added only for the release line it was measured on.
if importlib.metadata.version("jaxlib").startswith("0.10."):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"


# For the few test programs whose run, not their compile, dominates (tens of thousands of
# sampler rows): XLA's own defaults, passed per program as `jax.jit(f,
# compiler_options=RUN_FAST)`. tests/engine/test_sampling.py's 20000-row draw compiles in
# 7 s instead of 13 and runs in half the time.
RUN_FAST: dict[str, object] = {"xla_backend_optimization_level": 2}
if "--xla_cpu_use_fusion_emitters=false" in TEST_XLA_FLAGS:
    RUN_FAST["xla_cpu_use_fusion_emitters"] = True


def xla_flags(devices: int | None = None) -> str:
    """XLA_FLAGS for a test process: the suite's flags, plus `devices` fake CPU devices."""
    fake = f" --xla_force_host_platform_device_count={devices}" if devices else ""
    return TEST_XLA_FLAGS + fake


if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("METRALE_TEST_JAX_CACHE", REPO / ".jax_cache" / "tests"))
CACHE.mkdir(parents=True, exist_ok=True)
# Every engine the tests build (in this process, in the CLI and notebook subprocesses) reads
# its cache folder from METRALE_JAX_CACHE: this one, never the user's ~/.cache/metrale/jax, so
# a clean clone's run starts cold and shares one cache across its processes.
os.environ["METRALE_JAX_CACHE"] = str(CACHE)
# Likewise the C++ kernels built on first use (metrale_jax/kernels/build.py): a clean clone's
# run builds them once into its own folder, shared by its processes.
os.environ.setdefault("METRALE_KERNEL_CACHE", str(CACHE.parent / "kernels"))
# Compiled programs are not stored beside the persistent cache (engine/executable_store.py):
# a clean run would serialize every program twice; tests/engine/test_executable_store.py
# turns the store on for itself.
os.environ["METRALE_EXECUTABLE_CACHE"] = "0"

# (imports jax: after XLA_FLAGS and OMP_NUM_THREADS are set)
from metrale_jax.engine.programs import enable_compilation_cache  # noqa: E402

enable_compilation_cache(str(CACHE))  # atomic writes: workers compile the same programs


DEFAULT_MODEL_SHAPES = dict(max_slots=4, max_len=512, max_prefill_len=64)
"""The engine shapes of every test that runs the default model (see `default_llm`)."""


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """The default model's GGUF (fetched by `make test` via `metrale pull`)."""
    from metrale_jax.weights.default_model import default_model_path
    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"default model not in {path}; run `metrale pull`")
    return path


@pytest.fixture(scope="session")
def default_llm(default_gguf):
    """The default model as an `LLM` (4 slots of 512, prefill pieces up to 64 tokens so that
    a longer prompt is chunked), shared by the tests in the "default-model" xdist group. The
    quickstart notebook and `tests/serving/cli/test_serve.py` use the same shapes, so the
    three share their compiled programs through the suite's compilation cache."""
    from metrale_jax import LLM
    llm = LLM("default", **DEFAULT_MODEL_SHAPES)
    yield llm
    llm.close()


@pytest.fixture(scope="session")
def default_transformers(default_gguf):
    """transformers' own reading of the default GGUF (dequantized to float32, eval mode):
    the reference of the "default-model" tests, loaded once (about 20 s)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(default_gguf.parent),
                                                gguf_file=default_gguf.name,
                                                dtype=torch.float32).eval()


# ---- which xdist worker runs what (`make test`: `-n 3 --dist loadgroup`) --------------------
# A session fixture that compiles an engine is built once per worker that needs it, so the
# tests sharing one go to the same worker: a test using one of these fixtures joins that
# fixture's group, any other test its file's group (as with `--dist loadfile`). The runtime
# tests that build their own server on the shared server's shapes join its group
# (`pytestmark = pytest.mark.xdist_group("tiny-server")`), so their programs come from the
# persistent cache the shared server filled; the default-model fidelity tests, which share
# `default_llm` and `default_transformers`, form the "default-model" group the same way, with
# the other users of the default model on the same shapes (the quickstart notebook and the
# `metrale serve` subprocess): one worker compiles each of its programs once, in sequence.
SHARED_ENGINE_GROUPS = {"server": "tiny-server", "tool_server": "tool-server",
                        "tiny_engine": "tiny-engine", "tiny_llm": "tiny-llm"}


def pytest_collection_modifyitems(items) -> None:
    """Longest groups first (`tests/group_weights.py`), each group's tests in their order."""
    from tests.group_weights import load
    seconds = load()

    def group(item) -> str:
        mark = item.get_closest_marker("xdist_group")
        return mark.args[0] if mark and mark.args else ""

    position = {id(item): i for i, item in enumerate(items)}
    items.sort(key=lambda item: (-seconds.get(group(item), 0.0), position[id(item)]))


def pytest_itemcollected(item) -> None:
    """Gives a test its xdist group: its own marker's, a shared engine's, or its file's; marks
    the kernel contract tests (tests/models/*kernel_contract*) `accelerator`.
    (xdist turns the group into a `@group` suffix of the test's id, which pytest 9 ignores:
    hence `pytest<9` in the test extra.)"""
    if item.nodeid.startswith("tests/models/") and "kernel_contract" in item.nodeid:
        item.add_marker(pytest.mark.accelerator)  # the kernels' contracts: `make device-check`
    if item.get_closest_marker("xdist_group") is not None:
        return
    fixtures = getattr(item, "fixturenames", ())
    group = next((g for f, g in SHARED_ENGINE_GROUPS.items() if f in fixtures), None)
    item.add_marker(pytest.mark.xdist_group(group or item.nodeid.split("::")[0]))
