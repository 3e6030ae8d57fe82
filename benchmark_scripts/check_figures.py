"""Which published figures has the code moved away from, and which docs still quote them?

    python benchmark_scripts/check_figures.py            # report; exit 1 when a doc quotes a stale figure
    python benchmark_scripts/check_figures.py --root DIR # another checkout (figures/, README.md, docs/)

Recomputes every method's behaviour fingerprint (veloxquant_mlx.evaluation.provenance: a few seconds
on a tiny random model), reads the ``provenance`` of every JSON under figures/, and calls a figure
stale when it has no provenance, carries a ``stale_reason``, or stores a fingerprint that differs
from the current one for any method it covers. A doc (README.md, docs/**/*.md) quotes a figure when
it names the figure's path. A quote on a line that itself says "stale" tells the reader so and is
listed but allowed; any other quote of a stale figure fails the check.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from veloxquant_mlx.evaluation.provenance import commit, fingerprint, stale_methods  # noqa: E402


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


def check(root: Path, current: dict | None = None) -> dict:
    """{"fresh": {path: prov}, "stale": {path: {method: why}}, "quotes": ..., "failing": [(path, doc, line)]}."""
    current = fingerprint() if current is None else current
    figs = figures(root)
    stale = {p: s for p, prov in figs.items() if (s := stale_methods(prov, current))}
    q = quotes(root, list(figs))
    failing = [(p, d, n) for p in stale for d, n, ok in q[p] if not ok]
    return {"fresh": {p: figs[p] for p in figs if p not in stale}, "stale": stale, "quotes": q,
            "failing": failing, "current": current, "provenance": figs}


def report(res: dict) -> str:
    lines = [f"current fingerprints: " + ", ".join(f"{m}={h}" for m, h in sorted(res["current"].items())), ""]
    lines.append(f"fresh figures ({len(res['fresh'])}):")
    for p, prov in res["fresh"].items():
        cov = ", ".join(sorted(prov.get("fingerprint", {})))
        lines.append(f"  {p}  [{cov}]  {prov.get('commit', '?')} {prov.get('date', '?')}")
    lines.append("")
    lines.append(f"stale figures ({len(res['stale'])}):")
    for p, why in res["stale"].items():
        prov = res["provenance"].get(p) or {}
        when = f" (measured {str(prov.get('date', '?'))[:10]} at {prov.get('commit', '?')})" if prov else ""
        reason = why["*"] if "*" in why else "behaviour changed for " + ", ".join(why)
        lines.append(f"  {p}: {reason}{when}")
        for d, n, ok in res["quotes"][p]:
            lines.append(f"      quoted by {d}:{n}" + (" (says stale)" if ok else "  <-- FAILS"))
    lines.append("")
    if res["failing"]:
        lines.append(f"FAIL: {len(res['failing'])} doc line(s) quote a stale figure without saying so.")
    else:
        lines.append("OK: no doc quotes a stale figure without saying so.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT), help="checkout holding figures/, README.md and docs/")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    res = check(Path(args.root))
    print(f"check_figures at {commit()} ({time.perf_counter() - t0:.1f} s, {os.cpu_count()} CPUs)")
    print(report(res))
    return 1 if res["failing"] else 0


if __name__ == "__main__":
    sys.exit(main())
