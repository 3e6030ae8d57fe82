"""The package's shape: one-way layers and no import cycle, function-level (deferred) imports included.

Two independent checks of the contracts in pyproject.toml's [tool.importlinter]: ``lint-imports``
itself, and an AST walk of every module (every ``import`` statement, wherever it sits), so a deferred
upward import or a cycle held together by one fails here even if a tool stopped counting it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "veloxquant_mlx"


def _pyproject() -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _layers() -> list[list[str]]:
    """The layers contract, highest first: each a list of module names."""
    contracts = _pyproject()["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in contracts if c["type"] == "layers"]
    return [[m.strip() for m in layer.replace("|", ":").split(":")] for layer in layers]


def ignored_imports() -> set[tuple[str, str]]:
    """(importer, imported) edges the contracts name as exceptions (their ``ignore_imports``)."""
    contracts = _pyproject()["tool"]["importlinter"]["contracts"]
    return {tuple(x.strip() for x in edge.split("->")) for c in contracts for edge in c.get("ignore_imports", ())}


def contract_graph() -> dict[str, set[str]]:
    """The package's import graph less the contracts' named exceptions (what the contracts check)."""
    ignored = ignored_imports()
    return {m: {t for t in edges if (m, t) not in ignored} for m, edges in import_graph(ROOT, PACKAGE).items()}


def module_files(src: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``src/package``."""
    out = {}
    for path in sorted((src / package).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(src: Path, package: str) -> dict[str, set[str]]:
    """Module -> package modules it imports, from every import statement (function-level too).

    ``from a import b`` counts as importing ``a.b`` when that is a module, else ``a``. The implicit
    import of a parent package (``a`` before ``a.b``) is Python's package mechanics, not an edge."""
    files = module_files(src, package)
    graph = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files and "." in t:  # `import a.b.c` of a name inside a module
                    t = t.rsplit(".", 1)[0]
                if t in files and t != mod:
                    edges.add(t)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def layer_violations(graph: dict[str, set[str]], layers: list[list[str]], root: str) -> list[str]:
    """Imports that point up the layers (or at the root package's public API)."""
    def rank(mod):
        for i, layer in enumerate(layers):
            if any(mod == m or mod.startswith(m + ".") for m in layer):
                return i
        return None

    bad = []
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            if dst == root and src != root:
                bad.append(f"{src} imports the package root (the public API)")
            elif src != root and rank(src) is not None and rank(dst) is not None and rank(dst) < rank(src):
                bad.append(f"{src} -> {dst}")
    return bad


def test_every_module_sits_in_a_layer():
    layers = _layers()
    files = module_files(ROOT, PACKAGE)
    flat = [m for layer in layers for m in layer]
    assert all(m in files for m in flat), sorted(set(flat) - set(files))
    lost = [m for m in files if m != PACKAGE and not any(m == x or m.startswith(x + ".") for x in flat)]
    assert not lost, f"modules outside every layer of pyproject.toml's contract: {lost}"


def test_no_import_cycle_counting_deferred_imports():
    assert cycles(import_graph(ROOT, PACKAGE)) == []


def test_imports_point_down_the_layers_counting_deferred_imports():
    assert layer_violations(contract_graph(), _layers(), PACKAGE) == []


def test_the_contracts_name_no_exception():
    """Every import points down the layers as it is: no ``ignore_imports`` line excuses one (kvzap's fit
    driver, which runs the model through the builder, sits in evaluation/ for that reason)."""
    assert ignored_imports() == set()


def test_the_ast_check_sees_a_deferred_upward_import_and_cycle(tmp_path):
    """The checker itself can fail: a function-level import that closes a cycle and points up."""
    pkg = tmp_path / "pkg"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("")
    (pkg / "high.py").write_text("from .low import core\n")
    (pkg / "low" / "core.py").write_text("def f():\n    from .. import high\n    return high\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.high"] == {"pkg.low.core"} and graph["pkg.low.core"] == {"pkg.high"}
    assert cycles(graph) == [["pkg.high", "pkg.low.core"]]
    assert layer_violations(graph, [["pkg.high"], ["pkg.low"]], "pkg") == ["pkg.low.core -> pkg.high"]


def test_lint_imports_keeps_every_contract():
    exe = shutil.which("lint-imports")
    assert exe, "lint-imports not found: pip install -e '.[test]' (import-linter)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
    # It analyzed this checkout's package (PYTHONPATH), not another install of it.
    assert f"Analyzed {len(module_files(ROOT, PACKAGE))} files" in done.stdout, done.stdout[-2000:]



def test_the_package_never_imports_the_lab_and_the_wheel_ships_only_the_package():
    """lab/ (reports, provenance, the planted benchmark) regenerates this repository's docs: the package
    must run without it, and setuptools must not pick it up."""
    bad = []
    for mod, path in module_files(ROOT, PACKAGE).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            bad += [f"{mod} imports {n}" for n in names if n.split(".")[0] == "lab"]
    assert bad == []
    include = _pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include and all(p.split(".")[0].rstrip("*") == PACKAGE for p in include), include
