"""Soak: mixed traffic for a long time against `metrale serve`, sampling the server's health.

Starts `metrale serve --model default` from this checkout (two random rank-8 LoRA adapters,
`--lora a=... b=...`; request dumps on) and, unless `--no-vision`, a second server on a tiny
random LLaVA (devtools/llava_models.py: one model a server; images go there). `--clients`
threads then send, for `--duration` seconds, requests drawn from this mix:

- every API front: chat (streamed and not), completions (streamed and not), Responses,
  Anthropic Messages (streamed and not);
- prefix churn: every prompt starts with a long shared system text that changes every
  `--churn` seconds (the current one mostly, the previous one sometimes), so cached pages are
  shared, go idle and are evicted over the run;
- LoRA mixes: `model: a` / `model: b`, and llama.cpp's `lora` list mixing both at scales;
- grammars: `response_format` json_schema; beams: `use_beam_search` with n=2;
- images: a chat with one of four small PNGs on the vision server;
- disconnects: a stream closed by the client after a few chunks;
- timeouts: `timeout: 1` on a long generation (answered 408, or a timeout event in a stream).

Every `--sample` seconds it records the servers' RSS (/proc), KV pages held by sequences, idle
cached pages, compile count and queue (GET /v1/metrale/stats), and the mean time per output
token over the interval (/metrics `time_per_output_token_seconds`). Device memory is not
sampled: the server reports no live device memory (only its memory plan), and JAX reports
none on CPU. After the traffic stops it
waits for the slots to empty and reads the pages once more. Reported: answers by kind and
status, the 5xx count, pages leaked (pages still held by sequences once idle; idle cached
pages are allowed), compiles during the last 2/3 of the run, least-squares slopes per minute
over the last 2/3 and the RSS growth there (the fitted line's rise over its start). Prints
one markdown table; `--json PATH` writes the samples and the summary.

    .venv/bin/python bench/soak.py --duration 1800             # 30 minutes
    .venv/bin/python bench/soak.py --duration 120 --no-vision --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import base64
import collections
import http.client
import io
import itertools
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from bench.gemma3 import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]

MODEL = "default"
VISION = "llava-tiny"
# SmolLM2-135M (the default model): 30 layers, width 576, 3 KV heads of 64.
DEFAULT_LAYERS, DEFAULT_WIDTH, DEFAULT_KV = 30, 576, 192
KINDS = {  # kind: weight in the mix
    "chat_stream": 3, "chat": 2, "completions": 2, "completions_stream": 2, "responses": 2,
    "messages": 2, "messages_stream": 1, "lora_model": 2, "lora_mix": 1, "grammar": 1,
    "beams": 1, "image": 2, "disconnect": 2, "timeout": 1}
WORDS = ("river", "stone", "market", "winter", "garden", "engine", "letter", "harbor", "forest",
         "lamp", "window", "bridge", "signal", "orchard", "copper", "ladder", "meadow", "canal",
         "thunder", "candle", "mirror", "saddle", "island", "valley", "pocket", "ribbon")
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


# -- set-up ------------------------------------------------------------------------------------

def write_adapter(folder: Path, seed: int, rank: int = 8) -> Path:
    """A random PEFT LoRA adapter on q_proj and v_proj of every layer of the default model."""
    import numpy as np
    from safetensors.numpy import save_file
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(DEFAULT_LAYERS):
        for module, out in (("q_proj", DEFAULT_WIDTH), ("v_proj", DEFAULT_KV)):
            key = f"base_model.model.model.layers.{i}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = (0.02 * rng.standard_normal(
                (rank, DEFAULT_WIDTH))).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (0.02 * rng.standard_normal(
                (out, rank))).astype(np.float32)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
         "target_modules": ["q_proj", "v_proj"], "bias": "none"}))
    return folder


def png(seed: int) -> str:
    """A 32x32 PNG of random pixels as a data: URL."""
    import numpy as np
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (32, 32, 3), np.uint8)).save(
        buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    """One `metrale serve` subprocess on a loopback port (its log in `log`)."""

    def __init__(self, name: str, args: list[str], log: Path):
        self.name, self.port, self.log = name, free_port(), log
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        env.setdefault("METRALE_CHECKPOINTS", str(ROOT / "checkpoints"))
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "serving.cli", "serve", "--host", "127.0.0.1", "--port",
             str(self.port), "--no-webui", *args], cwd=ROOT, env=env, stdout=self._log,
            stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout: float) -> None:
        """Waits until /health answers 200."""
        wait_healthy(self.url, self.proc, timeout)

    def rss_mb(self) -> float:
        """The process's resident set (MB; nan once it has gone)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return float("nan")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 60 s."""
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


