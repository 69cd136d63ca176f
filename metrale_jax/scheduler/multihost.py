"""Multi-host serving: every process issues the same compiled calls, in the same order.

With `jax.distributed` one mesh spans the devices of every process, and each compiled engine
program is a collective: every process must run it, with the same host inputs, in the same
order. Process 0, the leader, owns HTTP and the batching loop (`Scheduler`): it alone decides
each iteration's admissions (slot, prompt ids, sampling settings with their seeds already
drawn) and frees (the active-slot mask of each step). The other processes, the followers,
repeat those calls on their own engines and never read an output.

How the decisions travel: a TCP side channel from the leader. `LeaderEngine` wraps the
leader's engine: each call that runs a compiled program (`init_decode_state`, `add`, `step`)
is first sent to every follower as one length-prefixed JSON message with its arguments, then
run; `run_follower` receives the calls and makes them. Why not
`multihost_utils.broadcast_one_to_all` of a fixed-size buffer every iteration:
- a decision has no fixed size (prompts, logit biases, bad words, grammar masks); a device
  broadcast needs a padded buffer per call and is one more collective per iteration;
- a closed TCP connection is the fastest sign that a peer died: the kernel closes a dead
  process's sockets at once, whereas a collective with a dead peer blocks or fails silently,
  and jax's coordination service notices only after its heartbeat timeout.
`broadcast_one_to_all` runs once, at start-up, to hand every process a random token of the
leader's; followers present it when they connect, and the leader accepts no one else.

Where: the leader listens on the jax.distributed coordinator's host (process 0's), one port
above the coordinator's (`--coordinator gpu1:8476` -> side channel on gpu1:8477).

Failure: when a follower's connection closes (or a send to it fails) the leader calls its
`on_lost` callback with a `PeerLostError`; the server fails every in-flight and waiting
request with it and exits with `EXIT_PEER_LOST` (`exit_soon`). A follower whose leader
connection closes gets `PeerLostError` out of `run_follower` and exits the same way. Exits are
`os._exit`: the loop thread may be stuck in a collective with the dead peer, and
jax.distributed's shutdown barrier would wait for it.

Followers keep at most one program's output in flight (they wait for call k-1 once call k
is issued), as the leader's loop does: XLA:CPU's collectives deadlock when many programs are
queued on its devices.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import logging
import os
import queue
import secrets
import select
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from metrale_jax.engine import Piece
from metrale_jax.engine.state import SlotSettings
from metrale_jax.errors import MetraleError, PeerLostError

log = logging.getLogger(__name__)

EXIT_PEER_LOST = 3
"""The exit status of a process whose peer died."""
CONNECT_TIMEOUT_S = 300.0
"""How long the leader waits for every follower to connect (they load and place the model
first, at their own pace)."""
STOP_TIMEOUT_S = 30.0
"""How long the leader, stopping, waits for the followers to hang up."""
_DATACLASSES: dict[str, type] = {"SlotSettings": SlotSettings, "Piece": Piece}
PAGE_CALLS = ("release", "reuse_prefix", "reserve", "cache_pages", "fork")
"""The engine's host-side page calls a follower repeats (no program runs): its page table and
prefix cache follow the leader's, so the same pages hold the same positions everywhere."""
_HELLO = struct.Struct(">16sI")  # token, process id
_LENGTH = struct.Struct(">I")


# ---- messages --------------------------------------------------------------------------------
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


