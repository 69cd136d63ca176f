"""The import graph: no circles among the project's modules, and each layer loads only its own
dependencies (the HTTP server no CLI toolkit, the library no web server)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metrale_jax", "serving", "bench")


def module_files() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _top_level_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: the module's body, with the
    bodies of its `if`/`try`/`with` blocks and classes, but not of its functions."""
    for node in body:
        yield node
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _top_level_statements([child])
            elif isinstance(child, ast.ExceptHandler | ast.match_case):
                yield from _top_level_statements(child.body)


def imported_modules(name: str, path: Path, modules: dict[str, Path],
                     module_level_only: bool) -> set[str]:
    """The project modules that `name` imports (each `from a import b` points at `a.b` when
    that is a module, else at `a`)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = (_top_level_statements(tree.body) if module_level_only else ast.walk(tree))
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[:len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                full = f"{base}.{alias.name}"
                targets.add(full if full in modules else base)
    return {t for t in targets if t in modules and t != name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path `[a, b, ..., a]`, or None when it has none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = module_files()
    return {name: imported_modules(name, path, modules, module_level_only)
            for name, path in modules.items()}


def test_no_import_cycle_among_module_level_imports():
    """No circle among metrale_jax, serving and bench, counting module-level imports only
    (those that run when a module is first imported, including inside module-level `if`,
    `try` and class bodies): a circle there breaks or half-initializes an import. Imports
    inside functions are deferred on purpose (heavy or optional dependencies) and are checked
    separately below."""
    assert find_cycle(import_graph(module_level_only=True)) is None


def test_no_import_cycle_even_counting_imports_inside_functions():
    """The stricter view: no circle even when the deferred imports inside functions count
    as edges, so no pair of modules leans on each other at all (what both need lives in a
    module below them)."""
    assert find_cycle(import_graph(module_level_only=False)) is None


# (importing package, packages it must never import, counting imports inside functions too)
FORBIDDEN = [
    ("metrale_jax", ("serving", "bench")),
    ("serving.http", ("serving.cli", "bench")),
    ("serving.progress", ("serving.http", "serving.cli")),
    ("serving.cli", ("bench",)),
]


def test_no_import_points_up():
    """The layers' direction: metrale_jax imports no front end, the HTTP server not the CLI,
    and progress.py (below both front ends) neither of them."""
    graph = import_graph(module_level_only=False)
    wrong = sorted(
        (name, target) for name, targets in graph.items() for target in targets
        for package, banned in FORBIDDEN
        if (name == package or name.startswith(package + "."))
        and any(target == b or target.startswith(b + ".") for b in banned))
    assert not wrong


def test_cycle_finder_finds_a_circle():
    """The finder itself: a -> b -> c -> a is reported, a tree is not."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


_SPY = """
import builtins, json, sys
WATCHED = {"rich", "textual", "matplotlib", "quart", "hypercorn"}
importers = set()
_import = builtins.__import__

def _spy(name, globals=None, locals=None, fromlist=(), level=0):
    top = name.split(".")[0]
    if level == 0 and top in WATCHED:
        importers.add((top, (globals or {}).get("__name__", "?")))
    return _import(name, globals, locals, fromlist, level)

builtins.__import__ = _spy
"""

_REPORT = """
print(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules}),
                  "importers": sorted(importers)}))
"""


def _imports_of(code: str) -> tuple[set[str], set[tuple[str, str]]]:
    """Runs `code` in a fresh interpreter; returns the top-level packages then in
    `sys.modules`, and `(package, importing module)` for each `import` statement that named
    rich, textual, matplotlib, quart or hypercorn."""
    script = f"{_SPY}\n{code}\n{_REPORT}"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return set(report["loaded"]), {tuple(pair) for pair in report["importers"]}


def _walk(package: str) -> str:
    """Code that imports `package` and every module under it."""
    return (f"import importlib, pkgutil, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    importlib.import_module(m.name)")


CLI_TOOLKITS = {"textual", "rich", "matplotlib"}


def test_import_serving_http_loads_no_cli_toolkit():
    """`python -c "import serving.http"` loads neither the CLI's toolkits nor the CLI."""
    loaded, _ = _imports_of("import serving.http\nimport sys\n"
                            "assert 'serving.cli' not in sys.modules, 'CLI loaded'")
    assert not loaded & CLI_TOOLKITS


def test_http_server_never_imports_cli_toolkits():
    """Every module under serving/http imported: textual and matplotlib are not loaded, no
    serving module imports rich, textual or matplotlib (rich itself is loaded by flax, which
    the model layer needs: `flax.linen.summary` imports it), and no module of the CLI is."""
    loaded, importers = _imports_of(
        _walk("serving.http") + "\nimport sys\n"
        "assert not [m for m in sys.modules if m.startswith('serving.cli')], 'CLI loaded'")
    assert "quart" in loaded and "hypercorn" in loaded  # the walk did reach the server
    assert not loaded & {"textual", "matplotlib"}
    ours = {(pkg, who) for pkg, who in importers
            if pkg in CLI_TOOLKITS and who.split(".")[0] in ("serving", "metrale_jax")}
    assert not ours


def test_library_loads_no_web_server():
    """`import metrale_jax`, and then every module of it, loads neither Quart nor Hypercorn
    (nor anything of serving)."""
    loaded, _ = _imports_of("import metrale_jax")
    assert "jax" in loaded
    assert not loaded & {"quart", "hypercorn", "serving"}
    loaded, importers = _imports_of(_walk("metrale_jax"))
    assert not loaded & {"quart", "hypercorn", "serving"}
    assert not {pair for pair in importers if pair[0] in ("quart", "hypercorn")}
