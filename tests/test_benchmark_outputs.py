"""Reproducing a figure never changes a tracked file: the benchmark scripts write the published figures
(figures/, docs/) only with --publish, else the same paths under ./veloxquant_bench/; and the command a page
gives beside a figure is the command that figure recorded."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "benchmark_scripts"


def _import_script(name):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    return __import__(name)


def test_output_routes_published_paths_to_the_scratch_folder(tmp_path, monkeypatch):
    common = _import_script("_common")
    monkeypatch.setenv(common.SCRATCH_ENV, str(tmp_path / "scratch"))
    fig = str(ROOT / "figures" / "memory" / "x.json")
    assert common.output(fig, publish=False) == str(tmp_path / "scratch" / "figures" / "memory" / "x.json")
    assert common.output(Path(fig), publish=True) == Path(fig)
    assert common.output(ROOT / "docs" / "x.md", publish=False) == tmp_path / "scratch" / "docs" / "x.md"
    elsewhere = tmp_path / "mine.json"
    assert common.output(elsewhere, publish=False) == elsewhere and common.output(None, False) is None


def _functions_with_output_flags(path: Path):
    """(function name, has add_publish) for each function that declares an --out... or --figure option."""
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        flags, publish = set(), False
        for call in ast.walk(node):
            if not isinstance(call, ast.Call):
                continue
            name = getattr(call.func, "attr", getattr(call.func, "id", ""))
            if name == "add_argument" and call.args and isinstance(call.args[0], ast.Constant):
                flags.add(call.args[0].value)
            publish |= name == "add_publish"
        if any(str(f).startswith(("--out", "--figure", "--docs")) for f in flags):
            yield node.name, publish


def test_every_script_with_an_output_path_takes_publish():
    missing = [f"{p.name}:{fn}" for p in sorted(SCRIPTS.glob("*.py")) if p.stem != "_common"
               for fn, ok in _functions_with_output_flags(p) if not ok]
    assert missing == [], "these parsers name an output without --publish: " + ", ".join(missing)


# Runs a script from a copy of benchmark_scripts/ (so its published figures/ is the copy's, never this
# checkout's) with its model and measurement stubbed; the package and the lab come from this checkout.
DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import veloxquant_mlx.models as models
import veloxquant_mlx.evaluation.passkey as passkey
models.load_model = lambda *a, **k: (None, None)
passkey.make_passkey_prompt = lambda tok, n, depth, key: ([0] * n, None)
if sys.argv[2] == "choosing":
    import bench_quality as Q
    Q.preload_blas = lambda *a, **k: None
    Q.choosing_kv_bytes = lambda *a, **k: {"kv_peak_bytes": 1 << 20, "kv_after_bytes": 1 << 19}
    sys.exit(Q.choosing_main(sys.argv[3:]))
import bench_memory as B
B.preload_blas = lambda *a, **k: None
B.weights_bytes = lambda model: 0
B.peak_prompt = lambda tok, n: [0] * n
B.peak_measure = lambda model, prompt, label, budget, step, new: {
    "label": label, "prompt_tokens": len(prompt), "prefill_step_size": step, "new_tokens": new,
    "kv_allocated_max_bytes": 1, "peak_over_weights_bytes": 1, "wall_s": 0.0}
sys.exit(B.peak_main(sys.argv[3:]))
"""


def _run_copy(tmp_path, which, args):
    repo = tmp_path / "repo"
    if not repo.exists():
        shutil.copytree(SCRIPTS, repo / "benchmark_scripts", ignore=shutil.ignore_patterns("__pycache__"))
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("VELOXQUANT_BENCH_OUT", None)
    r = subprocess.run([sys.executable, "-c", DRIVER, str(repo / "benchmark_scripts"), which, *args], cwd=work,
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return repo, work, r


def _files(folder: Path) -> list:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) if folder.exists() else []


def test_choosing_writes_the_published_figure_only_with_publish(tmp_path):
    cells = {str(i): {"method": m, "regime": "prefill", "context": 64, "density": 0.2, "haystack": "grass",
                      "depth": 0.5, "key": str(i), "correct": True, "prefill_step": 2048}
             for i, m in enumerate(["full", "rotating"])}
    source = tmp_path / "passkey.json"
    source.write_text(json.dumps({"cells": cells}))
    args = [str(source), "--context", "64", "--labels", "full", "rotating"]
    repo, work, r = _run_copy(tmp_path, "choosing", args)
    assert _files(repo / "figures") == []  # the copy's published figures are untouched
    assert _files(work / "veloxquant_bench") == ["figures/choosing/accuracy_vs_peak_bundled.png",
                                                 "figures/choosing/summary_bundled.json"]
    assert "--publish" in r.stderr
    _run_copy(tmp_path, "choosing", [*args, "--publish"])
    assert _files(repo / "figures") == ["choosing/accuracy_vs_peak_bundled.png", "choosing/summary_bundled.json"]


