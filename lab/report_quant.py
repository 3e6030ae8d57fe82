"""Passkey with quantized kept rows (``bench_quality.py quant-report``): each label at 20 % paired against
the same method with fp rows, and the equal-memory curve (accuracy against allocated KV bytes)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from .report_format import pyplot
from .report_paired import _paired_outcomes
from .report_passkey import _passkey_index
from .stats import paired, wilson

_STORAGE = re.compile(r"-(4|8)bit(-g\d+)?$")


def fp_label(label: str) -> str:
    """The same method with fp rows: ``nexus-4bit-g32`` -> ``nexus``."""
    return _STORAGE.sub("", label)


def storage(label: str) -> str:
    m = _STORAGE.search(label)
    return m.group(0)[1:] if m else "fp"


def index(path: str):
    """({(label, density): {prompt: correct}}, {(label, density): {prompt: kv bytes}}, data). ``path``
    may join several result files with commas (e.g. a later group-size run on the same prompts)."""
    parts = [json.loads(Path(p).read_text()) for p in path.split(",")]
    data = {**parts[0], "cells": {k: v for d in parts for k, v in d["cells"].items()}}
    res, densities, _ = _passkey_index(data)
    columns = sorted({(k[3], k[4]) for k in res})
    out = {}
    for (regime, d, m, _, _) in res:
        if regime == "prefill":
            out[(m, d)] = _paired_outcomes(res, "prefill", d, m, columns)
    nbytes = {}
    for c in data["cells"].values():
        if "error" not in c and c.get("seed", 0) == 0 and c.get("regime") == "prefill":
            p = (c["haystack"], c["context"], c["depth"], c["key"])
            for d in ([c["density"]] if c["density"] is not None else densities):
                nbytes.setdefault((c["method"], d), {})[p] = c["kv_bytes_end"]
    return out, nbytes, data


def common(outs: dict, keys) -> list:
    sets = [set(outs[k]) for k in keys if k in outs]
    return sorted(set.intersection(*sets), key=repr) if sets else []


def table(outs: dict, density: float, labels) -> dict:
    keys = [(m, density) for m in labels if (m, density) in outs]
    prompts = common(outs, keys)
    rows = {}
    for m, d in keys:
        k = sum(outs[(m, d)][p] for p in prompts)
        lo, hi = wilson(k, len(prompts))
        row = {"correct": k, "n": len(prompts), "acc": k / max(len(prompts), 1), "wilson95": [lo, hi]}
        base = (fp_label(m), d)
        if base[0] != m and base in outs:
            pr = paired({p: outs[base][p] for p in prompts}, {p: outs[(m, d)][p] for p in prompts})
            row["vs_fp"] = {"label": base[0], "only_fp": pr["only_a"], "only_quant": pr["only_b"], "p": pr["p"]}
        g64 = (re.sub(r"-g\d+$", "", m), d)
        if g64[0] != m and g64 in outs:  # a group-size label against the default groups of 64
            pr = paired({p: outs[g64][p] for p in prompts}, {p: outs[(m, d)][p] for p in prompts})
            row["vs_g64"] = {"label": g64[0], "only_g64": pr["only_a"], "only_this": pr["only_b"], "p": pr["p"]}
        rows[m] = row
    return {"n_prompts": len(prompts), "rows": rows}


def curve(outs: dict, nbytes: dict, method: str, bits, full_labels, densities) -> dict:
    keys = [(method + b, d) for b in bits for d in densities] + [(f, 0.2) for f in full_labels]
    keys = [k for k in keys if k in outs]
    prompts = common(outs, keys)
    full_bytes = sum(nbytes[("full", 0.2)][p] for p in prompts) / max(len(prompts), 1)
    points = []
    for m, d in keys:
        k = sum(outs[(m, d)][p] for p in prompts)
        b = sum(nbytes[(m, d)][p] for p in prompts) / max(len(prompts), 1)
        lo, hi = wilson(k, len(prompts))
        points.append({"label": m, "storage": storage(m), "density": None if m.startswith("full") else d,
                       "correct": k, "n": len(prompts), "acc": k / max(len(prompts), 1), "wilson95": [lo, hi],
                       "kv_bytes": b, "kv_vs_kvcache": b / full_bytes if full_bytes else None})
    return {"method": method, "n_prompts": len(prompts), "kvcache_bytes": full_bytes, "points": points}


def plot(c: dict, title: str, out: str) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {"fp": "C0", "8bit": "C1", "4bit": "C2"}
    for st in ("fp", "8bit", "4bit"):
        for full in (False, True):
            pts = [p for p in c["points"] if p["storage"] == st and p["label"].startswith("full") == full]
            if not pts:
                continue
            pts.sort(key=lambda p: p["kv_bytes"])
            x = [p["kv_bytes"] / 2 ** 20 for p in pts]
            y = [100 * p["acc"] for p in pts]
            err = [[100 * (p["acc"] - p["wilson95"][0]) for p in pts], [100 * (p["wilson95"][1] - p["acc"]) for p in pts]]
            name = (f"full cache, {st} rows" if full else f"{c['method']}, {st} rows")
            ax.errorbar(x, y, yerr=err, fmt="s" if full else "o-", color=colors[st], capsize=3,
                        mfc="white" if full else colors[st], label=name)
            if not full:
                for xi, yi, p in zip(x, y, pts):
                    ax.annotate(f"{int(round(100 * p['density']))}%", (xi, yi), textcoords="offset points",
                                xytext=(4, -12), fontsize=7, color=colors[st])
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator([1, 2, 4, 8, 16, 32, 64]))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("allocated KV after prompt + 8 tokens (MiB, log)")
    ax.set_ylabel("passkey accuracy (%), Wilson 95%")
    ax.set_title(f"{title}: equal-memory curve, 1K passkey, {c['n_prompts']} prompts", fontsize=10)
    ax.set_ylim(-3, 103)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
