"""kvzip before and after KVzip+ on the same passkey prompts: paired counts, Wilson intervals, exact McNemar.

"Before" are the published ``kvzip`` cells of a grid (the current default; its fingerprint is unchanged),
"after" the ``kvzip-plus`` cells of a run of the same grid; a prompt is (haystack, context, depth, key,
regime) at one density. Other labels of the published grid (``full``, ``nexus``, ...) are paired too.

    python benchmark_scripts/kvzip_plus_paired.py --before figures/eval/gemma3/passkey.json \\
        --after figures/kvzip/passkey_gemma3_kvzip_plus.json --out figures/kvzip/plus_paired_gemma3.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.evaluation.provenance import command_line, provenance  # noqa: E402
from veloxquant_mlx.evaluation.stats import fmt_ci, fmt_p, paired, wilson  # noqa: E402

PROMPT_FIELDS = ("haystack", "context", "depth", "key", "regime")


def by_method(path: Path, density: float) -> dict:
    """{label: {prompt: correct}} of a passkey JSON at one density (the full cache's cells have none)."""
    out: dict = {}
    for cell in json.loads(path.read_text())["cells"].values():
        if "correct" not in cell or cell.get("density") not in (None, density):
            continue
        out.setdefault(cell["method"], {})[tuple(cell[f] for f in PROMPT_FIELDS)] = bool(cell["correct"])
    return out


def summary(cells: dict) -> dict:
    k, n = sum(cells.values()), len(cells)
    lo, hi = wilson(k, n)
    per = {}
    for hay in sorted({p[0] for p in cells}):
        sub = [v for p, v in cells.items() if p[0] == hay]
        per[hay] = f"{sum(sub)}/{len(sub)}"
    return {"correct": k, "n": n, "pct": round(100 * k / n, 1) if n else None,
            "wilson95": [round(100 * lo, 1), round(100 * hi, 1)], "per_haystack": per}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, type=Path)
    ap.add_argument("--after", required=True, type=Path)
    ap.add_argument("--before-label", default="kvzip")
    ap.add_argument("--after-label", default="kvzip-plus")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--out", required=True, type=Path)
    a = ap.parse_args(argv)
    before, after = by_method(a.before, a.density), by_method(a.after, a.density)
    new = after[a.after_label]
    rows = {}
    for label in sorted(before):
        old = before[label]
        common = {p: old[p] for p in new if p in old}
        if not common:
            continue
        pr = paired({p: new[p] for p in common}, common)
        text_prompts = [p for p in common if p[0] == "text"]
        pt = paired({p: new[p] for p in text_prompts}, {p: common[p] for p in text_prompts})
        rows[label] = {"on_these_prompts": summary(common), "paired": pr, "paired_prose": pt}
    out = {"experiment": "kvzip-plus vs the published cells, paired", "density": a.density, "before_file": str(a.before),
           "after_file": str(a.after), "after_label": a.after_label, "after": summary(new), "vs": rows,
           "provenance": provenance(command_line(), ["kvzip", "kvzip[normalize='plus']"])}
    a.out.write_text(json.dumps(out, indent=1))
    print(f"{a.after_label}: {fmt_ci(out['after']['correct'], out['after']['n'])} {out['after']['per_haystack']}")
    for label, r in rows.items():
        p = r["paired"]
        print(f"  vs {label:16s} {fmt_ci(r['on_these_prompts']['correct'], p['n'])} "
              f"{r['on_these_prompts']['per_haystack']}  only {a.after_label} {p['only_a']} / only {label} "
              f"{p['only_b']}  p={fmt_p(p['p'])}; prose {r['paired_prose']['only_a']} / {r['paired_prose']['only_b']} "
              f"p={fmt_p(r['paired_prose']['p'])}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
