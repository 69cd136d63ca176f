"""Several models in one server (serving/http/model_pool.py): three tiny Llamas of one
architecture (so their programs are shared through the compilation cache) behind one real
server whose memory budget holds two of them."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import urllib.request

import openai
import pytest

from devtools.hf_models import build_hf_model, save_tiny_tokenizer
from tests.serving.conftest import OpenStream, get_json
from tests.serving.conftest import post as raw_post

pytestmark = pytest.mark.xdist_group("model-pool")

MAX_SLOTS, MAX_LEN = 2, 64
PROMPT = "the cat sat on"
TOKENS = 6
GiB = 1024**3


def _settings(**kw):
    from serving.http.settings import ServerSettings
    return ServerSettings(port=0, max_slots=MAX_SLOTS, max_len=MAX_LEN, warmup="none",
                          engine_options={"max_prefill_len": 32}, request_timeout=120.0,
                          grace_period=2.0, **kw)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Three tiny Llama folders (seeds 0, 1, 2) by name, and the bytes per device one of them
    holds in a pool (its memory plan with a bounded KV pool)."""
    from metrale_jax.engine.config import EngineConfig
    from metrale_jax.engine.placement import PlacementHook
    from metrale_jax.weights.checkpoint import load_checkpoint
    from serving.http.model_memory import bounded_placement
    root = tmp_path_factory.mktemp("model-pool")
    paths = {}
    for seed, name in enumerate("abc"):
        folder = root / name
        build_hf_model("llama", folder, seed=seed)
        save_tiny_tokenizer(folder)
        paths[name] = str(folder)
    hook = PlacementHook(EngineConfig(max_slots=MAX_SLOTS, max_len=MAX_LEN,
                                      max_prefill_len=32))
    ckpt = load_checkpoint(paths["a"], shardings=hook)
    del ckpt
    return paths, bounded_placement(hook.placement).device_bytes


@pytest.fixture(scope="module")
def reference(models):
    """Each model's greedy tokens for PROMPT from its own single-model `LLM`."""
    from metrale_jax import LLM
    from metrale_jax.scheduler import SamplingParams
    paths, _ = models
    out = {}
    for name, path in paths.items():
        llm = LLM(path, max_slots=MAX_SLOTS, max_len=MAX_LEN, max_prefill_len=32)
        try:
            [result] = llm.generate([PROMPT], SamplingParams(max_tokens=TOKENS,
                                                             temperature=0.0,
                                                             ignore_eos=True))
            out[name] = list(result.token_ids)
        finally:
            llm.close()
    return out


@pytest.fixture(scope="module")
def pool(models):
    """A server of models a (primary), b and c with a budget of 2.5 models."""
    from serving.http.server import ServerThread
    paths, footprint = models
    settings = _settings(model=paths["a"], served_model_name="a",
                         models=(f"b={paths['b']}", f"c={paths['c']}"),
                         memory_budget_gb=2.5 * footprint / GiB, model_wait_timeout=3.0)
    srv = ServerThread(settings).start()
    assert srv.wait_ready(timeout=600), srv.state.runtime.error
    yield srv
    srv.stop()


def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    """(status, JSON body) of a POST."""
    status, _, answer = raw_post(url, path, body)
    return status, answer


def complete(url: str, model: str, **extra) -> list[int]:
    """Greedy completion token ids of PROMPT on `model`."""
    status, body = post(url, "/v1/completions", {
        "model": model, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, **extra})
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def rows(url: str) -> dict[str, dict]:
    return {r["id"]: r for r in get_json(url, "/v1/metrale/models")["data"]}


def states(url: str) -> dict[str, str]:
    return {name: r["state"] for name, r in rows(url).items()}


