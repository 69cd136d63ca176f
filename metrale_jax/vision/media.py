"""Loading the image of a chat content part: a `data:` URL, or an http(s) URL from an allowed
host, decoded under the server's limits.

`load_image_url` blocks (it may download for up to about twice `fetch_timeout_s`, and it
decodes the pixels), so the HTTP server calls it in a worker thread (`asyncio.to_thread`),
never on its event loop. Remote URLs are refused unless the operator lists the hosts to fetch
from (`ImageLimits.allowed_domains`): a server that fetched any URL would let every client
make requests from inside its network. The check is on the URL's host name as written (and on
every redirect's), not on the address it resolves to; the operator's list is trusted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from urllib.parse import urlsplit

from PIL import Image

from metrale_jax.errors import InvalidParameterError
from metrale_jax.vision.image_processor import decode_image

_USER_AGENT = "metrale-jax (image fetch)"
_CHUNK = 1 << 16


@dataclass(frozen=True)
class ImageLimits:
    """What the server accepts of a request's images.

    Attributes:
        max_images: images per request (checked by `check_image_count`).
        max_bytes: bytes of one image file (decoded from base64, or downloaded).
        max_pixels: width * height of one image, checked in the file's header before any
            pixel is decoded.
        fetch_timeout_s: the socket timeout of a download: each connect and read waits at
            most this long, and the whole download stops being read after it.
        max_redirects: redirects followed per download.
        allowed_domains: the hosts http(s) image URLs may name: a host is allowed when it is
            one of them or a subdomain of one (`"example.com"` allows `"img.example.com"`).
            Empty (the default): remote URLs are refused and only `data:` URLs are accepted.
    """

    max_images: int = 8
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 4096 * 4096
    fetch_timeout_s: float = 10.0
    max_redirects: int = 3
    allowed_domains: tuple[str, ...] = ()

    def __post_init__(self):
        for name in ("max_images", "max_bytes", "max_pixels"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.fetch_timeout_s <= 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects}")
        if isinstance(self.allowed_domains, str):
            raise TypeError("allowed_domains is a tuple of host names, not one string")
        domains = tuple(d for d in (_normalize_host(d) for d in self.allowed_domains) if d)
        object.__setattr__(self, "allowed_domains", domains)


def _normalize_host(host: str) -> str:
    """A host name compared case-insensitively, without a trailing dot, IPv6 brackets or a
    leading dot (".example.com" is written for "example.com and its subdomains")."""
    return host.strip().lower().strip("[]").rstrip(".").lstrip(".")


def host_allowed(host: str, allowed_domains: tuple[str, ...]) -> bool:
    """Whether `host` is one of `allowed_domains` or a subdomain of one (case-insensitive; a
    trailing dot ignored). An IP address matches only itself."""
    host = _normalize_host(host)
    if not host:
        return False
    for domain in allowed_domains:
        domain = _normalize_host(domain)
        if domain and (host == domain or host.endswith("." + domain)):
            return True
    return False


def image_digest(data: bytes) -> str:
    """The SHA-256 of an image file's bytes, in hex (64 characters): what identifies an image
    in the prefix cache's keys."""
    return hashlib.sha256(data).hexdigest()


def check_image_count(count: int, limits: ImageLimits, *, param: str = "messages") -> None:
    """Raises InvalidParameterError (naming `param`) when a request carries more than
    `limits.max_images` images."""
    if count > limits.max_images:
        raise InvalidParameterError(
            f"{param}: the request has {count} images, more than the {limits.max_images} "
            "allowed per request", param=param)


def load_image_url(url: str, limits: ImageLimits, *,
                   param: str) -> tuple[Image.Image, bytes]:
    """The image a content part's URL gives, and the file's raw bytes.

    Accepts `data:image/<subtype>;base64,<data>` (any image subtype: the bytes decide the
    format, which must be PNG, JPEG, WebP or GIF) and, when the host is in
    `limits.allowed_domains`, `http://` and `https://` URLs, fetched with the standard library
    (each redirect's target is checked the same way; at most `max_redirects` of them). Blocks:
    the HTTP server calls it in a worker thread.

    Args:
        url: the content part's `image_url.url`.
        limits: the server's limits (bytes, pixels, timeout, redirects, allowed hosts).
        param: where the URL is in the request (e.g. "messages[1].content[2]"); every error
            names it.

    Returns:
        (image, data): the decoded image (see `decode_image`: loaded, in its own mode) and
        the file's bytes (hash them with `image_digest`).

    Raises:
        InvalidParameterError: with `param=param`: another scheme, a data URL that is no
            base64 image, a remote URL while they are off or from a host not allowed, a
            download that fails, times out or answers other than 200, a file over
            `max_bytes`, or an image that cannot be decoded or has over `max_pixels` pixels.
    """
    if not isinstance(url, str):
        raise InvalidParameterError(f"{param}: the image URL must be a string", param=param)
    url = url.strip()
    scheme = url.split(":", 1)[0].strip().lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, limits, param)
    elif scheme in ("http", "https"):
        data = _fetch(url, limits, param)
    else:
        raise InvalidParameterError(
            f"{param}: unsupported image URL {_shorten(url)!r}: send a data URL "
            "(data:image/png;base64,...) or an http(s) URL", param=param)
    try:
        image = decode_image(data, max_pixels=limits.max_pixels)
    except InvalidParameterError as e:
        raise InvalidParameterError(f"{param}: {e.message}", param=param) from e
    return image, data


def _shorten(url: str, limit: int = 80) -> str:
    """A URL for an error message: a data URL's payload is not repeated back."""
    return url if len(url) <= limit else url[:limit] + "..."


