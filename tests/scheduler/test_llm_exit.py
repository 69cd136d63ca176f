"""A script that never calls `LLM.close()` still exits cleanly: the batching loop is stopped
at interpreter exit instead of being torn down inside XLA, which aborted the process (exit
134, "terminate called after throwing an instance of ''") in about half of the runs on the
default model. One run exits 0 with nothing on stderr. (The stop is deterministic: the loop
and every thread the `LLM` started end before the interpreter finalizes, which
tests/scheduler/test_llm_threads.py checks thread by thread on a tiny model; this run keeps
the default model's path, its GGUF and C++ kernels, under the same check.)

In the "default-model" xdist group (tests/conftest.py), after the shared default `LLM` has run
prompts on the same shapes: the scripts' programs come from the persistent compilation cache
instead of the first script compiling them beside that worker."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import DEFAULT_MODEL_SHAPES

pytestmark = pytest.mark.xdist_group("default-model")

SCRIPT = """
import sys
from metrale_jax import LLM, SamplingParams
llm = LLM(sys.argv[1], **{shapes!r})
out = llm.generate(["hello there"], SamplingParams(max_tokens=3, temperature=0))
print("finish:", out[0].finish_reason)
"""


def test_a_script_without_close_exits_zero_with_nothing_on_stderr(default_gguf):
    script = SCRIPT.format(shapes=DEFAULT_MODEL_SHAPES)
    done = subprocess.run([sys.executable, "-c", script, str(default_gguf)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "finish: length" in done.stdout
    assert done.stderr == "", done.stderr[-2000:]
