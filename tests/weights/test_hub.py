"""Models by Hugging Face Hub name (`metrale_jax/weights/hub.py`), against a fake Hub on
loopback (tests/weights/fake_hub.py): never the internet.

Repos: `org/tiny-llama` (a tiny random Llama, safetensors; tag `v1` an older commit with
another config), `org/tiny-gguf` (two quant files and a split one), `org/gated` (401
GatedRepo on downloads), `org/unsupported` (an architecture we do not serve)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import huggingface_hub as hf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from devtools.hf_models import build_tiny_checkpoint
from metrale_jax.errors import CheckpointError, ModelNotFoundError, UnsupportedModelError
from metrale_jax.weights.checkpoint import resolve
from metrale_jax.weights.hub import HubName, parse_hub_name, pick_gguf, resolve_hub_name
from tests.serving.conftest import run_main
from tests.weights.fake_hub import serve_fake_hub
from tests.weights.test_gguf_reader import make

REPO_ROOT = Path(__file__).resolve().parents[2]
GGUFS = ["tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-Q6_K-00001-of-00002.gguf",
         "tiny-Q6_K-00002-of-00002.gguf"]


def split_gguf(folder: Path) -> list[Path]:
    """The tiny Llama of `make(types=Q8_0)` as llama.cpp's `llama-gguf-split` lays it out: two
    parts, each with half the tensors and the `split.*` keys (the model's metadata read from
    the first)."""
    from tests.weights.test_gguf_reader import SPECS, build, write_gguf
    spec = SPECS["llama"]
    original, chosen = build(spec, Q.Q8_0)
    names = list(original)
    halves = (tuple(names[len(names) // 2:]), tuple(names[:len(names) // 2]))
    paths = []
    for no, skip in enumerate(halves):
        path = folder / f"part{no}.gguf"
        write_gguf(path, spec, original, chosen, skip=skip, meta={
            "split.no": no, "split.count": 2, "split.tensors.count": len(names)})
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    """One fake Hub for the module, with the four repos."""
    hub, server = serve_fake_hub()
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
    llama = hub.repo("org/tiny-llama")
    old = json.loads((folder / "config.json").read_text()) | {"max_position_embeddings": 64}
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.iterdir()}
    llama.commit(files | {"config.json": json.dumps(old).encode()}, "v1")
    llama.commit(files | {"README.md": b"# tiny", "pytorch_model.bin": b"not read"})
    ggufs = tmp_path_factory.mktemp("ggufs")
    q8, *_ = make(ggufs, types=Q.Q8_0, name="q8.gguf")
    q4, *_ = make(ggufs, types=Q.Q4_0, name="q4.gguf")
    parts = split_gguf(ggufs)
    hub.repo("org/tiny-gguf").commit({
        GGUFS[0]: q4.read_bytes(), GGUFS[1]: q8.read_bytes(), GGUFS[2]: parts[0].read_bytes(),
        GGUFS[3]: parts[1].read_bytes(), "README.md": b"# ggufs"})
    hub.repo("org/gated", gated=True).commit(files)
    config = json.loads(files["config.json"]) | {"architectures": ["FooForCausalLM"],
                                                  "model_type": "foo"}
    hub.repo("org/unsupported").commit(files | {"config.json": json.dumps(config).encode()})
    hub.local_llama = folder
    yield hub
    server.shutdown()


@pytest.fixture
def hub_env(fake_hub, tmp_path, monkeypatch):
    """HF_HOME in tmp_path and HF_ENDPOINT at the fake Hub, for this process (the library
    read both at import: its constants are patched) and for subprocesses (the environment)."""
    home = tmp_path / "hf"
    for key, value in {"HF_HOME": str(home), "HF_ENDPOINT": fake_hub.url,
                       "HF_HUB_CACHE": str(home / "hub"), "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "HF_HUB_DISABLE_TELEMETRY": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf.constants, "ENDPOINT", fake_hub.url)
    monkeypatch.setattr(hf.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        fake_hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(hf.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    fake_hub.log.clear()
    return home


def offline(monkeypatch) -> None:
    """HF_HUB_OFFLINE=1 from now on, in this process and its subprocesses."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", True)


