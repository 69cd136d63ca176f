"""API keys and tenants: the `--api-keys` file (TOML or JSON) and `--api-key`.

    [[keys]]
    key_sha256 = "9f86d08..."   # or key = "sk-...": the file then holds the secret itself
    name = "acme-prod"          # how logs and stats name the key (default "sha256:<8 hex>")
    tenant = "acme"             # who is calling (default "default"): the prefix cache's
                                # isolation key and the scheduler's unit of fairness
    models = ["tiny", "sql"]    # the `model` names it may use (default: all)
    adapters = ["sql"]          # the LoRA adapters it may use (default: all)
    requests_per_minute = 60    # limits (serving/http/limits.py), each optional
    tokens_per_minute = 100000
    max_concurrent_requests = 8
    daily_tokens = 2000000
    min_priority = 0            # the most urgent (lowest) `priority` it may send: lower
                                # asks are a 403 (default: 0 for a key, unlimited for an
                                # admin key; a request's own default priority is 0)
    enabled = true              # false: answered 401 like an unknown key
    admin = false               # true: /v1/metrale/stats, /v1/metrale/usage and the
                                # adapter-changing routes

    [tenants.acme]
    max_concurrent = 4          # the most slots the tenant's requests hold at once

JSON: `{"keys": [...], "tenants": {...}}` with the same fields, or a bare list of keys. A
file is read whole and checked whole: an unknown field, a wrong type or a repeated key is an
error naming the entry, and a server that reloads a bad file keeps the keys it had.

Keys are never kept: each entry is stored as the SHA-256 digest of its key, and a presented
key is looked up by its digest and confirmed with `hmac.compare_digest` (a miss compares
against a dummy digest, so both paths do the same work). Nothing here logs a key.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
import tomllib
from pathlib import Path
from typing import Any

from metrale_jax.errors import MetraleError
from metrale_jax.scheduler.waiting import PRIORITY_MAX, PRIORITY_MIN

DEFAULT_TENANT = "default"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests",
           "daily_tokens")
_KEY_FIELDS = {"key", "key_sha256", "name", "tenant", "models", "adapters", "enabled",
               "admin", "min_priority", *_LIMITS}
_TENANT_FIELDS = {"max_concurrent"}
_DUMMY = hashlib.sha256(b"metrale: no such key").digest()


class KeyFileError(MetraleError):
    """The --api-keys file cannot be read or is not valid (the message names the entry)."""


def digest(key: str) -> bytes:
    """The SHA-256 digest of a key (how keys are stored and looked up)."""
    return hashlib.sha256(key.encode()).digest()


@dataclasses.dataclass(frozen=True)
class Limits:
    """A key's limits; None: none. Per minute: token buckets refilled continuously;
    daily_tokens: prompt plus completion tokens per UTC day."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    daily_tokens: int | None = None

    @property
    def any(self) -> bool:
        """Whether any limit is set."""
        return any(getattr(self, f) is not None for f in _LIMITS)


@dataclasses.dataclass(frozen=True)
class ApiKey:
    """One key's entry, without the key: its digest, name, tenant, rights and limits.

    models / adapters: the names it may use (None: all). A model or adapter it may not use
    is answered exactly as one that does not exist. min_priority: the most urgent (lowest)
    request `priority` it may send (None: the default, 0 for a key and no bound for an
    admin key; see `lowest_priority`).
    """

    digest: bytes
    name: str
    tenant: str = DEFAULT_TENANT
    models: frozenset[str] | None = None
    adapters: frozenset[str] | None = None
    limits: Limits = Limits()
    enabled: bool = True
    admin: bool = False
    min_priority: int | None = None

    @property
    def lowest_priority(self) -> int | None:
        """The lowest `priority` value the key may send (None: any)."""
        if self.min_priority is not None:
            return self.min_priority
        return None if self.admin else 0

    def may_use_model(self, name: str) -> bool:
        """Whether the key may send `name` as the request's model."""
        return self.models is None or name in self.models

    def may_use_adapter(self, name: str) -> bool:
        """Whether the key may be served with LoRA adapter `name` (by `model` or `lora`)."""
        return self.adapters is None or name in self.adapters

    def __repr__(self) -> str:  # never the digest either
        return f"ApiKey(name={self.name!r}, tenant={self.tenant!r}, admin={self.admin})"


@dataclasses.dataclass(frozen=True)
class TenantPolicy:
    """A tenant's share of the scheduler: max_concurrent slots at once (None: no cap)."""

    max_concurrent: int | None = None


@dataclasses.dataclass(frozen=True)
class KeySet:
    """The keys a server accepts, by digest, and the tenants' policies."""

    keys: dict[bytes, ApiKey]
    tenants: dict[str, TenantPolicy] = dataclasses.field(default_factory=dict)
    source: str = ""  # the file (or "--api-key"), for messages

    def find(self, presented: str) -> ApiKey | None:
        """The entry of a presented key (None: unknown), compared in constant time."""
        d = digest(presented)
        entry = self.keys.get(d)
        ok = hmac.compare_digest(d, entry.digest if entry is not None else _DUMMY)
        return entry if ok and entry is not None else None

    def policy(self, tenant: str) -> TenantPolicy:
        """The tenant's policy (the default: no cap)."""
        return self.tenants.get(tenant, TenantPolicy())

    def tenant_names(self) -> list[str]:
        """Every tenant named by a key or a policy, sorted."""
        return sorted({k.tenant for k in self.keys.values()} | set(self.tenants))