def _frame(message: dict[str, Any]) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return _LENGTH.pack(len(data)) + data


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes from sock, or None when it closed first."""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


# ---- the channel -----------------------------------------------------------------------------
class LeaderChannel:
    """Process 0's end: a connection to every follower. `send` a call to all; `watch` for a
    follower that goes away; `close` tells them to stop and waits for them to hang up."""

    def __init__(self, socks: dict[int, socket.socket], num_processes: int):
        self.num_processes = num_processes
        self._socks = socks
        self._lock = threading.Lock()
        self._lost: PeerLostError | None = None
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._on_lost: Callable[[PeerLostError], None] | None = None
        self._lost_event = threading.Event()

    def send(self, message: dict[str, Any]) -> None:
        """Sends one message to every follower; raises `PeerLostError` if one is gone."""
        data = _frame(message)
        with self._lock:
            if self._lost is not None:
                raise self._lost
            for pid, sock in self._socks.items():
                try:
                    sock.sendall(data)
                except OSError as e:
                    self._lose(pid, f"a send to it failed ({e})")
                    raise self._lost from None

    def watch(self, on_lost: Callable[[PeerLostError], None]) -> None:
        """Starts a thread that calls `on_lost(error)` once, when a follower's connection
        closes (it died) while the channel is open."""
        self._on_lost = on_lost
        threading.Thread(target=self._watch, name="metrale-peers", daemon=True).start()

    def _watch(self) -> None:
        socks = {s.fileno(): pid for pid, s in self._socks.items()}
        while socks:
            ready, _, _ = select.select([self._wake_r, *[self._socks[p] for p in
                                                         socks.values()]], [], [])
            for sock in ready:
                if sock is self._wake_r:
                    return
                pid = socks.pop(sock.fileno())
                try:
                    data = sock.recv(1)
                except OSError:
                    data = b""
                why = "its connection to process 0 closed" if not data else \
                    "it sent data on a channel that only process 0 writes to"
                with self._lock:
                    if self._closing:
                        continue
                    self._lose(pid, why)
                    return

    def _lose(self, pid: int, why: str) -> None:
        """Records the loss of follower `pid` (lock held) and reports it once."""
        if self._lost is not None:
            return
        self._lost_event.set()
        self._lost = PeerLostError(
            f"process {pid} of {self.num_processes} of this multi-host server is gone ({why}); "
            "the model cannot run without it, so this request failed and the server exits")
        log.error("%s", self._lost.message)
        if self._on_lost is not None:
            threading.Thread(target=self._on_lost, args=(self._lost,), daemon=True).start()

    def lost(self, wait: float = 0.0) -> PeerLostError | None:
        """The loss of a follower, if one was seen (waiting up to `wait` s for it)."""
        self._lost_event.wait(wait)
        return self._lost

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Tells the followers to stop and waits (up to `timeout` s) until they hang up."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            alive = self._lost is None
        self._wake_w.send(b"x")
        if alive:
            try:
                for sock in self._socks.values():
                    sock.sendall(_frame({"op": "stop"}))
            except OSError:
                alive = False
        pending = list(self._socks.values()) if alive else []
        while pending:
            ready, _, _ = select.select(pending, [], [], timeout)
            if not ready:
                log.warning("%d followers did not hang up within %.0f s", len(pending), timeout)
                break
            for sock in ready:
                try:
                    if sock.recv(1):
                        continue
                except OSError:
                    pass
                pending.remove(sock)
        for sock in self._socks.values():
            _hang_up(sock)


def _hang_up(sock: socket.socket) -> None:
    """Shuts a socket down (which wakes a thread blocked reading it) and closes it."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class FollowerChannel:
    """A follower's end: `receive` the leader's messages in order.

    A reader thread owns the socket, so a leader that dies is noticed even while the loop
    thread is blocked in a collective with it: the thread then calls `on_lost(error)` (the
    server exits) and `receive` raises the `PeerLostError`.
    """

    def __init__(self, sock: socket.socket, process_id: int,
                 on_lost: Callable[[PeerLostError], None] | None = None):
        self.process_id = process_id
        self._sock = sock
        self._on_lost = on_lost
        self._closed = False
        self._queue: queue.SimpleQueue[dict[str, Any] | PeerLostError] = queue.SimpleQueue()
        threading.Thread(target=self._read, name="metrale-leader", daemon=True).start()

    def _read(self) -> None:
        why = "its connection closed"
        while True:
            try:
                head = _recv_exactly(self._sock, _LENGTH.size)
                body = None if head is None else _recv_exactly(self._sock,
                                                               _LENGTH.unpack(head)[0])
            except OSError as e:
                body, why = None, f"reading from it failed ({e})"
            if body is None:
                break
            self._queue.put(json.loads(body))
        error = PeerLostError(f"process 0 of this multi-host server is gone ({why}); "
                              f"process {self.process_id} exits")
        self._queue.put(error)
        if not self._closed:
            log.error("%s", error.message)
            if self._on_lost is not None:
                self._on_lost(error)

    def receive(self) -> dict[str, Any]:
        """The next message; raises `PeerLostError` once the leader's connection closed."""
        message = self._queue.get()
        if isinstance(message, PeerLostError):
            self._queue.put(message)
            raise message
        return message

    def close(self) -> None:
        """Hangs up (the leader sees it)."""
        self._closed = True
        _hang_up(self._sock)


