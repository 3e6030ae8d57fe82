"""The evidence behind docs/choosing.md: every cache's passkey accuracy on the same prompts, paired against
the full cache, beside the KV it holds at its peak (through plain ``generate_step``) and after the prompt.

Reads the passkey result files named on the command line (``eval passkey`` JSONs; a cell's label is its
method, plus ``:stream`` for the ``decode`` regime, i.e. ``prompt_eviction="stream"`` with its prefill
chunk), pairs each label with the full cache on the prompts both ran, and measures each label's KV bytes once on one
prompt of the same length: the largest ``sum(c.nbytes)`` right after any layer's update (the KV part of
the peak) and after generation. Writes ``figures/choosing/summary_<model>.json`` and the figure
``figures/choosing/accuracy_vs_peak_<model>.png`` (accuracy with its Wilson 95 % interval against KV peak bytes).

    python benchmark_scripts/choosing.py figures/eval/choosing/passkey_end.json figures/eval/choosing/passkey_stream.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _common import FIGURES, MIB, preload_blas, stamp, write_json

OUT = FIGURES / "choosing"


def label_of(cell: dict) -> str:
    return cell["method"] + (":stream" if cell["regime"] == "decode" else "")


def prompt_of(cell: dict) -> tuple:
    return cell["haystack"], cell["context"], cell["depth"], cell["key"]


def paired_table(files, context: int, density: float) -> tuple:
    """({label: {prompt: correct}} restricted to the prompts the label and the full cache both ran,
    {label: prefill chunk}). A label in several files keeps every prompt it ran."""
    by_label, chunk = {}, {}
    for f in files:
        data = json.loads(Path(f).read_text())
        step = data.get("grid", {}).get("prefill_step_decode_regime", 256)
        for c in data["cells"].values():
            if c.get("context") != context or "correct" not in c:
                continue
            if c["method"] != "full" and c.get("density") != density:
                continue
            lab = label_of(c)
            by_label.setdefault(lab, {})[prompt_of(c)] = bool(c["correct"])
            chunk[lab] = step if c["regime"] == "decode" else c.get("prefill_step", 2048)
    full = by_label.get("full", {})
    return {lab: {p: v[p] for p in v if p in full} for lab, v in by_label.items()}, chunk


def caches_for(model, label: str, budget: int):
    """The label's caches as the harness builds them (full, full-8bit, rotating, a method or ablation
    label), with prompt_eviction="stream" for a ``:stream`` label."""
    from veloxquant_mlx.evaluation.labels import make_caches, method_specs

    name, stream = (label[:-len(":stream")], True) if label.endswith(":stream") else (label, False)
    return make_caches(model, method_specs([name])[0], budget, prompt_eviction="stream" if stream else "end")


def kv_bytes(model, prompt, label: str, budget: int, step: int) -> dict:
    import gc

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from bench_memory import AllocationRecorder, total_nbytes

    gc.collect()
    mx.clear_cache()
    caches = caches_for(model, label, budget)
    rec = AllocationRecorder(caches)
    for _ in generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=caches, prefill_step_size=step):
        pass
    rec.close()
    return {"kv_peak_bytes": rec.max_bytes, "kv_after_bytes": total_nbytes(caches)}


def figure(rows: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in rows:
        x, acc, lo, hi = r["kv_peak_bytes"] / MIB, r["accuracy"], r["ci"][0], r["ci"][1]
        stream = r["label"].endswith(":stream") or r["label"] == "rotating"
        ax.errorbar([x], [100 * acc], yerr=[[100 * (acc - lo)], [100 * (hi - acc)]], fmt="o" if stream else "s",
                    capsize=3, color="tab:green" if stream else ("tab:gray" if r["label"].startswith("full") else "tab:blue"))
        ax.annotate(r["label"], (x, 100 * acc), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("KV peak during the prompt (MiB, largest allocated after any layer's update)")
    ax.set_ylabel("passkey accuracy (%), Wilson 95 %")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(-5, 105)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--model", default="bundled")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--out-dir", type=Path, default=OUT)
    p.add_argument("--labels", nargs="+", default=None, help="only these labels (default: every label found)")
    args = p.parse_args(argv)
    preload_blas()
    from veloxquant_mlx.config import budget_for
    from veloxquant_mlx.evaluation.passkey import make_passkey_prompt
    from lab.stats import paired, wilson
    from veloxquant_mlx.models import load_model

    table, chunk = paired_table(args.files, args.context, args.density)
    if args.labels:
        table = {lab: v for lab, v in table.items() if lab in set(args.labels) | {"full"}}
    out = args.out_dir / f"summary_{args.model}.json"
    measured = {}  # KV bytes of a label already measured at this setting (they do not depend on the prompts)
    if "full" not in table:
        raise SystemExit("the files hold no full-cache cells at this context: nothing to pair against")
    model, tokenizer = load_model(args.model)
    prompt, _ = make_passkey_prompt(tokenizer, args.context, 0.5, "12345")
    budget = budget_for(args.density, len(prompt))
    setting = {"model": args.model, "context": args.context, "density": args.density, "budget": budget}
    if out.exists():
        old = json.loads(out.read_text())
        if {k: old["setting"].get(k) for k in setting} == setting:
            measured = {r["label"]: {k: r[k] for k in ("kv_peak_bytes", "kv_after_bytes")} for r in old["rows"]}
    rows = []
    for lab, res in sorted(table.items()):
        k, n = sum(res.values()), len(res)
        row = {"label": lab, "correct": k, "prompts": n, "accuracy": k / n if n else float("nan"),
               "ci": list(wilson(k, n)), "prefill_step": chunk[lab],
               "vs_full": paired(table["full"], res) if lab != "full" else None,
               **(measured.get(lab) or kv_bytes(model, prompt, lab, budget, chunk[lab]))}
        rows.append(row)
        print(f"{lab:>24}: {k}/{n}  KV peak {row['kv_peak_bytes'] / MIB:6.2f} MiB, after {row['kv_after_bytes'] / MIB:6.2f} MiB",
              flush=True)
    res = {"setting": {**setting, "files": [str(f) for f in args.files]}, "rows": rows}
    stamp(res, sorted({r["label"].split(":")[0] for r in rows} - {"full", "full-8bit", "full-4bit", "rotating"}))
    write_json(out, res)
    figure(rows, args.out_dir / f"accuracy_vs_peak_{args.model}.png",
           f"{args.model}, passkey {args.context} tokens, {int(100 * args.density)} % budget ({budget} rows); "
           "each point: its prompts paired with the full cache's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