def wait_state(url: str, model: str, want: str, timeout: float = 60.0) -> None:
    """Waits (polling the admin list, with a deadline) until `model` is in state `want`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if states(url)[model] == want:
            return
        time.sleep(0.05)
    raise AssertionError(f"{model} not {want}: {states(url)}")


def admin(url: str, op: str, **body) -> tuple[int, dict]:
    return post(url, f"/v1/metrale/models/{op}", body)


def test_alternating_requests_swap_models_within_the_budget(pool, reference):
    url = pool.url
    assert states(url) == {"a": "loaded", "b": "on_disk", "c": "on_disk"}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    listed = {m.id: m.model_extra["state"] for m in client.models.list().data}
    assert listed == {"a": "loaded", "b": "on_disk", "c": "on_disk"}
    assert complete(url, "a") == reference["a"]
    assert complete(url, "b") == reference["b"]
    assert states(url) == {"a": "loaded", "b": "loaded", "c": "on_disk"}
    assert complete(url, "c") == reference["c"]  # a, the least recently used, makes room
    assert states(url) == {"a": "on_disk", "b": "loaded", "c": "loaded"}
    for name in "ab":  # each one evicts the least recently used
        assert complete(url, name) == reference[name], name
    assert states(url) == {"a": "loaded", "b": "loaded", "c": "on_disk"}
    table = rows(url)
    assert table["a"]["loads"] == 2 and table["b"]["loads"] == 2 and table["c"]["loads"] == 1
    assert sum(r["memory_bytes"] for r in table.values()) <= pool.state.pool.budget
    # A model loaded again finds every program it runs in the compilation cache.
    assert table["a"]["programs"]["compiled"] > 0
    assert table["a"]["programs"]["compiled_afresh"] == 0
    with urllib.request.urlopen(url + "/metrics") as r:
        metrics = r.read().decode()
    assert 'metrale:model_state{model="a",state="loaded"} 1.0' in metrics
    assert 'metrale:model_loads_total{model="a"} 2.0' in metrics
    answer = client.completions.create(model="b", prompt=PROMPT, max_tokens=2)
    assert answer.model == "b"


def _held(pool, name: str):
    """Holds model `name`'s batching loop in its next step (until the event is set)."""
    engine = pool.state.pool.models[name].runtime.scheduler.engine
    entered, release = threading.Event(), threading.Event()
    real = engine.step

    def step(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)
    engine.step = step
    return engine, entered, release


def test_a_model_with_a_request_in_flight_is_never_evicted(pool, reference):
    url = pool.url
    for name in "bc":
        complete(url, name)
    assert states(url)["b"] == states(url)["c"] == "loaded"
    engine, entered, release = _held(pool, "c")
    stream = OpenStream(url, "/v1/completions", {"model": "c", "prompt": PROMPT,
                                                  "max_tokens": 4})
    try:
        assert entered.wait(60)
        assert complete(url, "b") == reference["b"]  # b is now more recent than c
        assert complete(url, "a") == reference["a"]  # c is the LRU but busy: b goes
        assert states(url) == {"a": "loaded", "b": "on_disk", "c": "loaded"}
        engine_a, entered_a, release_a = _held(pool, "a")
        stream_a = OpenStream(url, "/v1/completions", {"model": "a", "prompt": PROMPT,
                                                        "max_tokens": 4})
        try:
            assert entered_a.wait(60)
            status, body = post(url, "/v1/completions", {"model": "b", "prompt": PROMPT,
                                                        "max_tokens": 2})
            assert status == 503 and body["error"]["code"] == "no_room_for_model", body
        finally:
            release_a.set()
            del engine_a.step
            assert stream_a.finish()[-1] == "[DONE]"
    finally:
        release.set()
        del engine.step
        assert stream.finish()[-1] == "[DONE]"
    assert complete(url, "b") == reference["b"]  # room now


def test_an_unload_waits_for_the_requests_in_flight(pool):
    """Unloading a model with a request in flight: the model is "unloading", the request
    finishes whole, then the model unloads; requests on another model go on meanwhile."""
    url = pool.url
    complete(url, "c")
    engine, entered, release = _held(pool, "c")
    stream = OpenStream(url, "/v1/completions", {"model": "c", "prompt": PROMPT,
                                                  "max_tokens": 4, "ignore_eos": True})
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        try:
            assert entered.wait(60)
            unloading = ex.submit(admin, url, "unload", model="c")
            wait_state(url, "c", "unloading")
            assert complete(url, "a") == complete(url, "a")  # another model serves
            assert not unloading.done()
        finally:
            release.set()
            del engine.step
        events = stream.finish()
        assert events[-1] == "[DONE]"
        assert [c["finish_reason"] for e in events[:-1] for c in e.get("choices", [])
                if c["finish_reason"]] == ["length"]  # all 4 tokens
        status, row = unloading.result(timeout=60)
        assert status == 200 and row["state"] == "on_disk"


