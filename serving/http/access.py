"""Who may call the server, and how much: API keys, tenants, rate limits, CORS.

`Access` holds the accepted keys (serving/http/keys.py: `--api-keys FILE` and/or
`--api-key KEY`; none: the server is open, as before), every key's live limits
(serving/http/limits.py), and the end-of-request hooks. `install(app, state)` adds the hooks:

- before each request: a `RequestContext` on `g.ctx` (serving/http/context.py); then, when
  keys are configured, `Authorization: Bearer KEY` (or Anthropic's `x-api-key: KEY`) is
  checked on every route but /health,
  /metrics (unless `--protect-metrics`) and preflight `OPTIONS` requests (browsers send no
  key): an unknown or disabled key is a 401 (`invalid_api_key`); the admin routes
  (`ADMIN_ROUTES`) need a key with `admin = true` (else 403); the key's concurrency, daily
  quota and requests per minute are checked (429 `rate_limit_exceeded`).
- after each: the key's `x-ratelimit-*` headers (on 429s too).
- at the end of each (teardown; a stream's end instead): `finish(ctx)`; a generation's
  usage is `settle`d before its answer's headers are written.

A generation reserves its most possible tokens through `submit(gen)` and gets its tenant
(`GenerationRequest.tenant`, the prefix cache's isolation key) and the tenant's share of the
slots (`tenant_slots`) from `generation_options(priority)`, which also refuses (403) a
request `priority` below the key's `min_priority` (default 0 for a key, unbounded for an
admin key or an open server). The tenant and the key's name appear in
logs and stats; the key never does. A model or adapter the key may not use is answered as
one that does not exist (`visible_model`, `visible_adapter`): 404 `model_not_found` for
`model`, the unknown-id 400 for llama.cpp's `lora` list, and /v1/models lists only what
the key may use.

SIGHUP (server.py) calls `reload()`: the file is read again; requests in flight keep the key
entry and limiter they started with; a bad file keeps the keys in use and logs one error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from quart import Quart, Response, g, request

from serving.http.context import RequestContext, current
from serving.http.errors import AuthenticationError, PermissionDeniedError
from serving.http.keys import ApiKey, KeyFileError, KeySet, load_keys, single_key
from serving.http.limits import Limiter
from serving.http.settings import ServerSettings

log = logging.getLogger(__name__)


class PriorityNotAllowedError(PermissionDeniedError):
    """A request `priority` more urgent than its key's `min_priority` allows: 403 with
    param "priority" and code "priority_not_allowed"."""

    def __init__(self, message: str):
        super().__init__(message)
        self.param = "priority"
        self.code = "priority_not_allowed"

ADMIN_ROUTES = (("GET", "/v1/metrale/stats"), ("GET", "/v1/metrale/usage"),
                ("POST", "/lora-adapters"), ("POST", "/v1/load_lora_adapter"),
                ("POST", "/v1/unload_lora_adapter"),
                # the model pool's (serving/http/routes/models.py)
                ("GET", "/v1/metrale/models"), ("POST", "/v1/metrale/models/load"),
                ("POST", "/v1/metrale/models/unload"), ("POST", "/v1/metrale/models/sleep"),
                ("POST", "/v1/metrale/models/wake"), ("POST", "/models/load"),
                ("POST", "/models/unload"), ("POST", "/sleep"), ("POST", "/wake_up"),
                ("GET", "/is_sleeping"))
CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")
"""Every method the server's routes answer (a preflight for any other is refused);
tests/serving/http/test_access_http.py checks it against the routes."""
EXPOSED_HEADERS = ("x-request-id", "x-request-seq", "retry-after", "retry-after-ms",
                   *(f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset")
                     for kind in ("requests", "tokens")))


def read_keys(settings: ServerSettings) -> KeySet | None:
    """The keys of `--api-keys` plus `--api-key` (None: neither; the server is open).
    Raises `KeyFileError` for a bad file."""
    keys = load_keys(settings.api_keys_file) if settings.api_keys_file else None
    if settings.api_key:
        one = single_key(settings.api_key)
        if keys is None:
            return one
        merged = {**one.keys, **keys.keys}  # a file entry of the same key wins
        return KeySet(merged, keys.tenants, keys.source)
    return keys


class Access:
    """The server's keys, limiter and end-of-request hooks (one per app)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.keys = read_keys(settings)
        self.limiter = Limiter()
        # Called once per request with its finished `RequestContext` (usage known).
        self.end_hooks: list[Callable[[RequestContext], None]] = []
        self.open_paths = ({"/health"} | (set() if settings.protect_metrics else {"/metrics"})
                           | ({"/"} if settings.webui else set()))
        # The web page's assets (serving/http/routes/webui.py): the page asks for the key.
        self.open_prefixes = ("/webui/",) if settings.webui else ()

    @property
    def enabled(self) -> bool:
        """Whether requests need a key."""
        return self.keys is not None

    # ---- keys ----------------------------------------------------------------------------
    def reload(self) -> bool:
        """Reads the --api-keys file again (SIGHUP). On an error, keeps the keys in use and
        logs one error; returns whether the new keys are in use."""
        if not self.settings.api_keys_file:
            log.info("reload: the server has no --api-keys file")
            return False
        try:
            keys = read_keys(self.settings)
        except KeyFileError as e:
            kept = len(self.keys.keys) if self.keys is not None else 0
            log.error("reload failed, keeping the %d keys in use: %s", kept, e.message)
            return False
        assert keys is not None
        self.keys = keys
        self.limiter.forget_except(set(keys.keys))
        log.info("reloaded %d keys of %d tenants from %s", len(keys.keys),
                 len(keys.tenant_names()), self.settings.api_keys_file)
        return True

    def identify(self, authorization: str) -> ApiKey:
        """The enabled key of an `Authorization` header, else `AuthenticationError`."""
        scheme, _, presented = authorization.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise AuthenticationError("no API key: send 'Authorization: Bearer <key>'")
        assert self.keys is not None
        key = self.keys.find(presented)
        if key is None or not key.enabled:
            raise AuthenticationError("invalid API key")
        return key

    # ---- the request's life ------------------------------------------------------------
    def begin(self, ctx: RequestContext, method: str, path: str, authorization: str) -> None:
        """Checks a request's key, rights and limits (raises 401, 403 or 429)."""
        if (self.keys is None or method == "OPTIONS" or path in self.open_paths
                or path.startswith(self.open_prefixes)):
            return
        key = self.identify(authorization)
        ctx.key = key
        if ("GET" if method == "HEAD" else method, path) in ADMIN_ROUTES and not key.admin:
            raise PermissionDeniedError(f"{method} {path} needs an admin key")
        ctx.limiter = self.limiter.of(key)
        ctx.limiter.arrive(key.name, self.limiter.clock())
        ctx.counted = True

    def headers(self, ctx: RequestContext) -> dict[str, str]:
        """The x-ratelimit-* headers of a keyed request ({} otherwise)."""
        if ctx.limiter is None:
            return {}
        return ctx.limiter.headers(self.limiter.clock())

    def generation_options(self, priority: int = 0) -> dict[str, Any]:
        """The current request's tenant, its share of the slots and its `priority`, for
        `Generation`. A priority more urgent (lower) than the key's `lowest_priority` is a
        403 (`PriorityNotAllowedError`), never clamped: the client learns its limit."""
        ctx = current()
        if ctx is None or ctx.key is None or self.keys is None:
            return {"priority": priority}
        lowest = ctx.key.lowest_priority
        if lowest is not None and priority < lowest:
            raise PriorityNotAllowedError(
                f"this API key may not send a priority below {lowest} (got {priority}; "
                "lower values are more urgent)")
        return {"tenant": ctx.tenant, "priority": priority,
                "tenant_slots": self.keys.policy(ctx.key.tenant).max_concurrent}

    def submit(self, gen: Any) -> None:
        """Reserves the generation's most possible tokens against the caller's limits (429
        when they cannot hold them), then submits it to the scheduler."""
        ctx = current()
        limiter = ctx.limiter if ctx is not None else None
        if limiter is not None:
            ctx.reservation = limiter.reserve(ctx.key.name, gen.token_budget,
                                              self.limiter.clock())
        try:
            gen.submit()
        except BaseException:
            if limiter is not None and ctx.reservation is not None:
                limiter.settle(ctx.reservation, 0, self.limiter.clock())
                ctx.reservation = None
            raise
        if ctx is not None:
            ctx.generation = gen

    def settle(self, ctx: RequestContext) -> None:
        """The request's usage is known: charges it to the key's limits (its token
        reservation settled to the actual use, its place in the key's concurrency freed);
        once per request (later calls do nothing)."""
        if ctx.settled:
            return
        ctx.settled = True
        gen = ctx.generation
        ctx.usage = gen.usage() if gen is not None else {}
        limiter = ctx.limiter
        if limiter is not None:
            if ctx.reservation is not None:
                limiter.settle(ctx.reservation, int(ctx.usage.get("total_tokens", 0)),
                               self.limiter.clock())
            if ctx.counted:
                limiter.leave()

    def finish(self, ctx: RequestContext) -> None:
        """The request has ended: settles it (if not yet) and runs the end hooks; once per
        request (later calls do nothing)."""
        if ctx.finished:
            return
        self.settle(ctx)
        ctx.finished = True
        for callback in ctx.end_callbacks:
            try:
                callback()
            except Exception:
                log.exception("end-of-request callback failed (request %s)", ctx.label())
        for hook in [*self.end_hooks]:
            try:
                hook(ctx)
            except Exception:
                log.exception("end-of-request hook %r failed (request %s)", hook, ctx.label())
        # What the request used goes with it: a finished context may outlive its request
        # (held by the task that ran it), and must not keep an unloaded model's runtime.
        ctx.generation, ctx.outcome = None, None
        ctx.end_callbacks.clear()

    # ---- what a key may use ---------------------------------------------------------------
    def visible_model(self, name: str, is_adapter: bool) -> bool:
        """Whether the current request's key may use model `name` (always, without keys)."""
        ctx = current()
        key = ctx.key if ctx is not None else None
        if key is None:
            return True
        return key.may_use_model(name) and (not is_adapter or key.may_use_adapter(name))

    def visible_adapter(self, name: str) -> bool:
        """Whether the current request's key may be served with LoRA adapter `name`."""
        ctx = current()
        key = ctx.key if ctx is not None else None
        return key is None or key.may_use_adapter(name)

    def tenants(self) -> dict[str, dict[str, Any]] | None:
        """The tenants' keys and shares for the stats (None without keys); no key appears."""
        if self.keys is None:
            return None
        out: dict[str, dict[str, Any]] = {}
        for name in self.keys.tenant_names():
            entries = [k for k in self.keys.keys.values() if k.tenant == name]
            out[name] = {"keys": len(entries), "enabled_keys": sum(k.enabled for k in entries),
                         "max_concurrent": self.keys.policy(name).max_concurrent}
        return out


def install(app: Quart, access: Access) -> None:
    """Adds the access hooks and, with --allowed-origins, CORS (quart-cors) to `app`; runs
    after the app's own first `before_request` hook (the request id, body size)."""

    @app.before_request
    async def _check_access() -> None:
        ctx = g.ctx
        authorization = request.headers.get("authorization", "")
        if not authorization and request.headers.get("x-api-key"):  # Anthropic's header
            authorization = "Bearer " + request.headers["x-api-key"]
        access.begin(ctx, request.method, request.path, authorization)

    @app.after_request
    async def _rate_headers(response: Response) -> Response:
        ctx = current()
        if ctx is not None:
            response.headers.update(access.headers(ctx))
        return response

    @app.teardown_request
    async def _end(_exc: BaseException | None) -> None:
        ctx = current()
        if ctx is not None and not ctx.deferred:
            access.finish(ctx)

    origins = access.settings.allowed_origins
    if origins:
        from quart_cors import cors
        cors(app, allow_origin=list(origins), allow_methods=list(CORS_METHODS),
             allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS), max_age=600,
             allow_credentials=False)
