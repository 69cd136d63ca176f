"""Running the app on Hypercorn: `serve()` (the CLI) and `ServerThread` (tests, notebooks).

Hypercorn is configured in code. The listening socket is bound here, before Hypercorn starts,
so port 0 works and the real URL is known. SIGHUP re-reads the `--api-keys` file
(`Access.reload`; `ServerThread.reload_keys` in tests). Shutdown (SIGTERM/SIGINT, or
`ServerThread.stop`) drains: /health and new requests get 503, in-flight requests get
`grace_period` seconds, the rest are cancelled and answered, then Hypercorn closes its
connections. A server on a borrowed runtime (`ServerState.owns_runtime`) leaves it running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable

from hypercorn.asyncio import serve as hypercorn_serve
from hypercorn.config import Config
from quart import Quart

from serving.http.app import create_app, server_state
from serving.http.runtime import ModelRuntime
from serving.http.settings import ServerSettings
from serving.progress import ProgressFn

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0 = a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock


def hypercorn_config(sock: socket.socket) -> Config:
    """Hypercorn's settings for the server: our socket, no access log, quick keep-alive."""
    config = Config()
    # Hypercorn closes the socket it serves on: give it a duplicate, ours stays ours.
    config.bind = [f"fd://{os.dup(sock.fileno())}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 5.0
    config.keep_alive_timeout = 75.0
    config.h11_max_incomplete_size = 64 * 1024
    return config


def url_of(sock: socket.socket) -> str:
    """The base URL of the OpenAI API on `sock`."""
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}"


async def run_server(app: Quart, sock: socket.socket, stop: asyncio.Event,
                     on_ready: Callable[[str], None] | None = None) -> None:
    """Serves `app` on `sock` until `stop` is set, then drains and shuts down.

    `on_ready(url)` runs once the model is loaded and warm. A loading failure stops the server
    and raises the loading error.
    """
    state = server_state(app)
    shutdown = asyncio.Event()

    async def supervise() -> None:
        await state.runtime.wait_loaded()
        if state.runtime.state == "failed":
            shutdown.set()
            return
        if on_ready is not None:
            on_ready(url_of(sock))
        await stop.wait()
        await state.drain()
        shutdown.set()

    async def stopped_early() -> None:
        await stop.wait()
        await asyncio.sleep(0)  # let supervise() start the drain first
        if not state.runtime.ready:
            shutdown.set()

    tasks = [asyncio.create_task(supervise()), asyncio.create_task(stopped_early())]
    try:
        await hypercorn_serve(app, hypercorn_config(sock), shutdown_trigger=shutdown.wait)
    finally:
        for t in tasks:
            t.cancel()
        state.pool.stop()
    if state.runtime.error is not None:
        raise state.runtime.error


def serve(settings: ServerSettings, on_ready: Callable[[str], None] | None = None,
          progress: ProgressFn | None = None) -> None:
    """Runs the server in this (main) thread until SIGTERM or SIGINT.

    `progress(stage, done, total)` reports loading and compiling (the CLI's bars)."""
    sock = bind_socket(settings.host, settings.port)
    app = create_app(settings, ModelRuntime(settings, progress) if progress else None)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # SIGHUP: read the --api-keys file again (requests in flight go on)
        loop.add_signal_handler(signal.SIGHUP, server_state(app).access.reload)
        await run_server(app, sock, stop, on_ready)

    try:
        asyncio.run(main())
    finally:
        sock.close()


class ServerThread:
    """The server in a background thread with its own event loop (tests, notebooks).

        with ServerThread(settings) as server:
            server.wait_ready(timeout=120)
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    """

    def __init__(self, settings: ServerSettings, runtime=None):
        self.settings = settings
        self.sock = bind_socket(settings.host, settings.port)
        self.url = url_of(self.sock)
        self.app = create_app(settings, runtime)
        self.state = server_state(self.app)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._started = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="metrale-http", daemon=True)

    def _main(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._started.set()
            await run_server(self.app, self.sock, self._stop, lambda _: self._ready.set())

        try:
            asyncio.run(main())
        except BaseException as e:
            self.error = e
            log.error("server thread ended: %s", e)
        finally:
            self._started.set()
            self._ready.set()

    def start(self) -> ServerThread:
        """Starts serving (loading begins now)."""
        self._thread.start()
        self._started.wait()
        return self

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the model is ready; raises the loading error if it failed."""
        ok = self._ready.wait(timeout)
        if self.error is not None:
            raise self.error
        return ok and self.state.runtime.ready

    def reload_keys(self, timeout: float = 30.0) -> bool:
        """What SIGHUP does to `serve()`: `Access.reload` on the server's event loop (a
        signal cannot reach a server in a thread). Returns whether the new keys are in use."""
        assert self._loop is not None, "the server is not started"
        access = self.state.access

        async def reload() -> bool:
            return access.reload()
        return asyncio.run_coroutine_threadsafe(reload(), self._loop).result(timeout)

    def stop(self, timeout: float = 60.0) -> None:
        """Drains and stops the server, then joins its thread."""
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
