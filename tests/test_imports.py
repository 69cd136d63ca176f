"""The import graph: no circles among the project's modules, each package imports only what its
`__init__` declares (`MAY_IMPORT`), no module takes another's private names, and each layer loads
only its own dependencies (the HTTP server no CLI toolkit, the library no web server)."""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("metrale_jax", "serving", "bench", "devtools")
# Every top-level name of this repository that a module could import.
PROJECT = (*PACKAGES, "tests")


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


Imports = tuple[set[str], set[tuple[str, str]]]


def _imports_of(*stages: str) -> list[Imports]:
    """Runs the code of each stage in turn in one fresh interpreter; after each, the
    top-level packages then in `sys.modules`, and `(package, importing module)` for each
    `import` statement so far that named rich, textual, matplotlib, quart or hypercorn.
    (A stage that imports more after a first `import X` sees what a fresh interpreter would
    after the same statements: one interpreter, and one JAX import, for both.)"""
    script = _SPY + "".join(f"\n{code}\n{_REPORT}" for code in stages)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    reports = [json.loads(line) for line in out.stdout.strip().splitlines()[-len(stages):]]
    return [(set(r["loaded"]), {tuple(pair) for pair in r["importers"]}) for r in reports]


def _walk(package: str) -> str:
    """Code that imports `package` and every module under it."""
    return (f"import importlib, pkgutil, {package}\n"
            f"for m in pkgutil.walk_packages({package}.__path__, '{package}.'):\n"
            "    importlib.import_module(m.name)")


CLI_TOOLKITS = {"textual", "rich", "matplotlib"}


@functools.cache
def _serving_http_imports() -> list[Imports]:
    """`import serving.http`, then every module under serving/http (one interpreter)."""
    return _imports_of(
        "import serving.http\nimport sys\n"
        "assert 'serving.cli' not in sys.modules, 'CLI loaded'",
        _walk("serving.http") + "\nimport sys\n"
        "assert not [m for m in sys.modules if m.startswith('serving.cli')], 'CLI loaded'")


def test_import_serving_http_loads_no_cli_toolkit():
    """`python -c "import serving.http"` loads neither the CLI's toolkits nor the CLI."""
    loaded, _ = _serving_http_imports()[0]
    assert not loaded & CLI_TOOLKITS


def test_http_server_never_imports_cli_toolkits():
    """Every module under serving/http imported: textual and matplotlib are not loaded, no
    serving module imports rich, textual or matplotlib (rich itself is loaded by flax, which
    the model layer needs: `flax.linen.summary` imports it), and no module of the CLI is."""
    loaded, importers = _serving_http_imports()[1]
    assert "quart" in loaded and "hypercorn" in loaded  # the walk did reach the server
    assert not loaded & {"textual", "matplotlib"}
    ours = {(pkg, who) for pkg, who in importers
            if pkg in CLI_TOOLKITS and who.split(".")[0] in ("serving", "metrale_jax")}
    assert not ours


def test_library_loads_no_web_server():
    """`import metrale_jax`, and then every module of it, loads neither Quart nor Hypercorn
    (nor anything of serving)."""
    (loaded, _), (walked, importers) = _imports_of("import metrale_jax", _walk("metrale_jax"))
    assert "jax" in loaded
    assert not loaded & {"quart", "hypercorn", "serving"}
    assert not walked & {"quart", "hypercorn", "serving"}
    assert not {pair for pair in importers if pair[0] in ("quart", "hypercorn")}


# --- Package rules: each package's `__init__` declares `MAY_IMPORT`, the project packages its
# modules may import besides their own package's (a name allows the module or package and
# everything under it). A module answers to its nearest package.


def may_import(package_path: Path) -> tuple[str, ...] | None:
    """The `MAY_IMPORT` tuple of a package's `__init__.py`, read with ast (None: not declared)."""
    tree = ast.parse(package_path.read_text(), str(package_path))
    for node in tree.body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and target.id == "MAY_IMPORT":
            value = ast.literal_eval(node.value)
            assert isinstance(value, tuple) and all(isinstance(v, str) for v in value), value
            return value
    return None