def _data_url_bytes(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of `data:image/...;base64,<payload>`."""
    comma = url.find(",")
    if comma < 0:
        raise InvalidParameterError(f"{param}: the data URL has no ',' before its data",
                                    param=param)
    fields = [f.strip().lower() for f in url[len("data:"):comma].split(";")]
    media_type = fields[0]
    if not media_type.startswith("image/"):
        raise InvalidParameterError(
            f"{param}: the data URL's media type is {media_type or 'missing'!r}: only images "
            "(data:image/png;base64,...) are accepted", param=param)
    if "base64" not in fields[1:]:
        raise InvalidParameterError(
            f"{param}: the data URL is not base64: write data:{media_type};base64,<data>",
            param=param)
    payload = url[comma + 1:]
    at_least = len(payload) // 4 * 3 - 2  # the decoded size, known before decoding
    if at_least > limits.max_bytes:
        raise InvalidParameterError(
            f"{param}: the image is at least {at_least} bytes, more than the "
            f"{limits.max_bytes} allowed", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidParameterError(f"{param}: the data URL's data is not valid base64 ({e})",
                                    param=param) from e
    if len(data) > limits.max_bytes:
        raise InvalidParameterError(
            f"{param}: the image is {len(data)} bytes, more than the {limits.max_bytes} "
            "allowed", param=param)
    return data


def _url_host(url: str, param: str) -> str:
    try:
        host = urlsplit(url).hostname
    except ValueError as e:
        raise InvalidParameterError(f"{param}: invalid image URL {_shorten(url)!r} ({e})",
                                    param=param) from e
    if not host:
        raise InvalidParameterError(f"{param}: the image URL {_shorten(url)!r} has no host",
                                    param=param)
    return host


class _GuardedRedirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an http(s) URL on an allowed host, and at most
    `limits.max_redirects` of them per download."""

    def __init__(self, limits: ImageLimits, param: str, url: str):
        super().__init__()
        self.limits, self.param, self.url = limits, param, url
        self.redirects = 0
        self.max_redirections = max(self.max_redirections, limits.max_redirects + 1)

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.redirects += 1
        problem = None
        if self.redirects > self.limits.max_redirects:
            problem = f"redirected more than {self.limits.max_redirects} times"
        else:
            target = urlsplit(newurl)
            if target.scheme.lower() not in ("http", "https"):
                problem = f"redirected to {_shorten(newurl)!r}, which is not http(s)"
            elif not host_allowed(target.hostname or "", self.limits.allowed_domains):
                problem = (f"redirected to {_shorten(newurl)!r}, whose host "
                           f"{target.hostname!r} is not among the allowed media domains")
        if problem is not None:
            fp.close()
            raise InvalidParameterError(f"{self.param}: {_shorten(self.url)} was {problem}",
                                        param=self.param)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, limits: ImageLimits, param: str) -> bytes:
    """Downloads an image from an allowed host: at most `max_bytes`, status 200 only.
    Proxies come from the environment (http_proxy, https_proxy, no_proxy), as urllib's."""
    host = _url_host(url, param)
    if not limits.allowed_domains:
        raise InvalidParameterError(
            f"{param}: remote image URLs are off: send the image as a data URL "
            "(data:image/png;base64,...), or start the server with --allowed-media-domains "
            "<host> ... to fetch images from those hosts", param=param)
    if not host_allowed(host, limits.allowed_domains):
        raise InvalidParameterError(
            f"{param}: the image URL's host {host!r} is not among the allowed media domains "
            f"({', '.join(limits.allowed_domains)})", param=param)
    shown = _shorten(url)
    opener = urllib.request.build_opener(_GuardedRedirects(limits, param, url))
    request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT,
                                                   "Accept": "image/*"})
    deadline = time.monotonic() + limits.fetch_timeout_s
    timed_out = InvalidParameterError(
        f"{param}: fetching {shown} timed out after {limits.fetch_timeout_s:g} s", param=param)
    try:
        with opener.open(request, timeout=limits.fetch_timeout_s) as response:
            if response.status != 200:
                raise InvalidParameterError(
                    f"{param}: fetching {shown} answered HTTP {response.status}, not 200",
                    param=param)
            length = response.headers.get("Content-Length", "").strip()
            if length.isdigit() and int(length) > limits.max_bytes:
                raise InvalidParameterError(
                    f"{param}: the image at {shown} is {int(length)} bytes, more than the "
                    f"{limits.max_bytes} allowed", param=param)
            chunks, total = [], 0
            while total <= limits.max_bytes:
                if time.monotonic() > deadline:
                    raise timed_out
                chunk = response.read1(min(_CHUNK, limits.max_bytes + 1 - total))
                if not chunk:
                    break
                chunks.append(chunk)
                total += len(chunk)
    except InvalidParameterError:
        raise
    except urllib.error.HTTPError as e:
        e.close()
        raise InvalidParameterError(f"{param}: fetching {shown} answered HTTP {e.code} "
                                    f"{e.reason}", param=param) from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise timed_out from e
        raise InvalidParameterError(f"{param}: fetching {shown} failed: {e.reason}",
                                    param=param) from e
    except TimeoutError as e:
        raise timed_out from e
    except (OSError, ValueError, http.client.HTTPException) as e:  # a reset, a bad reply
        raise InvalidParameterError(
            f"{param}: fetching {shown} failed ({type(e).__name__}: {e})", param=param) from e
    if total > limits.max_bytes:
        raise InvalidParameterError(
            f"{param}: the image at {shown} is over {limits.max_bytes} bytes, the most "
            "allowed", param=param)
    return b"".join(chunks)
