"""Loading a content part's image: data URLs, and http URLs from allowed hosts, fetched from a
server on 127.0.0.1 (redirects, limits, errors, a timeout)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from metrale_jax.errors import InvalidParameterError
from metrale_jax.vision import (
    ImageLimits,
    check_image_count,
    host_allowed,
    image_digest,
    load_image_url,
)

PARAM = "messages[1].content[2]"


def _png(width: int = 12, height: int = 8, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


PNG = _png()
BIG_PNG = _png(64, 64, seed=1)


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def _refused(url: str, limits: ImageLimits, match: str) -> InvalidParameterError:
    """Loading `url` raises an InvalidParameterError for PARAM whose message names PARAM and
    matches `match`."""
    with pytest.raises(InvalidParameterError, match=match) as info:
        load_image_url(url, limits, param=PARAM)
    assert info.value.param == PARAM and info.value.message.startswith(PARAM + ": ")
    assert info.value.status == 400
    return info.value


# ------------------------------------------------------------------------------ data URLs


def test_data_url():
    image, data = load_image_url(_data_url(PNG), ImageLimits(), param=PARAM)
    assert data == PNG and image.size == (12, 8) and image.format == "PNG"
    assert image_digest(data) == hashlib.sha256(PNG).hexdigest()
    assert len(image_digest(data)) == 64


@pytest.mark.parametrize("prefix", ["data:image/jpeg;base64,", "DATA:Image/PNG;BASE64,",
                                    "data:image/x-anything;charset=binary;base64,"])
def test_data_url_media_type_is_lenient(prefix: str):
    """Any image/* type, in any case: the bytes decide the format."""
    image, _ = load_image_url(prefix + base64.b64encode(PNG).decode(), ImageLimits(),
                              param=PARAM)
    assert image.format == "PNG"


@pytest.mark.parametrize("url, match", [
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png;base64,iVBORw0KGgo", "not valid base64"),  # bad padding
    ("data:image/png;base64,iVBO Rw0K", "not valid base64"),
    ("data:image/png;base64,é", "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", "media type is 'text/plain'"),
    ("data:;base64,aGVsbG8=", "media type is 'missing'"),
    ("data:image/png,rawbytes", "not base64"),
    ("data:image/png;base64", "no ','"),
    ("data:image/png;base64,aGVsbG8=", "could not be read"),  # base64 of "hello"
    ("data:image/png;base64,", "could not be read"),
])
def test_bad_data_urls(url: str, match: str):
    _refused(url, ImageLimits(), match)


def test_data_url_size_limits():
    """Over max_bytes: refused after decoding when just over, and from the base64's length
    alone (before decoding) when far over."""
    size = len(PNG)
    _refused(_data_url(PNG + b"\0"), ImageLimits(max_bytes=size),
             f"is {size + 1} bytes, more than the {size} allowed")
    load_image_url(_data_url(PNG), ImageLimits(max_bytes=size), param=PARAM)
    _refused("data:image/png;base64," + "A" * 1_000_000, ImageLimits(max_bytes=1000),
             "at least 749998 bytes, more than the 1000 allowed")


def test_data_url_pixel_limit():
    _refused(_data_url(PNG), ImageLimits(max_pixels=95), "12x8 = 96 pixels, more than the 95")


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/a.png", "img.png",
                                 "", "javascript:alert(1)", "127.0.0.1:80/a.png"])
def test_other_schemes_refused(url: str):
    _refused(url, ImageLimits(allowed_domains=("127.0.0.1",)), "unsupported image URL")


def test_image_count():
    check_image_count(8, ImageLimits())
    with pytest.raises(InvalidParameterError, match="9 images, more than the 8") as info:
        check_image_count(9, ImageLimits(), param="messages[0].content")
    assert info.value.param == "messages[0].content"


# ------------------------------------------------------------------------- allowed hosts


def test_host_allowed():
    domains = ("example.com", "127.0.0.1", "Images.Test.")
    assert host_allowed("example.com", domains)
    assert host_allowed("img.cdn.example.com", domains)
    assert host_allowed("EXAMPLE.com.", domains)
    assert host_allowed("images.test", domains) and host_allowed("a.images.test", domains)
    assert host_allowed("127.0.0.1", domains)
    assert not host_allowed("badexample.com", domains)
    assert not host_allowed("example.com.evil.org", domains)
    assert not host_allowed("127.0.0.2", domains) and not host_allowed("", domains)
    assert not host_allowed("example.com", ())


def test_limits_normalize_and_check():
    assert ImageLimits(allowed_domains=[" LocalHost. ", ".example.com", ""]).allowed_domains \
        == ("localhost", "example.com")
    with pytest.raises(TypeError):
        ImageLimits(allowed_domains="example.com")
    for bad in ({"max_bytes": 0}, {"max_images": -1}, {"fetch_timeout_s": 0},
                {"max_redirects": -1}):
        with pytest.raises(ValueError):
            ImageLimits(**bad)


# ----------------------------------------------------------------- fetching from a server


class _Server:
    """A loopback HTTP server with one path per behaviour; records the paths requested."""

    def __init__(self):
        self.paths: list[str] = []
        self.release = threading.Event()  # what /slow.png waits for
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.paths.append(self.path)
                with contextlib.suppress(OSError):  # the client gave up (the timeout test)
                    outer.answer(self)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.handle_error = lambda request, address: None
        self.port = self.httpd.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def answer(self, h: BaseHTTPRequestHandler):
        path = h.path
        if path in ("/img.png", "/big.png", "/slow.png"):
            if path == "/slow.png":
                self.release.wait(timeout=30)
            body = BIG_PNG if path == "/big.png" else PNG
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            h.wfile.write(body)
        elif path in ("/nolength.png", "/nolength-big.png"):  # read until the server closes
            h.send_response(200)
            h.end_headers()
            h.wfile.write(BIG_PNG if path == "/nolength-big.png" else PNG)
        elif path.startswith("/chain/"):  # /chain/k redirects k times, then the image
            k = int(path.rsplit("/", 1)[1])
            self._redirect(h, f"/chain/{k - 1}" if k > 1 else "/img.png")
        elif path == "/to-localhost":
            self._redirect(h, f"http://localhost:{self.port}/img.png")
        elif path == "/to-file":
            self._redirect(h, "file:///etc/passwd")
        elif path == "/text":
            h.send_response(200)
            h.send_header("Content-Length", "5")
            h.end_headers()
            h.wfile.write(b"hello")
        else:
            h.send_error(404 if path == "/missing.png" else 500)

    @staticmethod
    def _redirect(h: BaseHTTPRequestHandler, location: str):
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def module_server() -> Iterator[_Server]:
    server = _Server()
    yield server
    server.close()


@pytest.fixture
def server(module_server: _Server, monkeypatch) -> _Server:
    """The loopback server with its request log cleared; no proxy from the environment (a
    proxy would be asked for 127.0.0.1)."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    module_server.paths.clear()
    return module_server


ALLOWED = ImageLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=5)


def test_remote_urls_off_by_default(server: _Server):
    """Without allowed domains nothing is fetched: the server sees no request."""
    _refused(f"{server.base}/img.png", ImageLimits(), "remote image URLs are off.*"
             "--allowed-media-domains")
    assert server.paths == []


def test_fetch_from_allowed_host(server: _Server):
    image, data = load_image_url(f"{server.base}/img.png", ALLOWED, param=PARAM)
    assert data == PNG and image.size == (12, 8)
    assert server.paths == ["/img.png"]
    image, data = load_image_url(f"{server.base}/nolength.png", ALLOWED, param=PARAM)
    assert data == PNG


def test_host_not_allowed(server: _Server):
    """Another allowed host ("localhost" is loopback too, but not the name listed)."""
    limits = ImageLimits(allowed_domains=("localhost",))
    _refused(f"{server.base}/img.png", limits, "host '127.0.0.1' is not among the allowed")
    assert server.paths == []


def test_redirects_followed_up_to_the_limit(server: _Server):
    _, data = load_image_url(f"{server.base}/chain/3", ALLOWED, param=PARAM)
    assert data == PNG
    assert server.paths == ["/chain/3", "/chain/2", "/chain/1", "/img.png"]
    server.paths.clear()
    _refused(f"{server.base}/chain/4", ALLOWED, "redirected more than 3 times")
    assert server.paths == ["/chain/4", "/chain/3", "/chain/2", "/chain/1"]
    _refused(f"{server.base}/chain/1", ImageLimits(allowed_domains=("127.0.0.1",),
                                                   max_redirects=0),
             "redirected more than 0 times")


def test_redirect_to_host_not_allowed(server: _Server):
    """Each redirect's host is checked: localhost is not 127.0.0.1's name on the list."""
    _refused(f"{server.base}/to-localhost", ALLOWED,
             "redirected to 'http://localhost:.*', whose host 'localhost' is not among")
    assert server.paths == ["/to-localhost"]


def test_redirect_to_another_scheme(server: _Server):
    _refused(f"{server.base}/to-file", ALLOWED, "HTTP 302|not http")


@pytest.mark.parametrize("path, match", [
    ("/missing.png", "HTTP 404"), ("/error", "HTTP 500"), ("/text", "could not be read")])
def test_bad_answers(server: _Server, path: str, match: str):
    _refused(f"{server.base}{path}", ALLOWED, match)


def test_oversize_body(server: _Server):
    """Refused from Content-Length, and, without one, after reading max_bytes + 1 bytes."""
    limits = ImageLimits(allowed_domains=("127.0.0.1",), max_bytes=len(BIG_PNG) - 1)
    _refused(f"{server.base}/big.png", limits, f"is {len(BIG_PNG)} bytes, more than the")
    _refused(f"{server.base}/nolength-big.png", limits, f"over {len(BIG_PNG) - 1} bytes")
    load_image_url(f"{server.base}/nolength.png", limits, param=PARAM)  # smaller: fine


def test_fetch_pixel_limit(server: _Server):
    limits = ImageLimits(allowed_domains=("127.0.0.1",), max_pixels=64 * 64 - 1)
    _refused(f"{server.base}/big.png", limits, "64x64 = 4096 pixels")


def test_timeout(server: _Server):
    """A server that does not answer within fetch_timeout_s: refused (it is released only
    after the fetch has given up)."""
    limits = ImageLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=0.5)
    try:
        _refused(f"{server.base}/slow.png", limits, "timed out after 0.5 s")
    finally:
        server.release.set()
    assert server.paths == ["/slow.png"]


def test_connection_refused(server: _Server):
    """Nothing listening (a port that was just free): a clean error."""
    probe = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = probe.server_address[1]
    probe.server_close()
    _refused(f"http://127.0.0.1:{port}/img.png", ALLOWED, "failed")