# ---- names ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, parsed", [
    ("org/repo", HubName("org/repo")),
    ("Qwen/Qwen3-0.6B@main", HubName("Qwen/Qwen3-0.6B", revision="main")),
    ("org/repo-GGUF:Q4_K_M", HubName("org/repo-GGUF", quant="Q4_K_M")),
    ("org/repo:q8_0@v1.0", HubName("org/repo", quant="q8_0", revision="v1.0")),
    ("org/repo/sub/model-Q4_0.gguf@abc", HubName("org/repo", "sub/model-Q4_0.gguf",
                                                 revision="abc")),
    ("./org/repo", None), ("/abs/path", None), ("~/x/y", None), ("default", None),
    ("model.gguf", None), ("a/b/c", None),
])
def test_parse_hub_name(name, parsed):
    assert parse_hub_name(name) == parsed


def test_pick_gguf_by_tag():
    hub = HubName("org/r", quant="q4_k")
    files = ["m-Q4_K_M.gguf", "m-Q4_K.gguf", "m-Q4_K_S.gguf", "mmproj-Q4_K.gguf"]
    assert pick_gguf(hub, files) == "m-Q4_K.gguf"  # the whole tag before a longer one
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        pick_gguf(HubName("org/r", quant="Q4"), ["m-Q4_K_M.gguf", "m-Q4_K_S.gguf"])
    assert pick_gguf(HubName("org/r"), ["a-Q8_0.gguf", "a-Q4_K_M.gguf"]) == "a-Q4_K_M.gguf"
    assert pick_gguf(HubName("org/r"), ["only.gguf"]) == "only.gguf"


# ---- safetensors repos ----------------------------------------------------------------------

def test_load_by_name_generates_as_the_local_folder(fake_hub, hub_env):
    from metrale_jax import LLM
    from metrale_jax.scheduler import SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0.0)
    shapes = dict(max_slots=4, max_len=128, max_prefill_len=32, max_prefill_batch=2)
    by_name = LLM("org/tiny-llama", **shapes)
    try:
        got = by_name.generate("The quick brown fox", params)[0].token_ids
    finally:
        by_name.close()
    local = LLM(fake_hub.local_llama, **shapes)
    try:
        assert got == local.generate("The quick brown fox", params)[0].token_ids
    finally:
        local.close()
    requests = len(fake_hub.log)
    path, fmt = resolve("org/tiny-llama")
    assert fmt == "hf" and path.is_relative_to(hub_env)
    assert len(fake_hub.log) == requests  # resolved once per process
    names = {p.name for p in path.iterdir()}
    assert "config.json" in names and "model.safetensors" in names
    assert not names & {"README.md", "pytorch_model.bin"}  # only what the loaders read


def test_revision_pins_a_commit(fake_hub, hub_env):
    main = json.loads((resolve_hub_name("org/tiny-llama") / "config.json").read_text())
    v1 = json.loads((resolve_hub_name("org/tiny-llama@v1") / "config.json").read_text())
    assert (main["max_position_embeddings"], v1["max_position_embeddings"]) == (256, 64)
    sha = fake_hub.repos["org/tiny-llama"].refs["v1"]
    assert resolve_hub_name(f"org/tiny-llama@{sha}").name == sha
    with pytest.raises(ModelNotFoundError, match="org/tiny-llama has no revision 'nope'"):
        resolve_hub_name("org/tiny-llama@nope")


def test_offline_serves_from_the_cache(fake_hub, hub_env, monkeypatch):
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set and org/tiny-llama "
                       "is not .*in the Hugging Face cache"):
        offline(monkeypatch)
        resolve_hub_name("org/tiny-llama")
    monkeypatch.setattr(hf.constants, "HF_HUB_OFFLINE", False)
    online = resolve_hub_name("org/tiny-llama")
    gguf = resolve_hub_name("org/tiny-gguf:Q8_0")
    fake_hub.log.clear()
    offline(monkeypatch)
    assert resolve_hub_name("org/tiny-llama") == online
    assert resolve_hub_name("org/tiny-gguf:Q8_0") == gguf
    assert fake_hub.log == []
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE is set and org/tiny-gguf:Q4_K_M"):
        resolve_hub_name("org/tiny-gguf:Q4_K_M")


