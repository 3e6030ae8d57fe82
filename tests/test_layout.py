"""Methods apart from machinery: the shared code names no method, no method imports another, platform
plumbing stays out of the core, and the density -> budget rule exists once.

The import checks read every import statement (function-level too) through ``test_layers.import_graph``,
so they hold for a method added tomorrow without editing this file or pyproject.toml.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_layers import PACKAGE, ROOT, contract_graph, import_graph, module_files

import veloxquant_mlx.methods  # noqa: F401  (registers every method)
from veloxquant_mlx.registry import get_method, methods

METHODS = f"{PACKAGE}.methods"
# the shared machinery and the mlx-lm glue: they must work for any method, so they name none
SHARED = [f"{PACKAGE}.caches", f"{PACKAGE}.ops", f"{PACKAGE}.builder", f"{PACKAGE}.tap",
          f"{PACKAGE}.prompt_cache", f"{PACKAGE}.model_pass", f"{PACKAGE}.distributed"]
CORE = [f"{PACKAGE}.{m}" for m in ("caches", "methods", "ops", "config", "config_spec", "registry", "options",
                                    "builder", "tap", "prompt_cache", "model_pass", "distributed")]


def _under(mod: str, prefixes) -> bool:
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def _method_of(mod: str) -> str | None:
    """``veloxquant_mlx.methods.nexus.ops`` -> ``nexus``; the methods package itself -> None."""
    parts = mod.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == [PACKAGE, "methods"] else None


def _graph():
    return import_graph(ROOT, PACKAGE)


def test_every_registered_method_lives_under_methods():
    ours = {name: get_method(name).__module__ for name in methods()}
    ours = {n: m for n, m in ours.items() if m.startswith(PACKAGE + ".")}  # tests/examples register their own
    assert len(ours) >= 9
    for name, mod in ours.items():
        assert _method_of(mod) is not None, f"{name} is registered from {mod}, outside {METHODS}"


def test_no_method_imports_another_method():
    bad = [(m, t) for m, edges in contract_graph().items() if _method_of(m)
           for t in edges if _method_of(t) and _method_of(t) != _method_of(m)]
    assert not bad, f"a method imports another method (move what they share to caches/ or ops/): {bad}"


def test_shared_code_imports_no_method():
    """The glue may import ``veloxquant_mlx.methods`` (that registers every method), never one method."""
    bad = [(m, t) for m, edges in _graph().items() if _under(m, SHARED) for t in edges if _method_of(t)]
    assert not bad, f"shared code imports a specific method: {bad}"


def test_core_never_imports_platform_plumbing_or_model_loaders():
    bad = [(m, t) for m, edges in _graph().items() if _under(m, CORE)
           for t in edges if _under(t, [f"{PACKAGE}.platform", f"{PACKAGE}.models"])]
    assert not bad, f"the core imports the BLAS preload or a GGUF loader: {bad}"
    assert not (ROOT / PACKAGE / "_blas.py").exists() and (ROOT / PACKAGE / "platform" / "blas.py").exists()


def _docstrings(tree) -> set:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.add(id(first.value))
    return out


def method_names_in_code(source: str, names) -> list:
    """(line, text) of every identifier or string literal naming one of ``names`` (an identifier names
    it when it contains the name, any case), comments and docstrings left out. ``mx.random``
    (MLX's module) is not the method called random."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    names = {n.lower() for n in names}
    hits = []

    def ident(text, node):
        if any(n in text.lower() for n in names):  # KVzipCache, snapkv_scores, _nexus_weights
            hits.append((node.lineno, text))

    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            ident(node.id, node)
        elif isinstance(node, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id == "mx"):
                ident(node.attr, node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            ident(node.name, node)
        elif isinstance(node, ast.arg):
            ident(node.arg, node)
        elif isinstance(node, ast.alias):
            for part in node.name.split("."):
                ident(part, node)
            if node.asname:
                ident(node.asname, node)
        elif isinstance(node, ast.keyword) and node.arg:
            ident(node.arg, node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            words = {w for w in "".join(c if c.isalnum() else " " for c in node.value.lower()).split()}
            if words & names:
                hits.append((node.lineno, node.value[:60]))
    return hits


def test_shared_code_names_no_method_outside_comments():
    names = [n for n in methods() if get_method(n).__module__.startswith(PACKAGE + ".")]
    files = {m: p for m, p in module_files(ROOT, PACKAGE).items() if _under(m, SHARED)}
    assert f"{PACKAGE}.caches.cache" in files and f"{PACKAGE}.model_pass" in files
    bad = {m: h for m, p in files.items() if (h := method_names_in_code(p.read_text(), names))}
    assert not bad, f"shared code names a registered method (a hook should carry it instead): {bad}"


def test_the_name_check_finds_a_method_name_in_code_but_not_in_comments_or_docstrings():
    src = ('"""Module doc naming nexus."""\n# a comment naming snapkv\n'
           'import mlx.core as mx\n'
           'def f(x):\n    """kvzip in a docstring."""\n    k = mx.random.key(0)\n'
           '    return snapkv_scores(x, "use h2o here") + KVzipCache\n')
    got = method_names_in_code(src, ["nexus", "snapkv", "kvzip", "h2o", "random"])
    assert sorted(got) == [(7, "KVzipCache"), (7, "snapkv_scores"), (7, "use h2o here")]


def density_arithmetic(source: str) -> list:
    """Lines multiplying by a name that holds a density (``density * n``, ``n * self.density``)."""
    def dens(node):
        return (isinstance(node, ast.Name) and "density" in node.id.lower()) or \
               (isinstance(node, ast.Attribute) and "density" in node.attr.lower())

    return sorted(n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mult, ast.FloorDiv)) and
            (dens(n.left) or dens(n.right) or
             any(isinstance(s, ast.Call) and getattr(s.func, "id", "") == "float" and s.args and dens(s.args[0])
                 for s in (n.left, n.right))))


def test_density_to_budget_rule_exists_once():
    files = module_files(ROOT, PACKAGE)
    bad = {m: lines for m, p in files.items() if m != f"{PACKAGE}.config"
           and (lines := density_arithmetic(p.read_text()))}
    assert not bad, f"density -> budget arithmetic outside config.budget_for: {bad}"
    assert density_arithmetic((ROOT / PACKAGE / "config.py").read_text()), "budget_for itself not seen"
    assert density_arithmetic("b = int(round(args.density * n))\nc = n * float(density)\n") == [1, 2]


def test_a_compression_target_is_closed_even_when_the_eviction_fails():
    from veloxquant_mlx.caches.schedule import Schedule

    p = Schedule("end", False, 32, 32, 64)
    try:
        with p.compressing_to(7):
            assert p.compressing and p.target == 7
            raise RuntimeError("selection failed")
    except RuntimeError:
        pass
    assert not p.compressing and p.target is None
