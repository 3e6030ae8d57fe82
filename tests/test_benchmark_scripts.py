"""benchmark_scripts/ holds real benchmarks only: one shared helper, no import-path patching."""

from __future__ import annotations

import ast
from pathlib import Path

FOLDER = Path(__file__).resolve().parents[1] / "benchmark_scripts"
HELPER = "_common"


def _scripts():
    return sorted(p for p in FOLDER.glob("*.py"))


def _imported_modules(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_scripts_and_the_helper_is_one_of_them():
    files = [p for p in FOLDER.iterdir() if p.name != "__pycache__"]
    assert (FOLDER / f"{HELPER}.py").is_file()
    assert all(p.suffix == ".py" for p in files), sorted(p.name for p in files if p.suffix != ".py")


def test_no_script_patches_the_import_path():
    """Only the helper touches it, once: it appends the checkout's root so scripts import the lab (lab/)."""
    offenders = [p.name for p in _scripts() if p.stem != HELPER and "sys.path" in p.read_text()]
    assert offenders == []
    helper = [line.strip() for line in (FOLDER / f"{HELPER}.py").read_text().splitlines() if "sys.path" in line]
    assert helper == ["if str(ROOT) not in sys.path:  # the lab (lab/: reports, provenance; not shipped) imports "
                      "from this checkout", "sys.path.append(str(ROOT))"], helper


def test_scripts_import_no_other_script_and_no_test_module():
    siblings = {p.stem for p in _scripts()} - {HELPER}
    for p in _scripts():
        bad = _imported_modules(p) & (siblings | {"conftest", "tests"})
        assert not bad, f"{p.name} imports {sorted(bad)}"


def test_the_helper_needs_only_the_standard_library_at_import():
    """The peer workers (another veloxquant_mlx, or none) import the helper inside their own venvs."""
    import sys

    top = set()
    for node in ast.parse((FOLDER / f"{HELPER}.py").read_text()).body:
        if isinstance(node, ast.Import):
            top |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            top.add(node.module.split(".")[0])
    assert top - {"__future__"} <= set(sys.stdlib_module_names), top


def test_budgets_come_from_the_one_rule():
    """A density becomes a budget through the helper (config.budget_for), never by hand."""
    import re

    pattern = re.compile(r"int\((round\()?[^()]*density[^()]*\*|int\([^()]*\*[^()]*density")
    for p in _scripts():
        hits = [n for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
        assert hits == [], f"{p.name}: lines {hits}"
