"""benchmark_scripts/ holds real benchmarks only: one shared helper, no import-path patching."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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
    """The lab is imported as the installed distribution it is (lab/pyproject.toml), never by a path."""
    offenders = [p.name for p in _scripts() if "sys.path" in p.read_text()]
    assert offenders == []


def test_the_lab_is_its_own_distribution_and_not_in_the_wheel():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    root = FOLDER.parent
    lab = tomllib.loads((root / "lab" / "pyproject.toml").read_text())
    assert lab["tool"]["setuptools"]["package-dir"] == {"lab": "."}
    assert tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"] \
        == ["veloxquant_mlx*"]
    for text in ((root / ".ci" / "run").read_text(), (root / "README.md").read_text()):
        assert "-e ./lab" in text  # the set-up that runs the tests installs it


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


def test_a_script_without_the_lab_says_how_to_install_it_in_one_line():
    import subprocess
    import sys

    code = ("import sys; sys.modules['lab'] = None; "  # the lab not installed (find_spec then finds nothing)
            f"sys.path.insert(0, {str(FOLDER)!r}); import _common")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=FOLDER.parent)
    assert run.returncode == 1, run.stderr
    said = run.stderr.strip().splitlines()[-1]
    assert said == f"the benchmark scripts import the lab: pip install -e {FOLDER.parent / 'lab'}"