# -- traffic -----------------------------------------------------------------------------------

class Tally:
    """Answers by (kind, outcome), thread-safe; outcome: the HTTP status, or a stream's
    `timeout`/`error:<type>` event, `disconnected`, or `exception:<class>`."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.examples: dict[str, str] = {}

    def add(self, kind: str, outcome: str, detail: str = "") -> None:
        """Counts one answer; keeps the first detail of each unexpected outcome."""
        with self.lock:
            self.counts[kind, outcome] += 1
            if detail and outcome not in ("200", "408", "timeout", "disconnected"):
                self.examples.setdefault(f"{kind} {outcome}", detail[:300])


def call(url: str, path: str, body: dict, stream: bool, close_after: int | None = None
         ) -> tuple[str, str]:
    """POSTs `body`; returns (outcome, detail). A stream is read to its end (or closed by us
    after `close_after` data events): its outcome is 200 unless it carried an error event."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200 or not stream:
            raw = resp.read()
            return str(resp.status), raw[:300].decode(errors="replace")
        events = 0
        for rawline in resp:
            line = rawline.strip()
            if not line.startswith(b"data:"):
                continue
            events += 1
            if close_after is not None and events >= close_after:
                return "disconnected", ""
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue
            event = json.loads(payload)
            error = event.get("error") if isinstance(event, dict) else None
            if event.get("type") == "error" or error:
                err = error if isinstance(error, dict) else event
                kind = str(err.get("code") or err.get("type") or "error")
                return ("timeout" if "timeout" in kind else f"error:{kind}"), str(err)[:300]
        return "200", ""
    except Exception as e:  # a broken connection is an outcome to count
        return f"exception:{type(e).__name__}", str(e)[:300]
    finally:
        conn.close()


