"""The device check (`bench/device_check.py`) end to end on the CPU backend with tiny shapes:
every part reports a status; a part that raises, needs a missing JAX API or hangs is reported
failed while the others still run; test files needing a module the host lacks are listed.
Plus its table of devices and its wheel list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bench.device_parts import junit_counts
from bench.device_specs import lookup, markdown_table
from bench.device_wheels import HOST_HAS, normalize, wanted_requirements

ROOT = Path(__file__).resolve().parents[1]
FAST_TEST = "tests/test_device_check.py::test_the_backend_multiplies_like_numpy"


@pytest.mark.accelerator
def test_the_backend_multiplies_like_numpy():
    """The device's float32 product against NumPy's (the check's own quick marked test)."""
    import jax.numpy as jnp
    a = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(jnp.asarray(a) @ jnp.asarray(a.T)), a @ a.T,
                               rtol=1e-5, atol=1e-4)


def check(out: Path, *args: str, env: dict | None = None) -> tuple[dict, str]:
    """Runs `python -m bench.device_check --tiny --out out ARGS`; (its JSON, its stdout)."""
    proc = subprocess.run([sys.executable, "-m", "bench.device_check", "--tiny", "--out",
                           str(out), *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=400)
    assert (out / "device_check.md").read_text() in proc.stdout
    return json.loads((out / "device_check.json").read_text()), proc.stdout


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """The whole check, tiny, its tests part restricted to the one quick marked test."""
    return check(tmp_path_factory.mktemp("device-check"), "--tests", FAST_TEST)


HIDE_TORCH = """import sys


class HideTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch'", name="torch")


sys.meta_path.insert(0, HideTorch())
"""
"""A `sitecustomize.py` for which torch is not installed."""


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A check on a host without torch (hidden by a `sitecustomize` on PYTHONPATH) whose
    detect part raises, throughput part needs an API JAX lacks and server part hangs past a
    3 s limit; its tests part selects a file whose folder's conftest needs torch beside the
    quick marked test."""
    fake = tmp_path_factory.mktemp("no-torch")
    (fake / "sitecustomize.py").write_text(HIDE_TORCH)
    path = os.pathsep.join([str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return check(tmp_path_factory.mktemp("device-check-broken"), "--limit", "server=3",
                 "--tests", "tests/scheduler/test_scheduler.py", FAST_TEST,
                 env={"PYTHONPATH": path, "METRALE_DEVICE_CHECK_FAIL": "detect",
                      "METRALE_DEVICE_CHECK_REQUIRE": "throughput:jax.no_such_api",
                      "METRALE_DEVICE_CHECK_HANG": "server"})


def test_every_part_runs_and_passes_on_cpu(full):
    report, out = full
    assert set(report["parts"]) == {"detect", "tests", "throughput", "server"}
    for name, part in report["parts"].items():
        assert part["status"] == "pass", (name, part.get("error"), part.get("traceback"))
    assert report["backend"]["backend"] == "cpu"
    assert report["backend"]["jax"] and report["backend"]["jaxlib"]
    assert "1 passed" in report["parts"]["tests"]["summary"]
    decode = report["parts"]["throughput"]["details"]["decode"]
    assert [r["batch"] for r in decode] == [1, 4, 8]  # --tiny; else 1, 16, 64
    assert all(r["tokens_per_s"] > 0 and r["bandwidth_fraction"] is None for r in decode)
    assert "CPU backend" in report["parts"]["throughput"]["details"]["fraction_reason"]
    levels = report["parts"]["server"]["details"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [16, 64]
    assert all(lv["failed"] == 0 and lv["output_tok_s"] > 0 for lv in levels)
    assert "| throughput | pass |" in out


def test_a_failing_part_is_reported_and_the_others_still_run(broken):
    report, out = broken
    parts = report["parts"]
    assert parts["detect"]["status"] == "fail"
    assert "injected failure" in parts["detect"]["error"]
    assert "Traceback" in parts["detect"]["traceback"]
    assert parts["throughput"]["status"] == "fail"
    assert "missing API" in parts["throughput"]["error"]
    assert "jax.no_such_api" in parts["throughput"]["error"]
    assert parts["server"]["status"] == "fail"
    assert parts["server"]["summary"].startswith("timeout")
    assert "jax.no_such_api" in out


def test_files_needing_a_module_the_host_lacks_are_listed_and_the_rest_runs(broken):
    tests = broken[0]["parts"]["tests"]
    assert tests["status"] == "pass", tests
    assert tests["details"]["passed"] == 1
    assert tests["details"]["not_collected"] == {"torch": ["tests/scheduler/test_scheduler.py"]}


def test_the_table_knows_the_usual_devices():
    assert lookup("TPU v5 lite").name == "TPU v5e"
    assert lookup("TPU v5").name == "TPU v5p"
    assert lookup("TPU v6 lite").name.startswith("TPU v6e")
    assert lookup("NVIDIA H100 80GB HBM3").name == "NVIDIA H100 SXM"
    assert lookup("NVIDIA H100 PCIe").name == "NVIDIA H100 PCIe"
    assert lookup("NVIDIA A100-SXM4-40GB").hbm_gbps == 1555
    assert lookup("NVIDIA L4").name == "NVIDIA L4"
    assert lookup("NVIDIA L40S").name == "NVIDIA L40S"
    assert lookup("cpu") is None and lookup("NVIDIA Quantum 9000") is None
    assert "| NVIDIA H200 |" in markdown_table()


def test_the_wheels_are_the_runtime_dependencies_the_host_lacks():
    wanted = {normalize(r.split(">")[0].split("=")[0]) for r in wanted_requirements()}
    assert {"quart", "quart-cors", "hypercorn", "pydantic", "llguidance", "gguf"} <= wanted
    assert not wanted & {normalize(n) for n in HOST_HAS}


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="" name="tests.scheduler.test_lora"><error message="collection failure">
ImportError while importing test module
E   ModuleNotFoundError: No module named 'torch_absent'</error></testcase>
<testcase classname="t" name="test_s"><skipped message="no TPU here">x</skipped></testcase>
<testcase classname="t" name="test_f"><failure message="assert 1 == 2">...</failure></testcase>
<testcase classname="t" name="test_e"><error message="fixture broke">...</error></testcase>
<testcase classname="" name="tests.models.test_moved"><error message="collection failure">
E   ModuleNotFoundError: No module named 'jax.experimental.gone'</error></testcase>
<testcase classname="t" name="test_ok" /></testsuite></testsuites>"""


def test_the_tests_part_sorts_failures_skips_and_missing_modules(tmp_path):
    """A missing package is "not collected"; a missing submodule of an installed one (JAX's
    API moved) is an error."""
    (tmp_path / "j.xml").write_text(JUNIT)
    counts = junit_counts(tmp_path / "j.xml")
    assert counts["passed"] == 1
    assert counts["failed"] == ["t::test_f: assert 1 == 2"]
    assert counts["errors"][0] == "t::test_e: fixture broke"
    assert "no module jax.experimental.gone in the installed jax" in counts["errors"][1]
    assert counts["skipped"] == {"no TPU here": 1}
    assert counts["not_collected"] == {"torch_absent": ["tests.scheduler.test_lora"]}
