"""The --api-keys file (TOML and JSON, plain and hashed keys, every error named), the
constant-time lookup, and the limiter's buckets and quota on an injected clock."""

from __future__ import annotations

import hashlib
import json

import pytest

from serving.http import keys as keys_module
from serving.http.errors import RateLimitError
from serving.http.keys import KeyFileError, Limits, load_keys, single_key
from serving.http.limits import KeyLimiter, Limiter, duration

NOON = 1_767_225_600.0 + 12 * 3600  # 2026-01-01 12:00 UTC

TOML = f"""
[[keys]]
key = "sk-alice"
name = "alice"
tenant = "acme"
models = ["tiny"]
adapters = []
requests_per_minute = 3
tokens_per_minute = 600
max_concurrent_requests = 2
daily_tokens = 1000

[[keys]]
key_sha256 = "{hashlib.sha256(b"sk-hashed").hexdigest()}"
tenant = "acme"
admin = true

[[keys]]
key = "sk-off"
enabled = false

[tenants.acme]
max_concurrent = 4
"""


def test_a_toml_file(tmp_path):
    path = tmp_path / "keys.toml"
    path.write_text(TOML)
    ks = load_keys(path)
    alice = ks.find("sk-alice")
    assert alice.name == "alice" and alice.tenant == "acme" and not alice.admin
    assert alice.models == {"tiny"} and alice.adapters == frozenset()
    assert alice.limits == Limits(3, 600, 2, 1000)
    assert alice.may_use_model("tiny") and not alice.may_use_model("sql")
    assert not alice.may_use_adapter("sql")
    hashed = ks.find("sk-hashed")
    assert hashed.admin and hashed.name == "sha256:" + hashlib.sha256(b"sk-hashed").hexdigest()[:8]
    assert hashed.models is None and hashed.limits == Limits() and not hashed.limits.any
    assert ks.find("sk-off").enabled is False
    assert ks.find("sk-nobody") is None and ks.find("") is None
    assert ks.policy("acme").max_concurrent == 4 and ks.policy("other").max_concurrent is None
    assert ks.tenant_names() == ["acme", "default"]
    assert "sk-" not in repr(alice) and alice.digest.hex() not in repr(alice)


def test_a_json_file_and_a_bare_list(tmp_path):
    for name, data in [("keys.json", {"keys": [{"key": "k1", "tenant": "t"}],
                                      "tenants": {"t": {"max_concurrent": 1}}}),
                       ("keys.conf", [{"key": "k1", "tenant": "t"}])]:
        path = tmp_path / name
        path.write_text(json.dumps(data))
        assert load_keys(path).find("k1").tenant == "t"


def test_lookup_is_by_digest_with_a_constant_time_compare(monkeypatch):
    """Every lookup, hit or miss, ends in one hmac.compare_digest of two SHA-256 digests."""
    calls = []
    real = keys_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)
    monkeypatch.setattr(keys_module.hmac, "compare_digest", spy)
    ks = single_key("sekrit")
    assert ks.find("sekrit") is not None and ks.find("wrong") is None
    assert len(calls) == 2 and all(len(a) == len(b) == 32 for a, b in calls)
    assert calls[0][0] == hashlib.sha256(b"sekrit").digest()
    assert all(b"sekrit" not in a + b for a, b in calls)


BAD = [
    ("[[keys]]\ntenant = 'x'\n", "exactly one of 'key' and 'key_sha256'"),
    ("[[keys]]\nkey = 'a'\nkey_sha256 = 'b'\n", "exactly one of"),
    ("[[keys]]\nkey_sha256 = 'abc'\n", "64 hex digits"),
    ("[[keys]]\nkey = 'a'\nrequests_per_minute = 0\n", "'requests_per_minute' must be"),
    ("[[keys]]\nkey = 'a'\ntokens_per_minute = 1.5\n", "'tokens_per_minute' must be"),
    ("[[keys]]\nkey = 'a'\nadmin = 'yes'\n", "'admin' must be true or false"),
    ("[[keys]]\nkey = 'a'\nmodels = 'tiny'\n", "'models' must be a list"),
    ("[[keys]]\nkey = 'a'\ncolour = 'red'\n", "unknown field(s) colour"),
    ("[[keys]]\nkey = 'a'\n[[keys]]\nkey = 'a'\n", "keys[1]: the same key as"),
    ("[[keys]]\nkey = 'a'\nname = 'n'\n[[keys]]\nkey = 'b'\nname = 'n'\n", "used twice"),
    ("[[keys]]\nkey = 'a'\n[tenants.t]\nshare = 2\n", "tenants.t: unknown field(s) share"),
    ("keys = []\n", "non-empty list"),
    ("[[keys]\n", "not valid TOML"),
    ("[[keys]]\nkey = 'has space'\n", "without spaces"),
]


