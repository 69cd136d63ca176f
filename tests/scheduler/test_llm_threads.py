"""Every thread an `LLM` starts ends without `close()`: when the `LLM` is garbage collected
(`del llm`), and at interpreter exit while its background compile (`warmup="serve"`) still has
programs to go: the programs not started are skipped, the one compiling is waited for, and the
script exits 0 with nothing on stderr. The compile is held (its first job waits on a gate that
the script's own exit hook opens) so that it surely runs at exit: before, the compile's
`ThreadPoolExecutor` workers were joined ahead of every `atexit` hook, so exit waited for the
whole rest of the grid (here: forever, the gate never opening)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.xdist_group("tiny-llm")  # its shapes: programs from the cache

SCRIPT = """
import atexit, gc, sys, threading
status = {}
# Registered first, so it runs last: after the LLM's own exit hooks.
atexit.register(lambda: print("compiled at exit:", status["engine"].compile_count, flush=True))
from metrale_jax import LLM, SamplingParams
from metrale_jax.engine.programs import ProgramCache
shapes = dict(max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2)
params = SamplingParams(max_tokens=3, temperature=0)

first = LLM(sys.argv[1], **shapes)
print("first:", first.generate(["hello"], params)[0].finish_reason)
del first
gc.collect()
print("threads after del:", sorted(t.name for t in threading.enumerate()
                                   if t.name.startswith("metrale-")))

gate = threading.Event()
original = ProgramCache.warmup_in_background
ProgramCache.warmup_in_background = lambda self, jobs, workers=2: original(
    self, [gate.wait, *jobs], 1)
llm = LLM(sys.argv[1], warmup="serve", **shapes)
status["engine"] = llm.scheduler.engine
print("second:", llm.generate(["hello"], params)[0].finish_reason)
print("compiled before exit:", status["engine"].compile_count)
print("to compile:", status["engine"].compile_status()["background"]["total"] - 1)
atexit.register(gate.set)  # runs first at exit: the compile's job in flight ends
"""


def test_a_script_ends_every_thread_without_close(tiny_folder):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_folder)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == "", done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["first"] == lines["second"] == "length"
    assert lines["threads after del"] == "[]"
    before, after = int(lines["compiled before exit"]), int(lines["compiled at exit"])
    assert 0 <= after - before < int(lines["to compile"]), done.stdout  # some were skipped