def test_peak_writes_the_published_figure_only_with_publish(tmp_path):
    args = ["--lengths", "64", "--budget", "16", "--step", "32", "--methods", "rotating"]
    repo, work, _ = _run_copy(tmp_path, "peak", args)
    assert _files(repo / "figures") == []
    assert _files(work / "veloxquant_bench") == ["figures/memory/peak_stream.json"]
    _run_copy(tmp_path, "peak", [*args, "--publish"])
    assert _files(repo / "figures") == ["memory/peak_stream.json"]


def test_every_command_beside_a_figure_is_the_one_it_recorded():
    check_figures = _import_script("check_figures")
    found = check_figures.commands(ROOT)
    assert any(fig == "figures/choosing/summary_bundled.json" for _, fig, _ in found)  # the checker sees the pages
    bad = check_figures.command_mismatches(ROOT)
    assert bad == [], "\n".join(f"{d} gives for {f}: {c}\n  recorded: {r}" for d, f, c, r in bad)


def test_the_command_check_ignores_renames_launchers_and_output_flags():
    check_figures = _import_script("check_figures")
    n = check_figures.normalized
    assert n("python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_memory.py peak --lengths 8 --publish") \
        == n("python benchmark_scripts/bench_peak.py --lengths 8 --out x.json")
    assert n("python -m lab --fast-blas eval speed --out-dir figures/eval") == \
        n("python -m veloxquant_mlx --fast-blas eval speed --no-report --no-progress")
    assert n("python benchmark_scripts/bench_quality.py choosing a.json") != \
        n("python benchmark_scripts/bench_quality.py choosing a.json --labels full")


def test_offload_runs_side_by_side_extend_one_file_without_losing_rows(tmp_path, monkeypatch):
    """Two resumable runs of one subcommand (other contexts) write one results file: each write keeps the
    file's rows it does not hold, so neither run's cells overwrite the other's; a run of another setting is
    refused at its write."""
    bench = _import_script("bench_offload")
    monkeypatch.setattr(bench._common, "stamp", lambda res, labels, regime: res)
    KEY = ("context", "prompt", "method")
    path = tmp_path / "identity.json"
    a = {"setting": {"model": "m"}, "cells": [{"context": 2048, "prompt": 0, "method": "snapkv"}]}
    b = {"setting": {"model": "m"}, "cells": [{"context": 4096, "prompt": 0, "method": "snapkv"}]}
    bench._stamp_and_write(path, a, [], "offload", KEY)
    bench._stamp_and_write(path, b, [], "offload", KEY)
    a["cells"].append({"context": 2048, "prompt": 1, "method": "snapkv"})
    bench._stamp_and_write(path, a, [], "offload", KEY)
    held = sorted((c["context"], c["prompt"]) for c in json.loads(path.read_text())["cells"])
    assert held == [(2048, 0), (2048, 1), (4096, 0)]
    other = {"setting": {"model": "another"}, "cells": [{"context": 1, "prompt": 0, "method": "snapkv"}]}
    with pytest.raises(SystemExit, match="now holds 3 cells of another setting"):
        bench._stamp_and_write(path, other, [], "offload", KEY)
    assert len(json.loads(path.read_text())["cells"]) == 3


def test_an_offload_run_of_another_setting_is_refused_not_written_over(tmp_path):
    bench = _import_script("bench_offload")
    path = tmp_path / "followup.json"
    assert bench._resume(path, {"density": 0.2}, "prompts") == {"setting": {"density": 0.2}, "prompts": []}
    path.write_text(json.dumps({"setting": {"density": 0.2}, "prompts": [{"index": 0}]}))
    assert bench._resume(path, {"density": 0.2}, "prompts")["prompts"] == [{"index": 0}]
    with pytest.raises(SystemExit, match="1 prompts of another setting.*another --out"):
        bench._resume(path, {"density": 0.4}, "prompts")
    assert json.loads(path.read_text())["prompts"] == [{"index": 0}]
