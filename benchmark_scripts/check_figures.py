"""Which published figures has the code moved away from, and which docs still quote them?

    python benchmark_scripts/check_figures.py            # report; exit 1 when a doc quotes a stale figure
    python benchmark_scripts/check_figures.py --root DIR # another checkout (figures/, README.md, docs/)
    python benchmark_scripts/check_figures.py stamp FIG.json --commit C --command "python ..." --methods full nexus

Recomputes every method's behaviour fingerprint (lab.provenance: a few seconds
on a tiny random model), reads the ``provenance`` of every JSON under figures/, and calls a figure
stale when it has no provenance, carries a ``stale_reason``, or stores a fingerprint that differs
from the current one for any method it covers. A doc (README.md, docs/**/*.md) quotes a figure when
it names the figure's path. A quote on a line that itself says "stale" tells the reader so and is
listed but allowed; any other quote of a stale figure fails the check.

A doc that gives a command beside the figure it makes (```python ...`` (``figures/x.json``)``) must give the
command the figure recorded (``provenance.command``), up to the scripts renamed since (``RENAMED``), the
OpenBLAS launcher and the flags that only say where a run writes (``PLUMBING``); another command fails the
check too: it would not reproduce the figure.

``stamp`` attaches provenance to a figure written before figures carried it: the fingerprint is
computed on a checkout of the producing commit C (``git archive`` of the package into a temporary
folder, with today's fingerprint code copied in), so a figure made by code that has since changed
gets that code's hash and shows up stale. When the fingerprint cannot be computed there (code older
than the fingerprint's settings), the figure is marked stale with that reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT
from lab.provenance import commit, fingerprint, stale_methods

PROV = ROOT / "lab" / "provenance.py"
STAMP_DOC = "``stamp``" + __doc__.split("``stamp``", 1)[1]


def figures(root: Path) -> dict:
    """{relative path: provenance or None} for every JSON under root/figures."""
    out = {}
    for p in sorted((root / "figures").rglob("*.json")):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError) as e:
            out[p.relative_to(root).as_posix()] = {"stale_reason": f"unreadable: {e}"}
            continue
        out[p.relative_to(root).as_posix()] = data.get("provenance") if isinstance(data, dict) else None
    return out


def docs(root: Path) -> list:
    found = [root / "README.md"] if (root / "README.md").exists() else []
    return found + sorted((root / "docs").rglob("*.md"))


def quotes(root: Path, paths) -> dict:
    """{figure path: [(doc, line number, acknowledged)]} for every doc line naming the figure."""
    out = {p: [] for p in paths}
    for doc in docs(root):
        rel = doc.relative_to(root).as_posix()
        for n, line in enumerate(doc.read_text(errors="replace").splitlines(), 1):
            for p in paths:
                if p in line:
                    out[p].append((rel, n, "stale" in line.lower()))
    return out


# Scripts and entry points renamed since a figure recorded its command: {recorded: today's}.
RENAMED = {
    "benchmark_scripts/bench_peak.py": "benchmark_scripts/bench_memory.py peak",
    "benchmark_scripts/bench_quant.py": "benchmark_scripts/bench_memory.py quant",
    "benchmark_scripts/bench_kvzip_prefill.py": "benchmark_scripts/bench_prefill.py kvzip",
    "benchmark_scripts/quant_passkey_report.py": "benchmark_scripts/bench_quality.py quant-report",
    "benchmark_scripts/eval_quant_passkey.py": "benchmark_scripts/bench_quality.py quant-passkey",
    "-m veloxquant_mlx._blas": "-m veloxquant_mlx.platform.blas",
}
# Flags that say where a run writes and what it prints, not what it measures: {flag: values it takes}.
PLUMBING = {"--publish": 0, "--no-report": 0, "--no-progress": 0, "--out-dir": 1, "--out": 1, "--out-memory": 1,
            "--out-speed": 1}
LAUNCHER = ["-m", "veloxquant_mlx.platform.blas"]
# "`python ...` (`figures/x.json`" or "`python ...` (... `figures/x.json`": a command beside the figure it makes.
COMMAND_BESIDE = re.compile(r"`(python [^`]+)`\s*\((?:[^()`]*?)`(figures/[^`]+\.json)`")


def normalized(command: str) -> list:
    """A command's words as they are compared: today's script names, no OpenBLAS launcher, no
    output-only flags; ``python -m veloxquant_mlx ... eval`` (before the lab existed) is ``python -m lab ... eval``."""
    for old, new in RENAMED.items():
        command = command.replace(old, new)
    words = shlex.split(command)
    if words[1:3] == LAUNCHER:
        words = words[:1] + words[3:]
    if words[1:3] == ["-m", "veloxquant_mlx"] and "eval" in words:
        words[2] = "lab"
    out, skip = [], 0
    for w in words:
        if skip:
            skip -= 1
            continue
        flag = w.split("=", 1)[0]
        if flag in PLUMBING:
            skip = PLUMBING[flag] if "=" not in w else 0
            continue
        out.append(w)
    return out


def commands(root: Path) -> list:
    """(doc, figure, command) for every command a doc gives beside the figure it makes."""
    found = []
    for doc in docs(root):
        text = re.sub(r"\s*\n\s*", " ", doc.read_text(errors="replace"))  # a code span may wrap
        found += [(doc.relative_to(root).as_posix(), fig, cmd) for cmd, fig in COMMAND_BESIDE.findall(text)]
    return found


def command_mismatches(root: Path, provenance: dict | None = None) -> list:
    """(doc, figure, the doc's command, the recorded one) where they differ (or the figure records none)."""
    provenance = figures(root) if provenance is None else provenance
    bad = []
    for doc, fig, cmd in commands(root):
        prov = provenance.get(fig)
        recorded = prov.get("command") if isinstance(prov, dict) else None
        if recorded is None or normalized(cmd) != normalized(recorded):
            bad.append((doc, fig, cmd, recorded))
    return bad


def check(root: Path, current: dict | None = None) -> dict:
    """{"fresh": {path: prov}, "stale": {path: {method: why}}, "quotes": ..., "failing": [(path, doc, line)]}."""
    current = fingerprint() if current is None else current
    figs = figures(root)
    stale = {p: s for p, prov in figs.items() if (s := stale_methods(prov, current))}
    q = quotes(root, list(figs))
    failing = [(p, d, n) for p in stale for d, n, ok in q[p] if not ok]
    return {"fresh": {p: figs[p] for p in figs if p not in stale}, "stale": stale, "quotes": q,
            "failing": failing, "current": current, "provenance": figs,
            "commands": command_mismatches(root, figs)}


def report(res: dict) -> str:
    lines = [f"current fingerprints: " + ", ".join(f"{m}={h}" for m, h in sorted(res["current"].items())), ""]
    lines.append(f"fresh figures ({len(res['fresh'])}):")
    for p, prov in res["fresh"].items():  # fresh provenance is always a dict with a fingerprint
        cov = ", ".join(sorted(prov.get("fingerprint", {})))
        lines.append(f"  {p}  [{cov}]  {prov.get('commit', '?')} {prov.get('date', '?')}")
    lines.append("")
    lines.append(f"stale figures ({len(res['stale'])}):")
    for p, why in res["stale"].items():
        prov = res["provenance"].get(p)
        prov = prov if isinstance(prov, dict) else {}
        when = f" (measured {str(prov.get('date', '?'))[:10]} at {prov.get('commit', '?')})" if prov else ""
        reason = why["*"] if "*" in why else "behaviour changed for " + ", ".join(why)
        lines.append(f"  {p}: {reason}{when}")
        for d, n, ok in res["quotes"][p]:
            lines.append(f"      quoted by {d}:{n}" + (" (says stale)" if ok else "  <-- FAILS"))
    lines.append("")
    for doc, fig, cmd, recorded in res.get("commands", []):
        lines.append(f"  {doc} gives for {fig}:\n      {cmd}\n    which is not what made it:\n      {recorded}  <-- FAILS")
    if res["failing"]:
        lines.append(f"FAIL: {len(res['failing'])} doc line(s) quote a stale figure without saying so.")
    else:
        lines.append("OK: no doc quotes a stale figure without saying so.")
    if res.get("commands"):
        lines.append(f"FAIL: {len(res['commands'])} doc command(s) beside a figure are not the command it recorded.")
    else:
        lines.append("OK: every command a doc gives beside a figure is the one it recorded.")
    return "\n".join(lines)


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def fingerprint_at(rev: str, methods) -> tuple:
    """(fingerprint dict or None, error text)."""
    with tempfile.TemporaryDirectory() as tmp:
        arc = subprocess.run(["git", "archive", rev, "veloxquant_mlx"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=arc.stdout, check=True)
        (Path(tmp) / "lab").mkdir()  # today's fingerprint code over that commit's package
        (Path(tmp) / "lab" / "__init__.py").write_text("")
        (Path(tmp) / "lab" / "provenance.py").write_text(PROV.read_text())
        fit = Path(tmp) / "veloxquant_mlx" / "evaluation" / "kvzap_fit.py"  # its name since 2026-12-05
        if not fit.exists() and (fit.parent / "kvzap_collect.py").exists():
            fit.write_text("from veloxquant_mlx.evaluation.kvzap_collect import tiny_scorer  # noqa: F401\n")
        code = ("import json, sys; from lab.provenance import fingerprint; "
                f"print(json.dumps(fingerprint({list(methods)!r})))")
        r = subprocess.run([sys.executable, "-c", code], cwd=tmp, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": tmp})
    if r.returncode:
        return None, (r.stderr.strip().splitlines() or ["?"])[-1]
    return json.loads(r.stdout.strip().splitlines()[-1]), ""


def merged(old, prov: dict) -> dict:
    """The new provenance, keeping what an older one recorded besides it (machine, BLAS, a note, the
    commit it named when that differs)."""
    if not isinstance(old, dict):
        return prov if old is None else {**prov, "before_stamp": old}
    out = {**{k: v for k, v in old.items() if k not in ("fingerprint", "stale_reason")}, **prov}
    if old.get("commit") and not str(prov["commit"]).startswith(str(old["commit"])[:12]):
        out["recorded_commit"] = old["commit"]
        if "dirty" in old:  # the old commit's state, not the stamped one's
            out["recorded_dirty"] = out.pop("dirty")
    if old.get("note"):
        out["note"] = f"{prov['note']}. Recorded note: {old['note']}"
    return out


def stamp_main(argv=None) -> int:
    """Attach provenance to a figure written before figures carried it (or by an older script)."""
    ap = argparse.ArgumentParser(prog="check_figures.py stamp", description=STAMP_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figures", nargs="+")
    ap.add_argument("--commit", required=True, help="the commit whose code produced the figure")
    ap.add_argument("--command", required=True)
    ap.add_argument("--methods", nargs="+", required=True, help="methods the figure covers (full = KVCache)")
    ap.add_argument("--date", help="when it was measured (default: the commit's date)")
    ap.add_argument("--note", default="")
    ap.add_argument("--stale-reason", default="", help="mark stale whatever the fingerprint says")
    args = ap.parse_args(argv)
    rev = git("rev-parse", "--short=12", args.commit)
    fp, err = fingerprint_at(rev, args.methods)
    note = (f"provenance attached later by benchmark_scripts/check_figures.py stamp at {commit()}; fingerprint "
            f"computed on a checkout of {rev}")
    prov = {"commit": rev, "command": args.command, "date": args.date or git("show", "-s", "--format=%aI", rev)}
    if fp is not None:
        prov["fingerprint"] = fp
    else:
        note += f" failed ({err}): that code predates the fingerprint's settings"
        prov["stale_reason"] = args.stale_reason or f"produced by code too old to fingerprint ({rev})"
    if args.stale_reason:
        prov["stale_reason"] = args.stale_reason
    prov["note"] = note + (f". {args.note}" if args.note else "")
    for f in args.figures:
        path = Path(f)
        text = path.read_text()
        data = json.loads(text)
        old = data.get("provenance")
        if isinstance(old, list):  # a writer's per-run records (machine, BLAS): kept as data
            data["runs_provenance"], old = old, None
        data["provenance"] = merged(old, prov)
        indent = 2 if text.startswith("{\n  \"") else 1
        path.write_text(json.dumps(data, indent=indent) + "\n")
        print(f"{f}: {json.dumps(data['provenance'])[:300]}")
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["stamp"]:
        return stamp_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="checkout holding figures/, README.md and docs/")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = check(Path(args.root))
    print(f"check_figures at {commit()} ({time.perf_counter() - t0:.1f} s, {os.cpu_count()} CPUs)")
    print(report(res))
    return 1 if res["failing"] or res["commands"] else 0


if __name__ == "__main__":
    sys.exit(main())
