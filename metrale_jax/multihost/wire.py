"""The side channel's wire format: engine calls as length-prefixed JSON messages.

A message is `{"op": name, "args": [...], "kwargs": {...}}` with every value in `encode`'s
JSON-ready form, framed by a 4-byte big-endian length (`frame`). A follower opens its
connection with `HELLO` (the shared token and its process id).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import socket
import struct
from typing import Any

import jax
import numpy as np

from metrale_jax.engine import Piece, SlotSettings

PAGE_CALLS = ("release", "reuse_prefix", "reserve", "cache_pages", "fork")
"""The engine's host-side page calls a follower repeats (no program runs): its page table and
prefix cache follow the leader's, so the same pages hold the same positions everywhere."""
HELLO = struct.Struct(">16sI")
"""A follower's first bytes: the leader's shared token (16 bytes) and its process id."""
LENGTH = struct.Struct(">I")
"""The length prefix of every message."""
_DATACLASSES: dict[str, type] = {"SlotSettings": SlotSettings, "Piece": Piece}


def encode(value: Any) -> Any:
    """A JSON-ready form of an engine call's argument: numbers, strings, None, lists, tuples,
    str-keyed dicts, NumPy arrays (dtype, shape, base64 bytes) and `SlotSettings`. Floats
    survive exactly (JSON writes their repr)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, jax.Array):
        value = np.asarray(value)
    if isinstance(value, np.ndarray):
        data = base64.b64encode(np.ascontiguousarray(value).tobytes()).decode()
        return {"__nd__": [value.dtype.str, list(value.shape), data]}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}
    name = type(value).__name__
    if dataclasses.is_dataclass(value) and _DATACLASSES.get(name) is type(value):
        return {"__dc__": name, "fields": {f.name: encode(getattr(value, f.name))
                                           for f in dataclasses.fields(value)}}
    raise TypeError(f"cannot send a {type(value).__name__} to the other processes")


def decode(value: Any) -> Any:
    """The inverse of `encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__nd__" in value:
        dtype, shape, data = value["__nd__"]
        return np.frombuffer(base64.b64decode(data), np.dtype(dtype)).reshape(shape).copy()
    if "__tuple__" in value:
        return tuple(decode(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {k: decode(v) for k, v in value["__dict__"].items()}
    if "__dc__" in value:
        return _DATACLASSES[value["__dc__"]](**{k: decode(v) for k, v in value["fields"].items()})
    raise ValueError(f"unknown message value {sorted(value)}")


def frame(message: dict[str, Any]) -> bytes:
    """`message` as bytes on the wire: its length (`LENGTH`), then its compact JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    return LENGTH.pack(len(data)) + data


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from sock, or None when it closed first."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)