def test_unreachable_hub_serves_from_the_cache(fake_hub, hub_env, monkeypatch):
    from metrale_jax.errors import FetchError
    cached = resolve_hub_name("org/tiny-gguf:Q8_0"), resolve_hub_name("org/tiny-llama")
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        down = f"http://127.0.0.1:{closed.getsockname()[1]}"
    monkeypatch.setattr(hf.constants, "ENDPOINT", down)
    monkeypatch.setattr(hf.constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        down + "/{repo_id}/resolve/{revision}/{filename}")
    assert (resolve_hub_name("org/tiny-gguf:Q8_0"), resolve_hub_name("org/tiny-llama")) == cached
    with pytest.raises(FetchError, match=f"could not reach the Hugging Face Hub at {down} for "
                       "org/gated"):
        resolve_hub_name("org/gated")


def test_cache_shared_with_transformers(fake_hub, hub_env):
    resolve_hub_name("org/tiny-llama")
    fetched = fake_hub.file_gets()
    assert len(fetched) == len(set(fetched)) and len(fetched) >= 4
    code = ("import transformers; m = transformers.AutoModelForCausalLM.from_pretrained("
            "'org/tiny-llama'); print(type(m).__name__)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "LlamaForCausalLM"
    again = fake_hub.file_gets()[len(fetched):]
    assert not set(again) & set(fetched), f"fetched twice: {set(again) & set(fetched)}"


def test_interrupted_download_resumes(fake_hub, hub_env, monkeypatch):
    # the library keeps what it wrote of a broken download and asks for the rest (Range); it
    # writes in chunks of DOWNLOAD_CHUNK_SIZE (10 MB), more than the tiny model's weights
    monkeypatch.setattr(hf.constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    sha = fake_hub.repos["org/tiny-llama"].refs["main"]
    fake_hub.cut_once.add("org/tiny-llama/model.safetensors")
    folder = resolve_hub_name("org/tiny-llama")
    assert (folder / "model.safetensors").read_bytes() == (
        fake_hub.local_llama / "model.safetensors").read_bytes()
    gets = [(p, r) for m, p, r in fake_hub.log
            if m == "GET" and p == f"/org/tiny-llama/resolve/{sha}/model.safetensors"]
    assert len(gets) == 2 and gets[0][1] is None and gets[1][1].startswith("bytes=")
    assert int(gets[1][1][len("bytes="):].rstrip("-")) > 0  # asked only for the rest


# ---- GGUF repos -----------------------------------------------------------------------------

def test_quant_tag_picks_the_file(fake_hub, hub_env):
    from metrale_jax.weights.gguf_reader import read_gguf
    path, fmt = resolve("org/tiny-gguf:q8_0")
    assert (path.name, fmt) == ("tiny-Q8_0.gguf", "gguf")
    assert read_gguf(path)[0].architecture == "llama"
    assert resolve("org/tiny-gguf")[0].name == "tiny-Q4_K_M.gguf"  # llama.cpp's default
    assert resolve("org/tiny-gguf/tiny-Q8_0.gguf")[0] == path
    assert {p.rsplit("/", 1)[-1] for p in fake_hub.file_gets()} == {
        "tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf"}  # never the other files


def test_quant_errors_list_the_files(fake_hub, hub_env):
    with pytest.raises(ModelNotFoundError, match=r"no GGUF file of Hugging Face repo "
                       r"org/tiny-gguf matches 'IQ2_XS'\. Files: tiny-Q4_K_M\.gguf, "):
        resolve("org/tiny-gguf:IQ2_XS")
    assert not fake_hub.file_gets()  # refused before any download


def test_split_gguf_parts_are_downloaded_and_joined(fake_hub, hub_env, tmp_path):
    """`:Q6_K` names a split model: both parts come down and read as the one-file model."""
    from metrale_jax.weights.gguf_reader import read_gguf
    path, fmt = resolve("org/tiny-gguf:Q6_K")
    assert (path.name, fmt) == (GGUFS[2], "gguf")
    assert {p.rsplit("/", 1)[-1] for p in fake_hub.file_gets()} == set(GGUFS[2:])
    whole, *_ = make(tmp_path, types=Q.Q8_0, name="whole.gguf")
    config, tensors, _ = read_gguf(path)
    want_config, want, _ = read_gguf(whole)
    assert config == want_config and set(tensors) == set(want)
    for name, value in want.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    (path.parent / GGUFS[3]).unlink()  # a part missing: named
    with pytest.raises(CheckpointError, match="split GGUF part tiny-Q6_K-00002-of-00002.gguf "
                       "is missing"):
        read_gguf(path)


# ---- errors ---------------------------------------------------------------------------------

def test_not_found_gated_and_unsupported(fake_hub, hub_env):
    with pytest.raises(ModelNotFoundError, match="model 'org/nothing' not found: no such file "
                       "or folder, and no Hugging Face repo org/nothing at http://127"):
        resolve("org/nothing")
    with pytest.raises(ModelNotFoundError, match="Hugging Face repo org/gated is gated: accept "
                       "its license on http://127.*/org/gated .*set HF_TOKEN"):
        resolve("org/gated")
    with pytest.raises(ModelNotFoundError, match="'org/bad..name' is not a valid Hugging Face"):
        resolve("org/bad..name")
    with pytest.raises(ModelNotFoundError, match="has no file 'none.gguf'"):
        resolve("org/tiny-gguf/none.gguf")
    from metrale_jax.weights.checkpoint import load_checkpoint
    with pytest.raises(UnsupportedModelError, match=r"models--org--unsupported/.*config.json: "
                       r"model_type 'foo' is not supported \(supported: .*llama"):
        load_checkpoint("org/unsupported")


def test_local_path_wins(fake_hub, hub_env, tmp_path, monkeypatch):
    (tmp_path / "org").mkdir()
    local = build_tiny_checkpoint(tmp_path / "org" / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    assert resolve("org/tiny-llama") == (Path("org/tiny-llama"), "hf")
    assert resolve(local)[0] == local and fake_hub.log == []


# ---- the CLI --------------------------------------------------------------------------------

def test_cli_pull_and_generate_by_name(fake_hub, hub_env, capsys):
    """`metrale pull` and `generate` by Hub name: `main()` in this process (the console
    script's function; the Hub's settings patched here as in the environment), each run's
    exit code, stdout and stderr."""
    code, out, err = run_main(capsys, "pull", "org/tiny-gguf:Q8_0")
    assert code == 0, err
    path = Path(out.strip().splitlines()[-1])
    assert path.name == "tiny-Q8_0.gguf" and path.is_relative_to(hub_env)
    code, out, err = run_main(capsys, "generate", "--model", "org/tiny-llama", "--prompt",
                              "quick brown", "--max-tokens", "5", "--temperature", "0",
                              "--max-len", "64",
                              "--json")  # tests/test_cli.py's shapes: its compiled programs
    assert code == 0, err
    assert 1 <= len(json.loads(out)["token_ids"]) <= 5
    assert fake_hub.file_gets("org/tiny-llama")
    code, _, err = run_main(capsys, "generate", "--model", "org/nothing", "--max-tokens", "2")
    assert code == 2
    assert err.strip().splitlines() == [
        f"metrale: error: model 'org/nothing' not found: no such file or folder, and no "
        f"Hugging Face repo org/nothing at {fake_hub.url} (a private repo needs HF_TOKEN)"]
    code, _, err = run_main(capsys, "pull", "org/tiny-gguf:IQ1")
    assert code == 2 and "Traceback" not in err
    assert "Files: tiny-Q4_K_M.gguf" in err
