"""Attach provenance to a figure written before figures carried it (or by an older script).

    python benchmark_scripts/stamp_figure.py figures/x.json --commit C --command "python ..." \\
        --methods full nexus [--date ISO] [--note "..."] [--stale-reason "..."]

The fingerprint is computed on a checkout of the producing commit C (``git archive`` of the package
into a temporary folder, with today's fingerprint code copied in), so a figure made by code that has
since changed gets that code's hash and shows up stale in check_figures.py. When the fingerprint
cannot be computed there (code older than the settings it runs), the figure gets a
``stale_reason`` instead. The figure's date defaults to C's commit date.
What an older provenance recorded besides (machine, BLAS, its note, its commit as ``recorded_commit``)
is kept; a writer's list of per-run records moves to ``runs_provenance``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from veloxquant_mlx.evaluation.provenance import commit  # noqa: E402

PROV = ROOT / "veloxquant_mlx" / "evaluation" / "provenance.py"


def git(*args) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def fingerprint_at(rev: str, methods) -> tuple:
    """(fingerprint dict or None, error text)."""
    with tempfile.TemporaryDirectory() as tmp:
        arc = subprocess.run(["git", "archive", rev, "veloxquant_mlx"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=arc.stdout, check=True)
        (Path(tmp) / "veloxquant_mlx" / "evaluation" / "provenance.py").write_text(PROV.read_text())
        code = ("import json, sys; from veloxquant_mlx.evaluation.provenance import fingerprint; "
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    note = (f"provenance attached later by benchmark_scripts/stamp_figure.py at {commit()}; fingerprint "
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


if __name__ == "__main__":
    sys.exit(main())
