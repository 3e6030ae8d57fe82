"""Passkey accuracy of every method on two models side by side, with Wilson 95% intervals, and
Nexus's paired comparison (exact McNemar) against each method on each model.

Reads the cells the evaluation wrote (``python -m veloxquant_mlx eval passkey``): by default
``figures/eval/passkey.json`` (SmolLM2-135M, the bundled model) and ``figures/eval/gemma3/passkey.json``
(Gemma 3 270M). Each model's numbers are over the prompts every plotted method finished on that model,
prefill-only regime (``prompt_eviction="end"``). Writes ``figures/eval/passkey_two_models.png`` and
prints a markdown table.

    python benchmark_scripts/plot_quality.py [--density 0.2] [--out figures/eval/passkey_two_models.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from veloxquant_mlx.evaluation.report_paired import _paired_outcomes
from veloxquant_mlx.evaluation.report_passkey import _passkey_index
from veloxquant_mlx.evaluation.stats import fmt_p, paired, wilson

DEFAULT_RUNS = (("SmolLM2-135M", "figures/eval/passkey.json"), ("Gemma-3-270M", "figures/eval/gemma3/passkey.json"))


def outcomes(path: str, density: float) -> dict:
    """method -> {prompt: correct} for the prefill-only cells at ``density`` (the full cache at any),
    indexed as the report indexes them (seed 0, errors left out)."""
    res, _, _ = _passkey_index(json.loads(Path(path).read_text()))
    columns = sorted({(k[3], k[4]) for k in res})
    methods = {k[2] for k in res if k[0] == "prefill" and k[1] == density}
    return {m: _paired_outcomes(res, "prefill", density, m, columns) for m in methods}


def common_prompts(res: dict, methods) -> list:
    sets = [set(res[m]) for m in methods if m in res]
    return sorted(set.intersection(*sets)) if sets else []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--out", default="figures/eval/passkey_two_models.png")
    args = ap.parse_args(argv)
    runs = [(name, outcomes(p, args.density)) for name, p in DEFAULT_RUNS if Path(p).exists()]
    if not runs:
        raise SystemExit("no passkey cells found: run `python -m veloxquant_mlx eval passkey` first")
    # the methods run on every model, in a fixed order (full first, Nexus next)
    shared = set.intersection(*(set(r) for _, r in runs))
    order = ["full", "nexus"] + sorted(m for m in shared if m not in ("full", "nexus"))
    methods = [m for m in order if m in shared]
    table = {}
    print("| Method | " + " | ".join(f"{n}: accuracy [95% CI] (k/n) | vs Nexus: only Nexus / only other, p"
                                     for n, _ in runs) + " |")
    print("|---|" + "---|---|" * len(runs))
    for name, res in runs:
        prompts = common_prompts(res, methods)
        for m in methods:
            k = sum(res[m][p] for p in prompts)
            pr = paired({p: res["nexus"][p] for p in prompts}, {p: res[m][p] for p in prompts})
            table[(name, m)] = (k, len(prompts), wilson(k, len(prompts)), pr)
    for m in methods:
        row = [m]
        for name, _ in runs:
            k, n, (lo, hi), pr = table[(name, m)]
            row.append(f"{100 * k / n:.1f} [{100 * lo:.1f}–{100 * hi:.1f}] ({k}/{n})")
            row.append("–" if m == "nexus" else f"{pr['only_a']} / {pr['only_b']}, p {fmt_p(pr['p'])}")
        print("| " + " | ".join(row) + " |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 0.45 * len(methods) + 1.4), sharey=True)
    axes = axes if len(runs) > 1 else [axes]
    for ax, (name, _) in zip(axes, runs):
        ys = range(len(methods))
        for y, m in zip(ys, methods):
            k, n, (lo, hi), _ = table[(name, m)]
            color = "black" if m == "full" else ("tab:red" if m.startswith("nexus") else "tab:blue")
            ax.errorbar(100 * k / n, y, xerr=[[100 * (k / n - lo)], [100 * (hi - k / n)]], fmt="o", color=color,
                        capsize=3)
        n = table[(name, methods[0])][1]
        ax.set_title(f"{name} ({n} prompts, {args.density:.0%} budget)")
        ax.set_xlim(-2, 102)
        ax.set_xlabel("passkey accuracy (%), Wilson 95% interval")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(methods)))
    axes[0].set_yticklabels(methods)
    axes[0].invert_yaxis()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
