"""Formatting shared by the report writers: markdown tables, percentages with Wilson intervals, method
order, colours, and matplotlib set-up and figure saving."""

from __future__ import annotations

import json
from pathlib import Path

from veloxquant_mlx.evaluation.results import FULL, _ada_base, _is_ada
from .stats import wilson


def md_row(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def md_table(head, rows=()) -> list:
    """Markdown lines: the header row, its rule, then ``rows`` (each a list of cell strings)."""
    return [md_row(head), "|" + "---|" * len(head)] + [md_row(r) for r in rows]


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (ImportError without the bench extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wilson_bars(avg, n) -> tuple:
    """(accuracy %, distance down, distance up) of an accuracy ``avg`` over ``n`` prompts to its Wilson
    95% bounds: a figure's point and error bar."""
    lo, hi = wilson(int(round(avg * n)), n)
    return 100 * avg, 100 * (avg - lo), 100 * (hi - avg)


def _save_figure(plt, fig, figs_dir, filename) -> Path:
    fig.tight_layout()
    path = Path(figs_dir) / filename
    fig.savefig(path, dpi=110, bbox_inches="tight")  # keeps a legend placed outside the axes
    plt.close(fig)
    return path


def _load_json(out_dir, name):
    p = Path(out_dir) / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else None


def _pct(x):
    return "–" if x is None else f"{100 * x:.1f}"


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _ci_cell(k, n):
    """'80 [49–94] (8/10)': accuracy % with its Wilson 95% interval and the counts."""
    lo, hi = wilson(k, n)
    return f"{100 * k / n:.0f} [{100 * lo:.0f}–{100 * hi:.0f}] ({k}/{n}"


def _ci_avg(avg, n, unit=""):
    """'83.3 [76.5–88.5]' (``unit`` after the point estimate) for an accuracy ``avg`` over ``n``
    prompts (Wilson 95%)."""
    if avg is None or not n:
        return "–"
    lo, hi = wilson(int(round(avg * n)), n)
    return f"{100 * avg:.1f}{unit} [{100 * lo:.1f}–{100 * hi:.1f}]"


def _ok_cells(data):
    return [c for c in (data or {}).get("cells", {}).values() if "error" not in c]


def _err_cells(data):
    return [c for c in (data or {}).get("cells", {}).values() if "error" in c]


def _order(names, spec_order=None):
    pref = [FULL, "nexus", "nexus-topk", "nexus-nowalk", "nexus-smooth", "nexus-prior", "nexus-prior1", "nexus-b16", "h2o", "snapkv", "pyramidkv", "morphkv",
            "nestedkv", "streaming", "random"]
    def rank(n):
        base = _ada_base(n)  # an Ada variant sits right after its method
        return (pref.index(base) if base in pref else len(pref)) + 0.5 * (base != n)

    return sorted(set(names), key=lambda n: (rank(n), n))


_REGIME_NAME = {"prefill": "prefill-only", "decode": "prefill + decode"}


_PALETTE = [FULL, "nexus", "nexus-topk", "nexus-nowalk", "h2o", "snapkv", "pyramidkv", "morphkv", "nestedkv",
            "streaming", "random", "kvcache", "rotating", "nexus-smooth", "nexus-prior", "nexus-prior1", "nexus-b16"]


def _style(name) -> dict:
    """Line style of a method's curve: Nexus variants solid, others dashed, Ada variants dotted squares."""
    if _is_ada(name):
        return {"linestyle": ":", "marker": "s"}
    return {"linestyle": "-" if name.startswith("nexus") else "--", "marker": "o"}


def _color(name):
    import matplotlib.pyplot as plt

    if _is_ada(name):
        return _color(_ada_base(name))  # an Ada variant: its method's colour, told apart by _style
    i = _PALETTE.index(name) if name in _PALETTE else len(_PALETTE) + sum(map(ord, name)) % 7  # stable across runs
    # tab20's dark shades first (nexus = dark blue), its light ones after the tenth name
    return "k" if name == FULL else plt.cm.tab20((2 * (i - 1)) % 20 + ((i - 1) // 10) % 2)


def _ctx_label(n):
    return f"{n // 1024}K" if n % 1024 == 0 else (f"{n / 1000:g}K" if n % 1000 == 0 else str(n))
