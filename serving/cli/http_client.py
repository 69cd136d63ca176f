"""A small blocking HTTP client for the CLI's tools (`chat --url`, `bench`, `top`).

Standard library only (`http.client`), so the tools need no client package: JSON requests,
and Server-Sent Events streams read line by line as they arrive. One connection per request;
closing a stream closes its connection, which is how the server learns that the client left
(it then cancels the request).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from metrale_jax.errors import InvalidParameterError


class APIError(Exception):
    """The server answered with an error (HTTP status ≥ 400, or an error event in a stream).

    status: the HTTP status (None for an error sent inside a stream). message: the OpenAI
    error message, or the start of the body when it was not OpenAI's shape.
    """

    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message


class UnreachableError(Exception):
    """The server could not be reached (refused, unknown host, timed out, connection lost)."""


def base_url(url: str) -> str:
    """`url` checked and normalized to `scheme://host[:port][/prefix]` without a trailing
    `/v1`; raises `InvalidParameterError` (a usage error) for anything else."""
    try:
        parts = urlsplit(url.strip())
    except ValueError as e:  # e.g. an unclosed [IPv6 bracket
        raise InvalidParameterError(f"--url {url!r}: {e}", param="url") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidParameterError(f"--url {url!r}: give http://HOST:PORT (or https://...)",
                                    param="url")
    try:
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError:
        raise InvalidParameterError(f"--url {url!r}: bad port", param="url") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


def _error_message(raw: bytes) -> str:
    try:
        body = json.loads(raw)
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace").strip()[:300] or "(empty body)"


class Client:
    """Requests to one server: `Client("http://127.0.0.1:8000", api_key=None)`."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        self.url = base_url(url)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port
        self._prefix = parts.path
        self.timeout = timeout
        self.headers = {"Content-Type": "application/json", "Accept": "*/*"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def _connect(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout)

    def _send(self, method: str, path: str,
              body: dict[str, Any] | None) -> tuple[http.client.HTTPConnection,
                                                      http.client.HTTPResponse]:
        conn = self._connect()
        data = json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, self._prefix + path, data, self.headers)
            resp = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise UnreachableError(f"cannot reach {self.url}: {_reason(e)}") from None
        if resp.status >= 400:
            raw = resp.read()
            conn.close()
            raise APIError(resp.status, _error_message(raw))
        return conn, resp

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
        """The body of a successful answer; raises `APIError` or `UnreachableError`."""
        conn, resp = self._send(method, path, body)
        try:
            return resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise UnreachableError(f"connection to {self.url} lost: {_reason(e)}") from None
        finally:
            conn.close()

    def get_json(self, path: str) -> Any:
        """GET `path` as JSON."""
        return json.loads(self.request("GET", path))

    def get_text(self, path: str) -> str:
        """GET `path` as text (e.g. /metrics)."""
        return self.request("GET", path).decode("utf-8", "replace")

    def post_json(self, path: str, body: dict[str, Any]) -> Any:
        """POST a JSON body, return the JSON answer."""
        return json.loads(self.request("POST", path, body))

    def stream(self, path: str, body: dict[str, Any]) -> SSEStream:
        """POST a streaming request; iterate the returned `SSEStream` for its events."""
        conn, resp = self._send("POST", path, body)
        return SSEStream(conn, resp, self.url)

    def first_model(self) -> str:
        """The id of the first model /v1/models lists."""
        data = self.get_json("/v1/models").get("data") or []
        if not data:
            raise APIError(None, f"{self.url}/v1/models lists no model")
        return str(data[0]["id"])


class SSEStream:
    """The `data:` payloads of a Server-Sent Events answer, parsed as JSON, until `[DONE]`.

    An `{"error": ...}` payload raises `APIError`. `close()` (or leaving a `with` block)
    drops the connection; it is safe to call more than once.
    """

    def __init__(self, conn: http.client.HTTPConnection, resp: http.client.HTTPResponse,
                 url: str):
        self._conn = conn
        self._resp = resp
        self._url = url

    def __iter__(self) -> Iterator[dict[str, Any]]:
        try:
            for raw in self._resp:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    return
                event = json.loads(payload)
                if isinstance(event, dict) and "error" in event:
                    error = event["error"]
                    message = error.get("message") if isinstance(error, dict) else error
                    raise APIError(None, str(message))
                yield event
        except (OSError, http.client.HTTPException) as e:
            raise UnreachableError(f"connection to {self._url} lost: {_reason(e)}") from None
        finally:
            self.close()

    def close(self) -> None:
        """Closes the connection (the server sees the client leave)."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self._conn.close()

    def __enter__(self) -> SSEStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError):
        return "timed out"
    return getattr(e, "strerror", None) or str(e) or type(e).__name__
