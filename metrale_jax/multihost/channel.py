"""The side channel's TCP ends: the leader's connection to every follower, and a follower's
to the leader (`connect` opens them once jax.distributed is initialized).

The leader listens on the jax.distributed coordinator's host, one port above the
coordinator's; a follower presents the token `connect` shares in one collective, and the
leader accepts no one else. Either end reports a peer that went away (`PeerLostError`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import secrets
import select
import socket
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from metrale_jax.errors import PeerLostError
from metrale_jax.multihost.wire import HELLO, LENGTH, frame, recv_exactly

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 300.0
"""How long the leader waits for every follower to connect (they load and place the model
first, at their own pace)."""
STOP_TIMEOUT_S = 30.0
"""How long the leader, stopping, waits for the followers to hang up."""


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
        data = frame(message)
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
                    sock.sendall(frame({"op": "stop"}))
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
                head = recv_exactly(self._sock, LENGTH.size)
                body = None if head is None else recv_exactly(self._sock,
                                                               LENGTH.unpack(head)[0])
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
        sock.sendall(HELLO.pack(token, process_id))
        log.info("process %d: connected to process 0 at %s:%d", process_id, host, port)
        return FollowerChannel(sock, process_id, on_lost)
    socks: dict[int, socket.socket] = {}
    try:
        while len(socks) < num_processes - 1:
            sock, peer = server.accept()
            sock.settimeout(10.0)
            hello = recv_exactly(sock, HELLO.size)
            if hello is None:
                sock.close()
                continue
            got, pid = HELLO.unpack(hello)
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