def single_key(key: str) -> KeySet:
    """`--api-key KEY`: one admin key of tenant "default", without limits."""
    d = digest(key)
    return KeySet({d: ApiKey(d, name="api-key", admin=True)}, source="--api-key")


def load_keys(path: str | Path) -> KeySet:
    """Reads and checks an --api-keys file (TOML, or JSON by suffix or leading bracket);
    raises `KeyFileError` naming the problem (never a key)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KeyFileError(f"--api-keys {path}: cannot read it ({e})") from None
    as_json = path.suffix.lower() == ".json" or (
        path.suffix.lower() != ".toml" and text.lstrip()[:1] in ("{", "["))
    try:
        data: Any = json.loads(text) if as_json else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        kind = "JSON" if as_json else "TOML"
        raise KeyFileError(f"--api-keys {path}: not valid {kind} ({e})") from None
    return parse_keys(data, str(path))


def parse_keys(data: Any, source: str) -> KeySet:
    """A key set from the parsed file (see the module docstring)."""
    if isinstance(data, list):
        data = {"keys": data}
    if not isinstance(data, dict):
        raise KeyFileError(f"--api-keys {source}: expected a table with 'keys'")
    extra = set(data) - {"keys", "tenants"}
    if extra:
        raise KeyFileError(f"--api-keys {source}: unknown top-level field(s) "
                           f"{', '.join(sorted(extra))} (expected 'keys' and 'tenants')")
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise KeyFileError(f"--api-keys {source}: 'keys' must be a non-empty list of entries")
    keys: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for i, raw in enumerate(entries):
        where = f"--api-keys {source}: keys[{i}]"
        entry = _parse_key(raw, where)
        if entry.digest in keys:
            raise KeyFileError(f"{where}: the same key as {keys[entry.digest].name!r}")
        if entry.name in names:
            raise KeyFileError(f"{where}: the name {entry.name!r} is used twice")
        names.add(entry.name)
        keys[entry.digest] = entry
    tenants = _parse_tenants(data.get("tenants", {}), source)
    return KeySet(keys, tenants, source)


def _parse_key(raw: Any, where: str) -> ApiKey:
    if not isinstance(raw, dict):
        raise KeyFileError(f"{where}: expected a table of fields")
    unknown = set(raw) - _KEY_FIELDS
    if unknown:
        raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    if ("key" in raw) == ("key_sha256" in raw):
        raise KeyFileError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if "key" in raw:
        key = raw["key"]
        if not isinstance(key, str) or not key or key != key.strip() or " " in key:
            raise KeyFileError(f"{where}: 'key' must be a non-empty string without spaces")
        d = digest(key)
    else:
        hexd = raw["key_sha256"]
        if not isinstance(hexd, str) or not _HEX64.fullmatch(hexd):
            raise KeyFileError(f"{where}: 'key_sha256' must be 64 hex digits (sha256sum)")
        d = bytes.fromhex(hexd)
    name = _string(raw, "name", where, f"sha256:{d.hex()[:8]}")
    tenant = _string(raw, "tenant", where, DEFAULT_TENANT)
    limits = Limits(**{f: _count(raw, f, where) for f in _LIMITS})
    return ApiKey(d, name, tenant, _names(raw, "models", where), _names(raw, "adapters", where),
                  limits, _flag(raw, "enabled", where, True), _flag(raw, "admin", where, False),
                  _priority(raw, "min_priority", where))


def _parse_tenants(raw: Any, source: str) -> dict[str, TenantPolicy]:
    if not isinstance(raw, dict):
        raise KeyFileError(f"--api-keys {source}: 'tenants' must be a table of tenants")
    out = {}
    for name, fields in raw.items():
        where = f"--api-keys {source}: tenants.{name}"
        if not isinstance(fields, dict):
            raise KeyFileError(f"{where}: expected a table of fields")
        unknown = set(fields) - _TENANT_FIELDS
        if unknown:
            raise KeyFileError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        out[name] = TenantPolicy(_count(fields, "max_concurrent", where))
    return out


def _string(raw: dict, field: str, where: str, default: str) -> str:
    value = raw.get(field, default)
    if not isinstance(value, str) or not value.strip():
        raise KeyFileError(f"{where}: {field!r} must be a non-empty string")
    return value


def _count(raw: dict, field: str, where: str) -> int | None:
    value = raw.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeyFileError(f"{where}: {field!r} must be a whole number >= 1")
    return value


def _priority(raw: dict, field: str, where: str) -> int | None:
    value = raw.get(field)
    if value is None:
        return None
    lo, hi = PRIORITY_MIN, PRIORITY_MAX
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise KeyFileError(f"{where}: {field!r} must be a whole number from {lo} to {hi}")
    return value


def _flag(raw: dict, field: str, where: str, default: bool) -> bool:
    value = raw.get(field, default)
    if not isinstance(value, bool):
        raise KeyFileError(f"{where}: {field!r} must be true or false")
    return value


def _names(raw: dict, field: str, where: str) -> frozenset[str] | None:
    value = raw.get(field)
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise KeyFileError(f"{where}: {field!r} must be a list of names")
    return frozenset(value)