def side_channel_address() -> tuple[str, int]:
    """(host, port) of the leader's side channel: the jax.distributed coordinator's host, one
    port above it. (The coordinator address is read from jax's distributed state, which holds
    it whether it came from `--coordinator` or from the TPU environment.)"""
    from jax._src import distributed
    address = distributed.global_state.coordinator_address
    if not address:
        raise RuntimeError("jax.distributed is not initialized: no coordinator address")
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) + 1


def _is_loopback(host: str) -> bool:
    try:
        return all(info[4][0].startswith("127.") or info[4][0] == "::1"
                   for info in socket.getaddrinfo(host, None))
    except OSError:
        return False


def _shared_token(mine: bytes) -> bytes:
    """Process 0's `mine` on every process (one collective over all devices)."""
    from jax.experimental import multihost_utils
    words = np.frombuffer(mine, np.int32)
    got = multihost_utils.broadcast_one_to_all(words)
    return np.asarray(got, np.int32).tobytes()


def connect(process_id: int, num_processes: int,
            on_lost: Callable[[PeerLostError], None] | None = None,
            timeout: float = CONNECT_TIMEOUT_S) -> LeaderChannel | FollowerChannel:
    """Opens the side channel; every process calls it (it holds a collective) once
    jax.distributed is initialized. Process 0 gets a `LeaderChannel` once every follower has
    connected; the others a `FollowerChannel`. `on_lost(error)` is called, from another
    thread and once, when a peer is gone (the leader: a follower; a follower: the leader)."""
    host, port = side_channel_address()
    server = None
    if process_id == 0:  # listen before the collective, so followers find it open after it
        bind = host if _is_loopback(host) else ""
        server = socket.create_server((bind, port), family=socket.AF_INET6 if ":" in bind
                                      else socket.AF_INET, backlog=num_processes)
        server.settimeout(timeout)
    token = _shared_token(secrets.token_bytes(16))
    if server is None:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.settimeout(None)
        sock.sendall(_HELLO.pack(token, process_id))
        log.info("process %d: connected to process 0 at %s:%d", process_id, host, port)
        return FollowerChannel(sock, process_id, on_lost)
    socks: dict[int, socket.socket] = {}
    try:
        while len(socks) < num_processes - 1:
            sock, peer = server.accept()
            sock.settimeout(10.0)
            hello = _recv_exactly(sock, _HELLO.size)
            if hello is None:
                sock.close()
                continue
            got, pid = _HELLO.unpack(hello)
            if not secrets.compare_digest(got, token) or not 0 < pid < num_processes \
                    or pid in socks:
                log.warning("side channel: refused a connection from %s", peer)
                sock.close()
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks[pid] = sock
    except TimeoutError:
        for sock in socks.values():
            sock.close()
        raise PeerLostError(f"only {len(socks)} of {num_processes - 1} processes connected "
                            f"to process 0 within {timeout:.0f} s") from None
    finally:
        server.close()
    log.info("process 0: %d followers connected on %s:%d", len(socks), host, port)
    channel = LeaderChannel(socks, num_processes)
    if on_lost is not None:
        channel.watch(on_lost)
    return channel


