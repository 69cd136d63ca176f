"""The long fuzz profile: thousands of spec-generated and hostile requests against a server.

Requests come from devtools/fuzz_requests.py: Schemathesis strategies built from OpenAI's
published spec (every OpenAI route served) and from the Anthropic SDK's request types
(/v1/messages), positive and negative cases, plus every hand-written hostile case (lone
surrogates and invalid UTF-8 wherever text goes, huge numbers, NaN, deep nesting, wrong types
in every field, image parts that are not images, bodies over the limit). Each answer must be a
2xx or a 4xx in its route's error shape; prints a table of counts per route and status class
(2xx / 4xx / 5xx / timeout) and every request that broke the rule, then checks /health.

    .venv/bin/python bench/fuzz.py --cases 3000 --seed 1          # its own tiny-model server
    .venv/bin/python bench/fuzz.py --model default --cases 3000   # its own default-model one
    .venv/bin/python bench/fuzz.py --url http://127.0.0.1:8000 --model NAME --cases 5000

`--cases` counts the generated requests, spread evenly over the routes; the hand-written
ones (a few hundred) come on top. Exit status 1 when any answer broke the rule.
Only the server's address is contacted.
"""

from __future__ import annotations

import argparse
import collections
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools.fuzz_requests import (  # noqa: E402
    Outcome,
    Request,
    check,
    hostile_cases,
    send,
    spec_strategies,
)

SPEC = ROOT.parent / "shared" / "openai-openapi.yaml"
KINDS = ("2xx", "4xx", "5xx", "timeout")


def start_server(model: str | None, body_limit: int):
    """A server in this process on a loopback port: `model` (a name or path), or a tiny random
    Llama built in a temporary folder; returns (server, served model name)."""
    from serving.http.server import ServerThread
    from serving.http.settings import ServerSettings
    if model is None:
        from devtools.hf_models import build_tiny_checkpoint
        model = str(build_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="fuzz-tiny-"))))
        name, extra = "tiny", {"engine_options": {"max_prefill_len": 64}}
    else:
        name, extra = model, {}
    settings = ServerSettings(model=model, served_model_name=name, port=0, max_slots=8,
                              max_len=256 if name == "tiny" else 2048,
                              max_body_bytes=body_limit, request_timeout=120.0,
                              grace_period=5.0, **extra)
    srv = ServerThread(settings).start()
    if not srv.wait_ready(timeout=900):
        raise SystemExit("the server did not become ready")
    return srv, name


def generated(strategies: dict, cases: int, seed: int) -> list[Request]:
    """`cases` requests drawn from the routes' strategies (as evenly as the count allows),
    reproducible from `seed`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as with_seed

    out: list[Request] = []
    per_route = max(1, cases // len(strategies))
    for i, (_label, strategy) in enumerate(sorted(strategies.items())):
        @with_seed(seed * 1000 + i)
        @settings(max_examples=per_route, database=None, deadline=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(strategy)
        def draw(req: Request) -> None:
            out.append(req)
        draw()
    return out


def report(results: list[tuple[Request, Outcome, str | None]], seconds: float) -> int:
    """Prints the table and the failures; returns how many broke the rule."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for req, out, _ in results:
        counts[req.route][out.kind] += 1
    width = max(len(r) for r in counts) + 2
    print(f"{'route':<{width}}" + "".join(f"{k:>9}" for k in KINDS) + f"{'total':>9}")
    total: collections.Counter = collections.Counter()
    for route in sorted(counts):
        c = counts[route]
        total.update(c)
        print(f"{route:<{width}}" + "".join(f"{c[k]:>9}" for k in KINDS)
              + f"{sum(c.values()):>9}")
    print(f"{'all':<{width}}" + "".join(f"{total[k]:>9}" for k in KINDS)
          + f"{sum(total.values()):>9}")
    bad = [(req, why) for req, _, why in results if why is not None]
    print(f"\n{len(results)} requests in {seconds:.0f} s; {len(bad)} broke the rule")
    for req, why in bad[:50]:
        print(f"- {why}\n  {req.shown()}")
    return len(bad)


def main() -> int:
    """Parses the flags, runs the profile, prints the table; exit status 1 on a failure."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=2000, help="generated requests (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="a running server (default: start one in this process)")
    p.add_argument("--model", help="the served model's name with --url; else the model to "
                   "serve (default: a tiny random Llama)")
    p.add_argument("--body-limit", type=int, default=256 * 1024,
                   help="the server's --max-body-bytes (bodies over it are sent)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--spec", type=Path, default=SPEC, help="OpenAI's OpenAPI spec")
    args = p.parse_args()

    srv = None
    if args.url is None:
        srv, model = start_server(args.model, args.body_limit)
        url = srv.url
    else:
        url, model = args.url.rstrip("/"), args.model or "default"
    try:
        requests = hostile_cases(model, args.body_limit)
        requests += generated(spec_strategies(args.spec, model), args.cases, args.seed)
        print(f"{len(requests)} requests to {url} (model {model!r})", flush=True)
        start = time.monotonic()
        results = []
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill reports too
        try:
            for i, req in enumerate(requests):
                out = send(url, req, timeout=args.timeout)
                results.append((req, out, check(req, out)))
                if results[-1][2] is not None:  # at once, in case the run is stopped
                    print(f"  broke the rule: {results[-1][2][:300]}\n    {req.shown(300)}",
                          flush=True)
                if (i + 1) % 500 == 0:
                    print(f"  {i + 1} sent", flush=True)
        except KeyboardInterrupt:
            print(f"stopped after {len(results)} of {len(requests)} requests")
        failures = report(results, time.monotonic() - start)
        health = send(url, Request("GET", "/health"), timeout=30)
        print(f"/health afterwards: {health.status}")
        return 1 if failures or health.status != 200 else 0
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