def test_keep_alive_zero_unloads_after_the_answer(pool, reference):
    url = pool.url
    assert complete(url, "b", keep_alive=0) == reference["b"]
    wait_state(url, "b", "on_disk")
    status, body = post(url, "/v1/completions", {"model": "b", "prompt": PROMPT,
                                                "keep_alive": "5x"})
    assert status == 400 and body["error"]["param"] == "keep_alive"
    status, row = admin(url, "load", model="b", keep_alive="10m")
    assert status == 200 and row["state"] == "loaded" and row["keep_alive"] == 600


def test_sleep_then_wake_gives_the_same_tokens(pool, reference):
    url = pool.url
    complete(url, "a")
    compiled = rows(url)["a"]["programs"]["compiled"]
    status, row = admin(url, "sleep", model="a", level=1)
    assert status == 200 and row["state"] == "sleeping" and row["sleep_level"] == 1
    assert row["memory_bytes"] == 0 and row["host_bytes"] > 0
    assert get_json(url, "/is_sleeping?model=a")["is_sleeping"] is True
    assert complete(url, "a") == reference["a"]  # a request wakes it
    row = rows(url)["a"]
    assert row["state"] == "loaded" and row["programs"]["compiled"] == compiled
    status, row = admin(url, "sleep", model="a", level=2)
    assert status == 200 and row["state"] == "sleeping" and row["host_bytes"] == 0
    status, row = admin(url, "wake", model="a")
    assert status == 200 and row["state"] == "loaded"
    assert complete(url, "a") == reference["a"]


def test_unloading_gives_the_memory_back(pool):
    from metrale_jax.engine.residency import device_bytes_in_use
    url = pool.url
    complete(url, "a")  # its batching loop has made its KV pages (they stay)
    for name in "bc":
        assert admin(url, "unload", model=name)[0] == 200
    before = device_bytes_in_use()
    status, row = admin(url, "load", model="c")
    assert status == 200 and row["state"] == "loaded"
    loaded = device_bytes_in_use()
    assert loaded - before > row["memory_bytes"] // 4  # the weights and KV pages at least
    assert admin(url, "unload", model="c")[1]["state"] == "on_disk"
    after = device_bytes_in_use()
    assert abs(after - before) < 0.05 * (loaded - before), (before, loaded, after)


def test_concurrent_first_requests_load_the_model_once(pool, reference):
    url = pool.url
    admin(url, "unload", model="b")
    loads = rows(url)["b"]["loads"]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: complete(url, "b"), range(4)))
    assert outs == [reference["b"]] * 4
    assert rows(url)["b"]["loads"] == loads + 1


