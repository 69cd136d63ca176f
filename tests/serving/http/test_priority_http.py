"""A request's `priority` over real HTTP: every generating route takes it (400 for a bad
value, in the route's error shape), it reaches the scheduler, and a key's `min_priority`
bounds it (403). The keyed server borrows the shared tiny server's loaded runtime, so
nothing loads or compiles again."""

from __future__ import annotations

import dataclasses

import pytest

from serving.http.keys import KeyFileError, parse_keys
from tests.serving.conftest import MODEL, post, wait_healthy

KEYS = """
[[keys]]
key = "sk-user"
name = "user"
tenant = "u"

[[keys]]
key = "sk-vip"
name = "vip"
tenant = "v"
min_priority = -10

[[keys]]
key = "sk-root"
name = "root"
tenant = "ops"
admin = true

[[keys]]
key = "sk-root-bounded"
name = "root-bounded"
tenant = "ops"
admin = true
min_priority = -1
"""

USER = [{"role": "user", "content": "hi"}]
ROUTES = {  # route -> a body that generates one token
    "/v1/chat/completions": {"messages": USER, "max_tokens": 1},
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/responses": {"input": "hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"messages": USER, "max_tokens": 1},
}


def _body(route: str, **extra) -> dict:
    return {"model": MODEL, "temperature": 0, **ROUTES[route], **extra}


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("bad", [1.5, "1", True, None, 2**31, -(2**31) - 1])
def test_a_bad_priority_is_a_400_in_the_routes_shape(base_url, route, bad):
    got, _, out = post(base_url, route, _body(route, priority=bad))
    assert got == 400, out
    if route == "/v1/messages":
        assert out["type"] == "error" and out["error"]["type"] == "invalid_request_error"
        assert "priority" in out["error"]["message"]
    else:
        assert out["error"]["type"] == "invalid_request_error"
        assert out["error"]["param"] == "priority"


@pytest.fixture
def submitted(server, monkeypatch) -> list:
    """The `GenerationRequest`s the shared server's scheduler is given (recorded)."""
    sched = server.state.runtime.scheduler
    seen: list = []
    real = sched.submit

    def submit(request, loop=None):
        seen.append(request)
        return real(request, loop=loop)
    monkeypatch.setattr(sched, "submit", submit)
    return seen


def test_every_route_carries_the_priority_to_the_scheduler(base_url, submitted):
    for route in ROUTES:
        for priority in (-3, None):
            extra = {} if priority is None else {"priority": priority}
            got, _, out = post(base_url, route, _body(route, **extra))
            assert got == 200, (route, out)
    assert [r.priority for r in submitted] == [-3, 0] * len(ROUTES)


@pytest.fixture(scope="module")
def keyed(server, tmp_path_factory):
    from serving.http.server import ServerThread
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    srv = ServerThread(dataclasses.replace(server.settings, api_keys_file=str(path)),
                       runtime=server.state.runtime).start()
    assert srv.wait_ready(timeout=60)
    wait_healthy(srv.url)
    yield srv.url
    srv.stop()


@pytest.mark.parametrize("key,priority,status", [
    ("sk-user", 0, 200), ("sk-user", 7, 200), ("sk-user", -1, 403),
    ("sk-vip", -10, 200), ("sk-vip", -11, 403),
    ("sk-root", -(2**31), 200), ("sk-root-bounded", -1, 200), ("sk-root-bounded", -2, 403)])
def test_a_key_may_not_ask_for_more_urgency_than_its_min_priority(keyed, key, priority, status):
    route = "/v1/completions"
    got, _, out = post(keyed, route, _body(route, priority=priority),
                       {"Authorization": f"Bearer {key}"})
    assert got == status, out
    if status == 403:
        assert out["error"] == {"message": out["error"]["message"], "type": "permission_error",
                                "param": "priority", "code": "priority_not_allowed"}
        assert str(priority) in out["error"]["message"]


def test_the_priority_limit_holds_on_every_route(keyed):
    for route in ROUTES:
        got, _, out = post(keyed, route, _body(route, priority=-5), {"x-api-key": "sk-user"})
        assert got == 403, (route, out)
        if route == "/v1/messages":
            assert out["type"] == "error" and out["error"]["type"] == "permission_error"
        else:
            assert out["error"]["code"] == "priority_not_allowed"


@pytest.mark.parametrize("value", ["-1", 1.0, True, 2**31])
def test_a_bad_min_priority_in_the_keys_file_names_the_entry(value):
    with pytest.raises(KeyFileError, match=r"keys\[0\]: 'min_priority' must be a whole"):
        parse_keys({"keys": [{"key": "sk-x", "min_priority": value}]}, "k.toml")


def test_min_priority_defaults_to_0_for_a_key_and_none_for_an_admin_key():
    keys = parse_keys({"keys": [{"key": "a", "name": "a"},
                                {"key": "b", "name": "b", "admin": True},
                                {"key": "c", "name": "c", "admin": True, "min_priority": 3}]},
                      "k.toml")
    assert {k.name: k.lowest_priority for k in keys.keys.values()} == {"a": 0, "b": None,
                                                                       "c": 3}