# ---- the two roles ---------------------------------------------------------------------------
class LeaderEngine:
    """The leader's engine as its `Scheduler` sees it: `init_decode_state`, `add` and `step`
    are sent to the followers, then run; everything else is the engine's own. A call that
    fails while (or just before) a follower goes away raises that `PeerLostError` instead
    (a collective with a dead peer fails with a runtime error that says nothing of it)."""

    LOST_WAIT_S = 2.0  # how long a failed call waits for the watchdog's verdict

    def __init__(self, engine: Any, channel: LeaderChannel):
        self.engine = engine
        self.channel = channel

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state_free = args[1:] if op != "init" else ()
        self.channel.send({"op": op, "args": encode(list(state_free)),
                           "kwargs": encode(kwargs)})
        try:
            return fn(*args, **kwargs)
        except MetraleError:
            raise
        except Exception as e:
            lost = self.channel.lost(self.LOST_WAIT_S)
            if lost is not None:
                raise lost from e
            raise

    def init_decode_state(self):
        """`Engine.init_decode_state`, on every process."""
        return self._call("init", self.engine.init_decode_state)

    def add(self, state, *args: Any, **kwargs: Any):
        """`Engine.add`, on every process (the state stays each process's own)."""
        return self._call("add", self.engine.add, state, *args, **kwargs)

    def step(self, state, *args: Any, **kwargs: Any):
        """`Engine.step`, on every process."""
        return self._call("step", self.engine.step, state, *args, **kwargs)

    def verify(self, state, active: Any, allowed: Any, drafts: list[list[int]]):
        """`Engine.verify` (speculative decoding), on every process."""
        return self._call("verify", self.engine.verify, state, active, allowed,
                          [[int(t) for t in d] for d in drafts])

    def beam_set(self, state, *args: Any):
        """`Engine.beam_set`, on every process."""
        return self._call("beam_set", self.engine.beam_set, state,
                          *[[list(x) for x in arg] for arg in args])

    def _host(self, op: str, *args: Any) -> Any:
        """A host-side page call (`PAGE_CALLS`), on every process (their page tables and
        prefix caches stay the same)."""
        # A lost peer: the requests are failing and the server exits; the next step raises.
        with contextlib.suppress(PeerLostError):
            self.channel.send({"op": op, "args": encode(list(args)), "kwargs": encode({})})
        return getattr(self.engine, op)(*args)

    def set_lora(self, slot: int, adapter: Any | None) -> None:
        """`Engine.set_lora`, on every process: each reads the adapter from its own path (as
        each loads the model), then runs the program that writes the slot."""
        path = None if adapter is None else adapter.path
        name = None if adapter is None else adapter.name
        return self._call("set_lora", lambda *_: self.engine.set_lora(slot, adapter), None,
                          slot, path, name)

    def release(self, slot: int) -> None:
        """`Engine.release`, on every process."""
        self._host("release", slot)

    def reuse_prefix(self, slot: int, keys: list[str], budget: int) -> int:
        """`Engine.reuse_prefix`, on every process."""
        return self._host("reuse_prefix", slot, list(keys), budget)

    def reserve(self, slot: int, length: int) -> bool:
        """`Engine.reserve`, on every process."""
        return self._host("reserve", slot, length)

    def cache_pages(self, slot: int, first: int, keys: list[str]) -> int:
        """`Engine.cache_pages`, on every process."""
        return self._host("cache_pages", slot, first, list(keys))

    def fork(self, moves: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
        """`Engine.fork`, on every process; returns its page copies."""
        return self._host("fork", [list(m) for m in moves])


def run_follower(engine: Any, channel: FollowerChannel) -> None:
    """Makes the leader's engine calls, in its order, until it says stop.

    A call that raises a `MetraleError` (a request the engine refuses) raised on the leader
    too, which then resets the state itself; any other error ends the follower. Raises
    `PeerLostError` when the leader is gone.
    """
    state = None
    in_flight = None
    while True:
        message = channel.receive()
        op = message["op"]
        if op == "stop":
            return
        args, kwargs = decode(message.get("args", [])), decode(message.get("kwargs", {}))
        try:
            if op == "init":  # its state is donated to the next call: wait for it now
                state = jax.block_until_ready(engine.init_decode_state())
                out: Any = None
            elif op == "add":
                state, out = engine.add(state, *args, **kwargs)
            elif op == "step":
                state, out = engine.step(state, *args, **kwargs)
            elif op == "verify":
                state, out, _ = engine.verify(state, *args, **kwargs)
            elif op == "beam_set":
                state, out = engine.beam_set(state, *args), None
            elif op == "set_lora":  # a program: runs in order, like a step
                slot, path, name = args
                adapter = None
                if path is not None:
                    from metrale_jax.weights.lora import load_peft_adapter
                    adapter = load_peft_adapter(path, engine.model_config, name,
                                                engine.config.max_lora_rank)
                engine.set_lora(slot, adapter)
                out = None
            elif op in PAGE_CALLS:
                getattr(engine, op)(*args)
                continue
            else:
                raise PeerLostError(f"process 0 sent an unknown call {op!r}")
        except PeerLostError:
            raise
        except MetraleError as e:
            log.warning("process %d: %s refused: %s", channel.process_id, op, e.message)
            continue
        if in_flight is not None:  # the previous call's output: never donated
            jax.block_until_ready(in_flight)
        in_flight = out


def exit_soon(code: int, grace: float) -> None:
    """Ends the process with `code` after `grace` seconds (time for the error answers to
    reach clients), from a daemon timer: `os._exit`, flushing stdio and logs first."""
    timer = threading.Timer(grace, exit_now, (code,))
    timer.daemon = True
    timer.start()


def exit_now(code: int) -> None:
    """`os._exit(code)` after flushing stdio and logging handlers."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