@pytest.mark.parametrize(("text", "needle"), BAD, ids=[b[1] for b in BAD])
def test_bad_files_name_the_problem_never_the_key(tmp_path, text, needle):
    path = tmp_path / "keys.toml"
    path.write_text(text)
    with pytest.raises(KeyFileError) as e:
        load_keys(path)
    assert needle in e.value.message and str(path) in e.value.message
    assert "'a'" not in e.value.message.replace("'a' must", "")


def test_a_missing_file(tmp_path):
    with pytest.raises(KeyFileError, match="cannot read it"):
        load_keys(tmp_path / "absent.toml")


class Clock:
    def __init__(self, t: float = NOON):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_the_requests_bucket_trips_at_its_limit_and_refills():
    clock = Clock()
    lim = KeyLimiter(Limits(requests_per_minute=3), clock())
    for left in (2, 1, 0):
        lim.arrive("k", clock())
        lim.leave()
        assert lim.headers(clock())["x-ratelimit-remaining-requests"] == str(left)
    assert lim.headers(clock())["x-ratelimit-reset-requests"] == "1m0s"
    with pytest.raises(RateLimitError) as e:
        lim.arrive("k", clock())
    assert e.value.retry_after == 20 and e.value.status == 429
    clock.t += 20
    lim.arrive("k", clock())  # one request came back
    clock.t += 60
    assert lim.headers(clock()) == {"x-ratelimit-limit-requests": "3",
                                    "x-ratelimit-remaining-requests": "3",
                                    "x-ratelimit-reset-requests": "0s"}


def test_tokens_are_reserved_then_settled_to_the_actual_use():
    clock = Clock()
    lim = KeyLimiter(Limits(tokens_per_minute=600, daily_tokens=1000), clock())
    r = lim.reserve("k", 100, clock())
    assert lim.tokens.remaining(clock()) == 500 and lim.daily.left(clock()) == 900
    lim.settle(r, 30, clock())
    assert lim.tokens.remaining(clock()) == 570 and lim.daily.left(clock()) == 970
    with pytest.raises(RateLimitError, match="request too large"):
        lim.reserve("k", 601, clock())
    with pytest.raises(RateLimitError) as e:
        lim.reserve("k", 571, clock())
    assert e.value.retry_after == pytest.approx(0.1)  # one token at 10 per second
    lim.reserve("k", 570, clock())  # exactly what is left
    assert lim.tokens.remaining(clock()) == 0
    clock.t += 60  # the bucket is full again; the day's quota has 1000 - 30 - 570 left
    with pytest.raises(RateLimitError, match="daily quota") as e:
        lim.reserve("k", 401, clock())
    assert e.value.retry_after == 12 * 3600 - 60  # at 00:00 UTC


def test_concurrency_and_the_daily_quota_at_arrival():
    clock = Clock()
    lim = KeyLimiter(Limits(max_concurrent_requests=2, daily_tokens=10), clock())
    lim.arrive("k", clock())
    lim.arrive("k", clock())
    with pytest.raises(RateLimitError, match="in flight"):
        lim.arrive("k", clock())
    lim.leave()
    lim.arrive("k", clock())
    lim.leave()
    lim.leave()
    lim.settle(lim.reserve("k", 10, clock()), 10, clock())
    with pytest.raises(RateLimitError, match="used its daily quota"):
        lim.arrive("k", clock())
    clock.t += 12 * 3600  # midnight
    lim.arrive("k", clock())


def test_the_limiter_keeps_state_across_reloads_until_a_limit_changes():
    clock = Clock()
    limiter = Limiter(clock)
    ks = single_key("a")
    (key,) = ks.keys.values()
    import dataclasses
    key = dataclasses.replace(key, limits=Limits(requests_per_minute=5))
    limiter.of(key).arrive("k", clock())
    assert limiter.of(key).requests.remaining(clock()) == 4
    assert limiter.of(dataclasses.replace(key, admin=False)).requests.remaining(clock()) == 4
    changed = dataclasses.replace(key, limits=Limits(requests_per_minute=7))
    assert limiter.of(changed).requests.remaining(clock()) == 7
    limiter.forget_except(set())
    assert limiter.of(key).requests.remaining(clock()) == 5


def test_openai_duration_format():
    assert [duration(s) for s in (0, 0.02, 0.5, 1, 1.2, 59, 60, 360, 3600 + 61)] == [
        "0s", "20ms", "500ms", "1s", "2s", "59s", "1m0s", "6m0s", "1h1m1s"]