def test_admin_and_naming_errors(pool):
    url = pool.url
    status, body = admin(url, "load", model="nope")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "'a', 'b', 'c'" in body["error"]["message"]
    status, body = admin(url, "sleep", model="a", level=3)
    assert status == 400 and body["error"]["param"] == "level"
    status, body = post(url, "/v1/completions", {"model": "d", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"
    status, body = admin(url, "wake", model="c")  # on disk: not sleeping
    assert status == 400


def test_a_model_too_large_for_the_budget_is_a_503(models):
    """A budget below one model: the request gets a clear 503, nothing is loaded, and a
    one-model server's settings are unchanged (the primary loads at start regardless)."""
    import asyncio

    from serving.http.errors import UnavailableError
    from serving.http.model_pool import ModelPool
    paths, footprint = models
    pool = ModelPool(_settings(model=paths["a"], models=(f"b={paths['b']}",),
                               memory_budget_gb=0.5 * footprint / GiB))

    async def load_b():
        pool.bind_loop()
        with pytest.raises(UnavailableError) as e:
            await pool.acquire(pool.models["b"])
        return e.value

    error = asyncio.run(load_b())
    assert error.code == "model_too_large" and error.status == 503
    assert pool.models["b"].state == "on_disk"
    pool.stop()


def test_catalog_and_keep_alive_parsing(tmp_path, models):
    import math

    from metrale_jax.errors import InvalidParameterError
    from serving.http.model_catalog import catalog, models_in_dir, parse_keep_alive
    paths, _ = models
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    assert set(models_in_dir(str(tmp_path))) == {"m", "folder"}
    names = [e.name for e in catalog(_settings(model=paths["a"], served_model_name="a",
                                               models=(paths["b"],),
                                               models_dir=str(tmp_path)))]
    assert names == ["a", paths["b"], "folder", "m"]
    with pytest.raises(InvalidParameterError):
        catalog(_settings(model=paths["a"], served_model_name="x", models=(f"x={paths['b']}",)))
    assert parse_keep_alive("5m") == 300 and parse_keep_alive(0) == 0
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("1h") == 3600
    for bad in ("5x", True, "", "m5"):
        with pytest.raises(InvalidParameterError):
            parse_keep_alive(bad)


def test_serve_flags(capsys, models):
    from tests.serving.conftest import run_main
    paths, _ = models
    code, _, err = run_main(capsys, "serve", "--model", f"a={paths['a']}", "--model",
                            paths["b"], "--keep-alive", "soon")
    assert code == 2 and "--keep-alive" in err
    code, _, err = run_main(capsys, "serve", "--models-dir", str(paths["a"]))
    assert code == 2 and "no checkpoint" in err
    code, _, err = run_main(capsys, "serve", "--model", paths["a"], "--max-loaded-models", "0")
    assert code == 2 and "--max-loaded-models" in err



def test_keys_choose_the_models_and_only_admins_load(tmp_path, models, reference):
    """A key's `models` decide which of the models it may name (and so load); the pool's
    routes need an admin key; `metrale top --once` shows the models."""
    from serving.cli.top_data import render_text
    from serving.http.server import ServerThread
    paths, _ = models
    keys = tmp_path / "keys.toml"
    keys.write_text('[[keys]]\nkey = "sk-admin"\nname = "ops"\nadmin = true\n\n'
                    '[[keys]]\nkey = "sk-user"\nname = "user"\nmodels = ["a", "b"]\n')
    settings = _settings(model=paths["a"], served_model_name="a",
                         models=(f"b={paths['b']}", f"c={paths['c']}"), max_loaded_models=2,
                         api_keys_file=str(keys))
    srv = ServerThread(settings).start()
    try:
        assert srv.wait_ready(timeout=600), srv.state.runtime.error
        user = {"Authorization": "Bearer sk-user"}
        admin_key = {"Authorization": "Bearer sk-admin"}
        body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        status, _, answer = raw_post(srv.url, "/v1/completions", {**body, "model": "c"}, user)
        assert status == 404 and answer["error"]["code"] == "model_not_found"
        assert "'c'" not in answer["error"]["message"].split(";")[1]
        status, _, answer = raw_post(srv.url, "/v1/completions", {**body, "model": "b"}, user)
        assert status == 200 and answer["choices"][0]["token_ids"] == reference["b"]
        for path in ("/v1/metrale/models/unload", "/models/unload", "/sleep", "/wake_up"):
            status, _, _ = raw_post(srv.url, path, {"model": "b"}, user)
            assert status == 403, path
        status, _, listed = raw_post(srv.url, "/v1/models", b"", user, method="GET")
        assert [m["id"] for m in listed["data"]] == ["a", "b"]
        status, _, row = raw_post(srv.url, "/models/load", {"model": "c"}, admin_key)
        assert status == 200 and row["state"] == "loaded"  # b or a made room (max 2)
        status, _, stats = raw_post(srv.url, "/v1/metrale/stats", b"", admin_key, method="GET")
        text = render_text(stats)
        assert "keep-alive" in text and any(
            line.split()[:2] == ["c", "loaded"] for line in text.splitlines())
    finally:
        srv.stop()
