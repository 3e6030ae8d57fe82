"""Offline synthetic planted-anomaly benchmark suite (thin CLI over lab.planted).

    python benchmark_scripts/benchmark_planted.py            # full run (< 30 min on 2 CPU cores)
    python benchmark_scripts/benchmark_planted.py --quick    # < 1 min smoke run
    python benchmark_scripts/benchmark_planted.py --only bridge --seeds 0 1 2

Writes <out>/results.json (sorted keys, floats rounded; only ``*_ms`` fields vary between runs),
PNG figures in <out>/, and regenerates the table block of docs/benchmarks.md (full runs only, unless
--docs is given); the published figures/planted/ and docs/benchmarks.md only with --publish, else the
same paths under ./veloxquant_bench/. Every registered method runs, plus Nexus top-K / no-walk ablations; a method that
raises gets "error" in its cells and the run continues.

For realistic CPU timings preload OpenBLAS:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 python ...
(results.json records whether it was preloaded; the retention numbers do not depend on it).
"""

from __future__ import annotations

import argparse
import os

from _common import ROOT, add_publish, output, route_outputs

from lab import planted as P
from lab.provenance import command_line, provenance

DOC_HEADER = """# Benchmarks

"""


def make_figures(results: dict, out_dir: str) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    variants = list(results["variants"])
    written = []
    fams = {}
    for key, sc in results["scenarios"].items():
        fams.setdefault(sc["family"], []).append((key, sc))
    for fam, items in fams.items():
        n = len(items)
        ncol = min(3, n)
        nrow = -(-n // ncol)
        fig, axes = plt.subplots(nrow, ncol, figsize=(5.2 * ncol, 3.4 * nrow), squeeze=False)
        for ax, (key, sc) in zip(axes.flat, items):
            budgets = sc["budgets"]
            width = 0.8 / len(budgets)
            x = np.arange(len(variants))
            for j, b in enumerate(budgets):
                cells = [sc["cells"][v][str(b)] for v in variants]
                m = np.array([c.get("retention_mean", np.nan) for c in cells])
                lo = np.array([c["retention_ci95"][0] if "retention_ci95" in c else np.nan for c in cells])
                hi = np.array([c["retention_ci95"][1] if "retention_ci95" in c else np.nan for c in cells])
                pos = x - 0.4 + width * (j + 0.5)
                ax.bar(pos, np.nan_to_num(m), width, label=f"budget {b}",
                       yerr=[np.nan_to_num(m - lo), np.nan_to_num(hi - m)], capsize=2)
                for p_, c in zip(pos, cells):
                    if "error" in c:
                        ax.text(p_, 0.02, "x", ha="center", va="bottom", color="red", fontsize=8)
            ax.set_title(f"{key} (target: {sc['target']})", fontsize=9)
            ax.set_xticks(x)
            ax.set_xticklabels(variants, rotation=60, ha="right", fontsize=7)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("retention")
            ax.legend(fontsize=6)
        for ax in list(axes.flat)[n:]:
            ax.axis("off")
        fig.suptitle(f"Planted-token retention — {fam} (red x: method raised)", fontsize=10)
        fig.tight_layout()
        path = os.path.join(out_dir, f"retention_{fam}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    for key, sc in results["scenarios"].items():
        if sc["family"] != "erosion":
            continue
        for b in sc["budgets"]:
            fig, ax = plt.subplots(figsize=(7.5, 4.2))
            for i, v in enumerate(variants):
                c = sc["cells"][v][str(b)]
                if "survival" not in c:
                    continue
                ax.plot(c["survival"]["decode_step"], c["survival"]["retention_mean"], label=v,
                        linestyle="-" if i < 10 else "--")
            ax.set_xlabel("decode step")
            ax.set_ylabel("subtle-token retention (mean over seeds)")
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"Marginal erosion: survival of the subtle blocks ({key}, budget {b})", fontsize=10)
            ax.legend(fontsize=7, ncol=2)
            fig.tight_layout()
            path = os.path.join(out_dir, f"survival_{key}_b{b}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="reduced sizes and 2 seeds (< 1 minute)")
    ap.add_argument("--seeds", type=int, nargs="+", help="seeds (default: 0-4 full, 0-1 quick)")
    ap.add_argument("--out", default=str(ROOT / "figures" / "planted"), help="output folder")
    ap.add_argument("--only", nargs="+", choices=P.FAMILIES, help="scenario families to run")
    ap.add_argument("--docs", default=None,
                    help="markdown file whose table block to regenerate (default: docs/benchmarks.md for "
                         "full runs of every family, nothing otherwise; 'none' disables)")
    ap.add_argument("--no-figures", action="store_true")
    add_publish(ap)
    args = route_outputs(ap.parse_args(argv), "out")

    kw = {}
    if args.seeds:
        kw["seeds"] = tuple(args.seeds)
    if args.only:
        kw["only"] = tuple(args.only)
    cfg = P.SuiteConfig.quick(**kw) if args.quick else P.SuiteConfig.full(**kw)
    variants = P.method_variants()
    total = P.n_cells(cfg, variants)
    print(f"methods: {', '.join(v.label for v in variants)}")
    print(f"{total} cells x {len(cfg.seeds)} seeds; OpenBLAS preloaded: {P.blas_preloaded()}")

    from tqdm import tqdm

    bar = tqdm(total=total, unit="cell", dynamic_ncols=True)

    def progress(label):
        bar.set_postfix_str(label[:60])
        bar.update(1)

    results = P.run_suite(cfg, variants, progress=progress)
    bar.close()
    results["openblas_preloaded"] = P.blas_preloaded()
    results["preset"] = "quick" if args.quick else "full"
    results["provenance"] = provenance(command_line(), ["full", *(v.label for v in variants)])

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    with open(path, "w") as f:
        f.write(P.to_json(results))
    print(f"wrote {path}")
    if not args.no_figures:
        for p in make_figures(results, args.out):
            print(f"wrote {p}")
    docs = args.docs
    if docs is None and not args.quick and not args.only:
        docs = str(ROOT / "docs" / "benchmarks.md")
    if docs and docs != "none":
        docs = output(docs, args.publish)  # without --publish: a copy of the table block under ./veloxquant_bench/
        os.makedirs(os.path.dirname(os.path.abspath(docs)), exist_ok=True)
        P.update_markdown(docs, P.round_floats(results), header=DOC_HEADER)
        print(f"updated {docs}")
    if results["errors"]:
        print(f"{len(results['errors'])} cells raised:")
        seen = set()
        for e in results["errors"]:
            k = (e["variant"], e["error"][:120])
            if k not in seen:
                seen.add(k)
                print(f"  {e['variant']} ({e['scenario']}, budget {e['budget']}): {e['error'][:160]}")
    print(f"total {results['total_ms'] / 1000:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