class Traffic:
    """The request mix: `body(kind, rng, t)` builds one request of `kind` at run time `t`."""

    def __init__(self, args: argparse.Namespace, images: list[str]):
        self.args, self.images = args, images
        self._prefixes: dict[int, str] = {}

    def prefix(self, rng: random.Random, t: float) -> str:
        """The shared system text: this churn period's (80%) or the previous one's."""
        epoch = max(0, int(t // self.args.churn) - (rng.random() < 0.2))
        if epoch not in self._prefixes:
            words = random.Random(epoch)
            self._prefixes[epoch] = (f"Briefing {epoch}. " + " ".join(
                words.choice(WORDS) for _ in range(180)) + ". Answer briefly.")
        return self._prefixes[epoch]

    def request(self, kind: str, rng: random.Random, t: float, main: str, vision: str | None
                ) -> tuple[str, str, dict, bool, int | None]:
        """(url, path, body, stream, close_after) of one request of `kind`."""
        system = self.prefix(rng, t)
        question = f"Tell me about the {rng.choice(WORDS)} and the {rng.choice(WORDS)}."
        chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        common = {"model": MODEL, "max_tokens": rng.choice((8, 16, 32)), "temperature": 0.8,
                  "seed": rng.randrange(1 << 30)}
        if kind in ("chat", "chat_stream"):
            body = {**common, "messages": chat, "stream": kind == "chat_stream"}
            if kind == "chat" and rng.random() < 0.3:
                body["n"] = 2
            return main, "/v1/chat/completions", body, body["stream"], None
        if kind in ("completions", "completions_stream"):
            body = {**common, "prompt": system + "\n" + question,
                    "stream": kind == "completions_stream"}
            return main, "/v1/completions", body, body["stream"], None
        if kind == "responses":
            stream = rng.random() < 0.5
            body = {"model": MODEL, "instructions": system, "input": question,
                    "max_output_tokens": common["max_tokens"], "stream": stream,
                    "store": False}
            return main, "/v1/responses", body, stream, None
        if kind in ("messages", "messages_stream"):
            body = {"model": MODEL, "system": system, "max_tokens": common["max_tokens"],
                    "messages": [{"role": "user", "content": question}],
                    "stream": kind == "messages_stream"}
            return main, "/v1/messages", body, body["stream"], None
        if kind == "lora_model":
            body = {**common, "model": rng.choice(("a", "b")), "messages": chat,
                    "stream": rng.random() < 0.5}
            return main, "/v1/chat/completions", body, body["stream"], None
        if kind == "lora_mix":
            body = {**common, "prompt": system + "\n" + question, "lora": [
                {"id": 0, "scale": round(rng.random(), 2)},
                {"id": 1, "scale": round(rng.random(), 2)}]}
            return main, "/v1/completions", body, False, None
        if kind == "grammar":
            body = {**common, "messages": chat, "max_tokens": 48, "response_format": {
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
            return main, "/v1/chat/completions", body, False, None
        if kind == "beams":
            body = {**common, "prompt": system + "\n" + question, "use_beam_search": True,
                    "n": 2, "temperature": 0, "max_tokens": 8}
            return main, "/v1/completions", body, False, None
        if kind == "image":
            content = [{"type": "image_url", "image_url": {"url": rng.choice(self.images)}},
                       {"type": "text", "text": question}]
            body = {"model": VISION, "max_tokens": 8, "temperature": 0.8,
                    "messages": [{"role": "user", "content": content}],
                    "stream": rng.random() < 0.5}
            return vision or main, "/v1/chat/completions", body, body["stream"], None
        if kind == "disconnect":
            body = {**common, "messages": chat, "max_tokens": 200, "ignore_eos": True,
                    "stream": True}
            return main, "/v1/chat/completions", body, True, rng.randint(1, 6)
        if kind == "timeout":
            stream = rng.random() < 0.5
            body = {**common, "prompt": system + "\n" + question, "max_tokens": 1500,
                    "ignore_eos": True, "timeout": 1, "stream": stream}
            return main, "/v1/completions", body, stream, None
        raise ValueError(kind)


def client(i: int, traffic: Traffic, tally: Tally, start: float, end: float, main: str,
           vision: str | None) -> None:
    """One client: requests one after the other until `end`."""
    rng = random.Random(1000 + i)
    kinds = [k for k in KINDS if vision is not None or k != "image"]
    weights = [KINDS[k] for k in kinds]
    while time.monotonic() < end:
        kind = rng.choices(kinds, weights)[0]
        url, path, body, stream, close_after = traffic.request(
            kind, rng, time.monotonic() - start, main, vision)
        outcome, detail = call(url, path, body, stream, close_after)
        tally.add(kind, outcome, detail)


# -- sampling ----------------------------------------------------------------------------------

def get(url: str, path: str) -> bytes:
    """GET `url + path`'s body."""
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return r.read()


def metric(text: str, name: str) -> float:
    """The value of an unlabelled Prometheus sample `name` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def sample(servers: dict[str, Server], t0: float) -> dict:
    """One row of figures from every server (keys prefixed by the server's name but for the
    main one)."""
    row: dict = {"t": time.monotonic() - t0}
    for name, srv in servers.items():
        p = "" if name == "main" else name + "_"
        row[p + "rss_mb"] = srv.rss_mb()
        try:
            stats = json.loads(get(srv.url, "/v1/metrale/stats"))
            metrics = get(srv.url, "/metrics").decode()
        except OSError as e:
            row[p + "error"] = str(e)
            continue
        cache = stats.get("prefix_cache") or {}
        row[p + "compiles"] = stats.get("compiles")
        row[p + "waiting"] = stats.get("waiting")
        row[p + "running"] = (stats.get("slots") or {}).get("used")
        row[p + "pages_in_use"] = cache.get("in_use_pages")
        row[p + "idle_pages"] = cache.get("idle_pages")
        row[p + "tpot_sum"] = metric(metrics, "metrale:time_per_output_token_seconds_sum")
        row[p + "tpot_count"] = metric(metrics, "metrale:time_per_output_token_seconds_count")
        row[p + "errors_5xx"] = sum(v for k, v in stats["errors"]["by_status"].items()
                                    if k.startswith("5"))
    return row


def slope_per_min(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares over (seconds, value): (slope per minute, fitted value at the first x)."""
    pts = [(x, y) for x, y in points if y is not None and y == y]
    if len(pts) < 2:
        return float("nan"), float("nan")
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
    return b * 60, my + b * (pts[0][0] - mx)


def step_times(rows: list[dict], p: str = "") -> list[tuple[float, float]]:
    """(t, mean ms per output token over the interval before t) for each pair of samples."""
    out = []
    for a, b in itertools.pairwise(rows):
        dn = (b.get(p + "tpot_count") or 0) - (a.get(p + "tpot_count") or 0)
        if dn > 0:
            out.append((b["t"], 1e3 * ((b[p + "tpot_sum"] or 0) - (a[p + "tpot_sum"] or 0)) / dn))
    return out


def summarize(rows: list[dict], final: dict, duration: float, p: str = "") -> dict:
    """The figures of one server over the run's last 2/3 (`rows` during the traffic)."""
    late = [r for r in rows if r["t"] >= duration / 3]
    out: dict = {}
    for key in ("rss_mb", "compiles", "pages_in_use", "idle_pages", "waiting"):
        pts = [(r["t"], r.get(p + key)) for r in late]
        out[key + "_slope_per_min"], start = slope_per_min(pts)
        if key == "rss_mb" and late:
            end_fit = start + out[key + "_slope_per_min"] * (late[-1]["t"] - late[0]["t"]) / 60
            out["rss_first_mb"] = rows[0].get(p + "rss_mb")
            out["rss_late_start_mb"], out["rss_late_end_mb"] = start, end_fit
            out["rss_growth_late_pct"] = 100 * (end_fit - start) / start if start else None
    st = step_times(late, p)
    out["tpot_ms_slope_per_min"], _ = slope_per_min(st)
    out["tpot_ms_mean"] = sum(v for _, v in st) / len(st) if st else None
    comp = [r.get(p + "compiles") for r in rows if r.get(p + "compiles") is not None]
    comp_late = [r.get(p + "compiles") for r in late if r.get(p + "compiles") is not None]
    out["compiles_at_start"] = comp[0] if comp else None
    out["compiles_late_added"] = comp_late[-1] - comp_late[0] if comp_late else None
    out["compiles_end"] = final.get(p + "compiles")
    out["pages_leaked"] = final.get(p + "pages_in_use")
    out["idle_pages_end"] = final.get(p + "idle_pages")
    out["server_5xx"] = final.get(p + "errors_5xx")
    return out


# -- the run -----------------------------------------------------------------------------------

def settle(servers: dict[str, Server], t0: float, timeout: float = 180.0) -> dict:
    """Waits for every server's slots and queue to empty; returns the sample then."""
    deadline = time.monotonic() + timeout
    while True:
        row = sample(servers, t0)
        busy = any((row.get(p + "running") or 0) + (row.get(p + "waiting") or 0)
                   for p in ("", *(n + "_" for n in servers if n != "main")))
        if not busy or time.monotonic() > deadline:
            return row
        time.sleep(1.0)


def start_servers(args: argparse.Namespace, work: Path) -> dict[str, Server]:
    """The main server (and the vision one), ready."""
    a, b = write_adapter(work / "a", 1), write_adapter(work / "b", 2)
    main = Server("main", ["--model", MODEL, "--max-slots", str(args.max_slots), "--max-len",
                           str(args.max_len), "--lora", f"a={a}", f"b={b}", "--max-loras", "2",
                           "--max-lora-rank", "8", "--dump-requests", str(work / "dumps"),
                           "--warmup", args.warmup], work / "main.log")
    servers = {"main": main}
    if not args.no_vision:
        from devtools.llava_models import build_llava_folder
        build_llava_folder(work / "llava")
        servers["vision"] = Server("vision", [
            "--model", str(work / "llava"), "--served-model-name", VISION, "--max-slots", "4",
            "--max-len", "512", "--warmup", args.warmup], work / "vision.log")
    for srv in servers.values():
        srv.wait(args.start_timeout)
    return servers


def run(args: argparse.Namespace, work: Path) -> dict:
    """Starts the servers, runs the traffic and the sampler, stops them; the report."""
    servers = start_servers(args, work)
    try:
        main = servers["main"].url
        vision = servers["vision"].url if "vision" in servers else None
        traffic = Traffic(args, [png(s) for s in range(4)])
        for kind in KINDS:  # one of each first, unmeasured, so the mix is known to work
            if kind != "image" or vision:
                url, path, body, stream, close = traffic.request(kind, random.Random(0), 0.0,
                                                                 main, vision)
                print(f"warm {kind}: {call(url, path, body, stream, close)[0]}", flush=True)
        tally = Tally()
        t0 = time.monotonic()
        end = t0 + args.duration
        threads = [threading.Thread(target=client, args=(i, traffic, tally, t0, end, main,
                                                          vision), daemon=True)
                   for i in range(args.clients)]
        for t in threads:
            t.start()
        rows = []
        while time.monotonic() < end:
            rows.append(sample(servers, t0))
            if args.verbose:
                print(json.dumps(rows[-1]), flush=True)
            time.sleep(max(0.0, min(args.sample, end - time.monotonic())))
        for t in threads:
            t.join(timeout=600)
        final = settle(servers, t0)
        report = {"args": vars(args), "samples": rows, "final": final,
                  "outcomes": {f"{k} {o}": n for (k, o), n in sorted(tally.counts.items())},
                  "unexpected_examples": tally.examples,
                  "servers": {name: summarize(rows, final, args.duration,
                                              "" if name == "main" else name + "_")
                              for name in servers}}
        total = sum(tally.counts.values())
        fivexx = sum(n for (_, o), n in tally.counts.items() if o.startswith("5"))
        report["totals"] = {
            "requests": total, "client_5xx": fivexx,
            "exceptions": sum(n for (_, o), n in tally.counts.items()
                              if o.startswith("exception")),
            "stream_errors": sum(n for (_, o), n in tally.counts.items()
                                 if o.startswith("error:")),
            "unexpected_4xx": sum(n for (_, o), n in tally.counts.items()
                                  if o.startswith("4") and o != "408")}
        return report
    finally:
        for srv in servers.values():
            srv.stop()


def print_report(report: dict) -> None:
    """The markdown tables."""
    args = report["args"]
    tot = report["totals"]
    print(f"\nsoak: {args['duration']:g} s, {args['clients']} clients, samples every "
          f"{args['sample']:g} s; slopes over the last 2/3\n")
    print("| server | 5xx | pages leaked | idle cached pages | compiles (start / +last 2/3 / "
          "end) | RSS MB (first / late start / late end) | RSS growth late | RSS MB/min | "
          "pages in use /min | idle pages /min | queue /min | ms/token mean | ms/token /min |")
    print("|---" * 13 + "|")
    for name, s in report["servers"].items():
        def f(v, fmt=".2f"):
            return "n/a" if v is None or v != v else format(v, fmt)
        print(f"| {name} | {s['server_5xx']} | {s['pages_leaked']} | {s['idle_pages_end']} | "
              f"{s['compiles_at_start']} / +{s['compiles_late_added']} / {s['compiles_end']} | "
              f"{f(s['rss_first_mb'], '.0f')} / {f(s['rss_late_start_mb'], '.0f')} / "
              f"{f(s['rss_late_end_mb'], '.0f')} | {f(s['rss_growth_late_pct'])}% | "
              f"{f(s['rss_mb_slope_per_min'])} | {f(s['pages_in_use_slope_per_min'])} | "
              f"{f(s['idle_pages_slope_per_min'])} | {f(s['waiting_slope_per_min'])} | "
              f"{f(s['tpot_ms_mean'], '.1f')} | {f(s['tpot_ms_slope_per_min'])} |")
    main = report["servers"]["main"]
    goals = {"0 5xx": tot["client_5xx"] == 0 and all(
                 not v["server_5xx"] for v in report["servers"].values()),
             "0 pages leaked": all(not v["pages_leaked"] for v in report["servers"].values()),
             "compiles flat": all(not v["compiles_late_added"]
                                  for v in report["servers"].values()),
             "RSS growth <= 1% (last 2/3)": (main["rss_growth_late_pct"] or 0.0) <= 1.0}
    print("\ngoals: " + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in goals.items()))
    print(f"\nrequests {tot['requests']}, 5xx seen by clients {tot['client_5xx']}, "
          f"exceptions {tot['exceptions']}, error events in streams {tot['stream_errors']}, "
          f"unexpected 4xx {tot['unexpected_4xx']}\n")
    by_kind: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for key, n in report["outcomes"].items():
        kind, outcome = key.split(" ", 1)
        by_kind[kind][outcome] = n
    print("| kind | outcomes |\n|---|---|")
    for kind, outs in by_kind.items():
        print(f"| {kind} | " + ", ".join(f"{o}: {n}" for o, n in sorted(outs.items())) + " |")
    for key, text in report["unexpected_examples"].items():
        print(f"\n{key}: {text}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic")
    ap.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    ap.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--churn", type=float, default=60.0,
                    help="seconds each shared system prefix lasts (default 60)")
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--warmup", default="full", choices=("serve", "full", "none"))
    ap.add_argument("--no-vision", action="store_true", help="no vision server, no images")
    ap.add_argument("--start-timeout", type=float, default=1800.0)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the report here")
    ap.add_argument("--work", default=None, help="folder for adapters, logs and dumps "
                    "(default: a temporary one, removed afterwards)")
    ap.add_argument("--verbose", action="store_true", help="print every sample")
    args = ap.parse_args()
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        report = run(args, Path(args.work))
    else:
        with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
            report = run(args, Path(tmp))
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