def _package_of(name: str, path: Path) -> str:
    """The package a module answers to: itself for a package, else its parent."""
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _resolve(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module name that `from ... import` names (relative ones resolved)."""
    base = node.module or ""
    if node.level:
        anchor = name.split(".")
        anchor = anchor[:len(anchor) - node.level + (1 if path.name == "__init__.py" else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return base


def _under(target: str, allowed: str) -> bool:
    return target == allowed or target.startswith(allowed + ".")


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not attr.startswith("__")


def rule_violations(name: str, path: Path, modules: dict[str, Path],
                    rules: dict[str, tuple[str, ...]]) -> set[str]:
    """What module `name` does against the rules, every import counted (inside functions too):
    "a -> b" for an import of project module b that a's package does not declare, "a takes
    b._x" for a private name of another module (`from b import _x`, or `b._x` on an imported
    project module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = _package_of(name, path)
    allowed = (package, *rules[package])
    found: set[str] = set()
    bound: dict[str, str] = {}  # local name -> the project module it is bound to

    def check(target: str) -> None:
        if target.split(".")[0] in PROJECT and target != name \
                and not any(_under(target, a) for a in allowed):
            found.add(f"{name} -> {target}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                check(alias.name)
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(name, path, node)
            if base.split(".")[0] not in PROJECT:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:
                    check(full)
                    bound[alias.asname or alias.name] = full
                    continue
                check(base)
                if _is_private(alias.name) and base != name:
                    found.add(f"{name} takes {base}.{alias.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and _is_private(node.attr) \
                and bound[node.value.id] != name:
            found.add(f"{name} takes {bound[node.value.id]}.{node.attr}")
    return found


def package_rules() -> dict[str, tuple[str, ...]]:
    """Package -> its `MAY_IMPORT`, for every package of the project's packages."""
    modules = module_files()
    return {name: may_import(path) for name, path in modules.items()
            if path.name == "__init__.py"}


def test_every_package_declares_what_it_may_import():
    """Each package's `__init__.py` has a `MAY_IMPORT` tuple of dotted project names."""
    rules = package_rules()
    assert {"metrale_jax", "serving", "bench", "devtools"} <= set(rules)
    assert not sorted(p for p, rule in rules.items() if rule is None)
    for rule in rules.values():
        assert all(a.split(".")[0] in PACKAGES for a in rule), rule


def test_every_module_imports_only_what_its_package_declares():
    """Every import of every module of metrale_jax, serving, bench and devtools, those inside
    functions included, names its own package or one its package's `MAY_IMPORT` declares
    (bench and the rest never import tests), and no module takes another module's private
    (`_x`) names."""
    modules = module_files()
    rules = package_rules()
    found = set().union(*(rule_violations(n, p, modules, rules) for n, p in modules.items()))
    assert sorted(found) == []


def test_rule_checker_finds_violations(tmp_path):
    """The checker itself: an undeclared import inside a function, a test helper, a private
    name imported and a private attribute of an imported module are each reported."""
    (tmp_path / "a.py").write_text(
        "from metrale_jax.models import layers\n"
        "from metrale_jax.models.layers import _normal, rms_norm\n"
        "def f():\n"
        "    from metrale_jax.engine import Engine\n"
        "    import tests.conftest\n"
        "    return layers._normal, layers.rms_norm\n")
    modules = {"metrale_jax.models.layers": ROOT / "metrale_jax/models/layers.py"}
    found = rule_violations("metrale_jax.models.a", tmp_path / "a.py", modules,
                            {"metrale_jax.models": ("metrale_jax.config",)})
    assert found == {"metrale_jax.models.a -> metrale_jax.engine",
                     "metrale_jax.models.a -> tests.conftest",
                     "metrale_jax.models.a takes metrale_jax.models.layers._normal"}
