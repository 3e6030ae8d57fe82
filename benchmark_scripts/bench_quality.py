"""Quality benchmarks beyond the evaluation's own grids, one subcommand per question:

* ``quant-passkey``: passkey with quantized kept rows, 20 % at fp / 8-bit / 4-bit paired on the same
  prompts, plus the equal-memory curve (runs ``eval passkey`` with its own stages);
* ``quant-report``: the tables and the equal-memory curve of those cells, each label paired against the
  same method with fp rows (figures/eval/quant/passkey_quant_summary.json and a PNG);
* ``two-models``: every method's passkey accuracy on SmolLM2 and Gemma 3 side by side, with Nexus's
  paired comparison (figures/eval/passkey_two_models.png);
* ``recall``: recallable eviction on the follow-up task, paired against the same method without
  recall (figures/recall/*.json);
* ``choosing``: every cache's passkey accuracy paired with the full cache's beside its KV peak, the
  evidence of docs/choosing.md (figures/choosing/);
* ``recall-cost``: what a recall adds to a follow-up turn's prefill, every tier timed from the same
  state after turn 1, rounds alternating (figures/recall/turn_cost_*.json).

    python benchmark_scripts/bench_quality.py quant-passkey --model bundled --out-dir figures/eval/quant ...
    python benchmark_scripts/bench_quality.py quant-report --run SmolLM2-135M figures/eval/quant/passkey_paired.json ...
    python benchmark_scripts/bench_quality.py two-models [--density 0.2]
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_quality.py recall --prompts 6 --length 1536
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_quality.py recall-cost --length 7680 --density 0.1

``python benchmark_scripts/bench_quality.py SUBCOMMAND --help`` describes each one.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

import _common
from _common import (FIGURES, MIB, AllocationRecorder, add_publish, preload_blas, provenance, route_outputs,
                     run_subcommands, total_nbytes)
from lab import recall_cost
from lab import recall_followup as rf
from lab import report_choosing
from lab import report_quant as rq
from lab.report_paired import _paired_outcomes
from lab.report_passkey import _passkey_index
from lab.stats import fmt_ci, fmt_p, paired, wilson
from veloxquant_mlx.evaluation.eval_model import eos_ids
from veloxquant_mlx.evaluation.labels import method_specs
from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings


# ================================================================================================
# quant: Passkey with quantized kept rows 20 % at fp / 8-bit / 4-bit, paired on the same prompts,
# ================================================================================================
QUANT_DOC = """Passkey with quantized kept rows 20 % at fp / 8-bit / 4-bit, paired on the same prompts,
plus the equal-memory curve (one method at several densities at each row storage).

Two stages on the published 1K grid (grass and text haystacks, depths 0.02..0.98, 3 keys):
  A  20 %: full, nexus, nestedkv, snapkv, each as fp, -8bit and -4bit rows (full-*bit: mlx-lm's own
     QuantizedKVCache, no eviction);
  B  (--curve) the curve method at --curve-densities, fp / -8bit / -4bit.
Every prompt gets one shared prefill pass per row storage (fp, 8-bit, 4-bit); --spread order keeps
a run cut short by --time-budget balanced over depths and haystacks. Resumable: rerun to add prompts.

  python -m veloxquant_mlx --fast-blas eval passkey ...   (the CLI, one stage)
  python benchmark_scripts/bench_quality.py quant-passkey --model bundled --out-dir figures/eval/quant       --out-name passkey_paired.json --curve nestedkv --time-budget 1800
  python benchmark_scripts/bench_quality.py quant-passkey --model bundled --out-dir figures/eval/quant       --out-name passkey_g32.json --methods full nexus nestedkv --bits=-4bit-g32 --dequantized-prefill
  (a suffix that starts with "-" needs the = form)
"""

BITS = ("", "-8bit", "-4bit")
DEPTHS_25 = [round(0.02 + 0.04 * i, 2) for i in range(25)]
DEPTHS_13 = [round(0.02 + 0.08 * i, 2) for i in range(13)]


def plan(methods, curve, curve_densities, depths, bits=BITS):
    base = {"contexts": [1024], "haystacks": ["grass", "text"], "regimes": ["prefill"], "depths": depths,
            "n_keys": 3, "seeds": [0]}
    stages = [{**base, "name": "A: 20%, fp / 8-bit / 4-bit", "densities": [0.2],
               "methods": [m + b for m in methods for b in bits]}]
    if curve:
        stages.append({**base, "name": "B: equal-memory curve", "densities": list(curve_densities),
                       "methods": [curve + b for b in bits]})
    return stages


def quant_main(argv=None) -> int:
    from lab.cli import report_path
    from lab.report import write_report
    from lab.stamp import stamp_store
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.eval import run_harness

    preload_blas(num_threads=None)
    own = argparse.ArgumentParser(prog="bench_quality.py quant-passkey", description=QUANT_DOC,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    own.add_argument("--methods", nargs="+", default=["full", "nexus", "nestedkv", "snapkv"])
    own.add_argument("--bits", nargs="+", default=list(BITS), help="label suffixes: '' -8bit -4bit -4bit-g32 ...")
    own.add_argument("--curve", default=None, help="method for the equal-memory curve (stage B)")
    own.add_argument("--curve-densities", nargs="+", type=float, default=[0.1, 0.35, 0.5])
    own.add_argument("--depths", choices=("25", "13"), default="25", help="the SmolLM2 (25) or Gemma (13) grid")
    own.add_argument("--results-md", default=None, help="the report (default <out-dir>/results.md)")
    own.add_argument("--no-report", action="store_true", help="do not regenerate the report after the run")
    own.add_argument("--dequantized-prefill", action="store_true",
                     help="quantized passes read the stored rows dequantized through float attention (faster on "
                          "the CPU, not what a lone mlx_lm.generate run computes; cells say quant_prefill)")
    a, rest = own.parse_known_args(argv)
    stages = plan(a.methods, a.curve, a.curve_densities, DEPTHS_25 if a.depths == "25" else DEPTHS_13, a.bits)
    labels = list(dict.fromkeys(m for st in stages for m in st["methods"]))
    args = build_parser().parse_args(["eval", "passkey", "--spread", "--max-new-tokens", "8", *rest,
                                      "--methods", *labels])
    args.plan = tuple(stages)  # the passkey harness's settings take the stages as they are
    args.dequantized_prefill = a.dequantized_prefill
    args.stamp = stamp_store  # the figure's provenance after every cell (python -m lab eval's stamp)
    rc = run_harness("passkey", args)
    if not a.no_report:
        write_report(args.out_dir, report_path(args.out_dir, a.results_md))
    return rc


# ================================================================================================
# report: Passkey with quantized kept rows accuracy tables paired against the same method with
# ================================================================================================
REPORT_DOC = """Passkey with quantized kept rows accuracy tables paired against the same method with
fp rows, and the equal-memory curve (accuracy against allocated KV bytes), from the cells that
``bench_quality.py quant-passkey`` wrote.

For each model: every label at 20 % over the prompts that all labels finished, Wilson 95 % intervals,
and the exact McNemar test against the same method with fp rows (``nexus-4bit`` vs ``nexus``,
``full-4bit`` vs ``full``) on those prompts. The curve: the curve method at each density and row
storage plus the full caches, over the prompts every curve point finished; x = mean allocated KV
bytes after the prompt and the 8 new tokens (``kv_report``'s allocated bytes: packed words, scales and
biases as allocated, the methods' side state included). Writes a JSON with provenance and a PNG; prints
markdown.

    python benchmark_scripts/bench_quality.py quant-report         --run SmolLM2-135M figures/eval/quant/passkey_paired.json         --run Gemma-3-270M figures/eval/gemma3/passkey_quant.json         --curve nestedkv --out figures/eval/quant/passkey_quant_summary.json
"""

def report_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_quality.py quant-report", description=REPORT_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", nargs=2, action="append", metavar=("MODEL", "JSON"), required=True)
    ap.add_argument("--curve", default="nestedkv")
    ap.add_argument("--out", default="figures/eval/quant/passkey_quant_summary.json")
    ap.add_argument("--figure", default="figures/eval/quant/equal_memory_curve.png")
    add_publish(ap)
    a = route_outputs(ap.parse_args(argv), "out", "figure")
    Path(a.figure).parent.mkdir(parents=True, exist_ok=True)
    summary, labels = {"models": {}}, set()
    for name, path in a.run:
        outs, nbytes, data = rq.index(path)
        at20 = sorted({m for m, d in outs if d == 0.2},
                      key=lambda m: (rq.fp_label(m) != "full", rq.fp_label(m), rq.storage(m)))
        labels |= {m for m, _ in outs}
        entry = {"source": path, "model": data["meta"].get("model"), "density_0.2": rq.table(outs, 0.2, at20)}
        densities = sorted({d for m, d in outs if rq.fp_label(m) == a.curve})
        if len(densities) > 1:
            entry["curve"] = rq.curve(outs, nbytes, a.curve, ("", "-8bit", "-4bit"),
                                   ("full", "full-8bit", "full-4bit"), densities)
            rq.plot(entry["curve"], name, a.figure)
            entry["figure"] = a.figure
        summary["models"][name] = entry
        t = entry["density_0.2"]
        print(f"\n### {name}: 20 %, {t['n_prompts']} prompts (1K)\n")
        print("| label | rows | accuracy % [Wilson 95 %] (k/n) | vs same method fp: only fp / only quantized, McNemar p |")
        print("|---|---|---|---|")
        for m, r in t["rows"].items():
            v = r.get("vs_fp")
            vs = f"{v['only_fp']} / {v['only_quant']}, p = {fmt_p(v['p'])}" if v else "–"
            if "vs_g64" in r:
                g = r["vs_g64"]
                vs += f"; vs {g['label']}: {g['only_g64']} / {g['only_this']}, p = {fmt_p(g['p'])}"
            print(f"| {m} | {rq.storage(m)} | {fmt_ci(r['correct'], r['n'])} ({r['correct']}/{r['n']}) | {vs} |")
        if "curve" in entry:
            c = entry["curve"]
            print(f"\n{name}: equal-memory curve, {c['n_prompts']} prompts, KVCache = {c['kvcache_bytes'] / 2**20:.2f} MiB\n")
            print("| label | density | allocated KV MiB | x KVCache | accuracy % [Wilson 95 %] |")
            print("|---|---|---|---|---|")
            for p in sorted(c["points"], key=lambda p: p["kv_bytes"]):
                d = "–" if p["density"] is None else f"{100 * p['density']:.0f} %"
                print(f"| {p['label']} | {d} | {p['kv_bytes'] / 2**20:.2f} | {p['kv_vs_kvcache']:.3f} | "
                      f"{fmt_ci(p['correct'], p['n'])} |")
    summary["provenance"] = provenance(sorted(labels))
    summary["provenance"]["note"] = ("fingerprints run fp rows only; -8bit / -4bit labels are these methods "
                                     "with kv_bits (tests/test_quantized.py pins the quantized path)")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    print(f"\nwrote {a.out}")
    return 0


# ================================================================================================
# models: Passkey accuracy of every method on two models side by side, with Wilson 95% intervals, and
# ================================================================================================
MODELS_DOC = """Passkey accuracy of every method on two models side by side, with Wilson 95% intervals, and
Nexus's paired comparison (exact McNemar) against each method on each model.

Reads the cells the evaluation wrote (``python -m veloxquant_mlx eval passkey``): by default
``figures/eval/passkey.json`` (SmolLM2-135M, the bundled model) and ``figures/eval/gemma3/passkey.json``
(Gemma 3 270M). Each model's numbers are over the prompts every plotted method finished on that model,
prefill-only regime (``prompt_eviction="end"``). Writes ``figures/eval/passkey_two_models.png`` and
prints a markdown table.

    python benchmark_scripts/bench_quality.py two-models [--density 0.2] [--out figures/eval/passkey_two_models.png]
"""

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


def models_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_quality.py two-models", description=MODELS_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--out", default="figures/eval/passkey_two_models.png")
    add_publish(ap)
    args = route_outputs(ap.parse_args(argv), "out")
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


# ================================================================================================
# recall: Recallable eviction on the follow-up task, paired against the same method without recall.
# ================================================================================================
RECALL_USAGE = """
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_quality.py recall --prompts 6 --length 1536 \\
        --density 0.2 --methods nexus snapkv --tiers none memory disk

Results are written after every prompt, and a re-run skips the prompts already in the file. Timings:
OpenBLAS preloaded, ratios within one run only.
"""


def recall_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_quality.py recall", description=rf.__doc__ + RECALL_USAGE,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--length", type=int, default=1536)
    p.add_argument("--facts", type=int, default=2, choices=[2, 3, 4], help="facts = turns on one cache")
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--methods", nargs="+", default=["nexus", "snapkv"],
                   help="methods or labels (nexus-4bit: hot rows at 4 bits)")
    p.add_argument("--tiers", nargs="+", default=["none", "memory", "disk"], choices=rf.TIERS,
                   help="cold tiers per method; '-hold': with recall_hold=True ('<method>-recall-disk-hold')")
    p.add_argument("--recall-bits", type=int, default=4)
    p.add_argument("--recall-pages", type=int, default=8)
    p.add_argument("--recall-page", type=int, default=32)
    p.add_argument("--recall-every", type=int, default=None,
                   help="also run each method with recall='memory' and recall_every=N ('<method>-recall-every<N>')")
    p.add_argument("--quantized-baseline", action="store_true",
                   help="also run mlx-lm's QuantizedKVCache(bits=4, group 32) holding everything ('full-4bit')")
    p.add_argument("--out", default=str(FIGURES / "recall" / "followup_smollm2.json"))
    add_publish(p)
    args = route_outputs(p.parse_args(argv), "out")
    specs = dict(zip(args.methods, method_specs(args.methods)))  # an unknown label fails here, before any prefill
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"prompts": []}
    done = {r["index"] for r in data["prompts"]}
    setting = {"task": "followup", "n_facts": args.facts, "length": args.length, "density": args.density,
               "prompt_eviction": "end", "recall_bits": args.recall_bits, "recall_page": args.recall_page,
               "recall_pages": args.recall_pages, "methods": args.methods, "tiers": args.tiers,
               "recall_every": args.recall_every,
               "quantized_baseline": "QuantizedKVCache(bits=4, group_size=32)" if args.quantized_baseline else None,
               "blas": "OpenBLAS preloaded (python -m veloxquant_mlx.platform.blas)"}
    old = data.get("setting", {})
    clash = sorted(k for k in setting.keys() & old.keys() - {"blas"} if setting[k] != old[k])
    if clash:  # resuming would mix two settings' prompts in one file
        raise SystemExit(f"{out} holds a run with another setting ({', '.join(f'{k}={old[k]!r}' for k in clash)}): "
                         "name a new --out, or repeat that run's options to resume it")
    quiet_cache_warnings()
    model, tokenizer, desc = load_eval_model(args.model)
    if old.get("model", desc) != desc:
        raise SystemExit(f"{out} holds a run on another model ({old['model']}): name a new --out")
    setting["model"] = desc
    eos = eos_ids(tokenizer)

    def make_caches(budget):
        return rf.prompt_caches(model, specs, args.tiers, budget, args.recall_bits, args.recall_page,
                                args.recall_pages, args.recall_every, args.quantized_baseline)

    for index in range(args.start, args.start + args.prompts):
        if index in done:
            continue
        data["prompts"].append(rf.run_followup_prompt(model, tokenizer, index, args.length, args.facts,
                                                      args.density, make_caches, eos))
        data["prompts"].sort(key=lambda r: r["index"])
        data["setting"] = setting
        data["summary"] = rf.summarize(data)
        data["provenance"] = rf.stamp_recall_provenance(data.get("provenance"), provenance(["full", *args.methods]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        s = data["summary"]
        print(f"prompt {index}: " + "; ".join(f"{n} {v['turn_correct']}" for n, v in s.items()), flush=True)
    return 0


def recall_cost_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_quality.py recall-cost", description=recall_cost.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bundled")
    p.add_argument("--prompts", type=int, default=1, help="follow-up prompts (indices from --start), each its own state")
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--length", type=int, default=7680)
    p.add_argument("--density", type=float, default=0.1)
    p.add_argument("--method", default="nexus")
    p.add_argument("--tiers", nargs="+", default=["memory", "disk"], choices=["memory", "disk"])
    p.add_argument("--recall-bits", type=int, default=4)
    p.add_argument("--recall-pages", type=int, nargs="+", default=[8],
                   help="pages read back per KV head; several values: one tier each ('memory-p2')")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", default=str(FIGURES / "recall" / "turn_cost_smollm2_8k.json"))
    add_publish(p)
    args = route_outputs(p.parse_args(argv), "out")
    spec = method_specs([args.method])[0]  # an unknown label fails here, before any prefill
    pages = list(dict.fromkeys(args.recall_pages))
    try:
        tiers = recall_cost.cost_tiers(args.tiers, pages, args.recall_bits)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    quiet_cache_warnings()
    model, tokenizer, desc = load_eval_model(args.model)
    device = str(mx.default_device())
    setting = {"model": desc, "method": args.method, "length": args.length, "density": args.density,
               "tiers": list(tiers), "recall_bits": args.recall_bits, "rounds": args.rounds,
               "recall_page": 32, "recall_pages": pages[0] if len(pages) == 1 else pages,
               "task": "followup (2 facts), turn 2's input prefilled",
               "blas": ("OpenBLAS preloaded (python -m veloxquant_mlx.platform.blas)" if "cpu" in device
                        else f"none: {device}")}
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"prompts": []}
    if data.get("setting", setting) != setting:
        raise SystemExit(f"{out} holds a run with another setting: name a new --out, or repeat its options")
    done = {r["index"] for r in data["prompts"]}
    for index in range(args.start, args.start + args.prompts):
        if index in done:
            continue
        states, facts = recall_cost.after_turn_one(model, tokenizer, spec, tiers, args.length, args.density,
                                                   index, eos_ids(tokenizer))
        timed = recall_cost.time_turn_two(model, states, args.rounds)
        del states
        data["prompts"].append({"index": index, **facts, **timed,
                                "summary": recall_cost.ratio_summary(timed["seconds"])})
        data["prompts"].sort(key=lambda r: r["index"])
        data["setting"], data["machine"] = setting, _common.machine()
        data["provenance"] = rf.stamp_recall_provenance(data.get("provenance"), provenance(["full", args.method]))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        print(f"prompt {index}: " + "; ".join(f"{t} {v.get('ratio_median')} {v.get('ratio_ci95')}"
                                              for t, v in data["prompts"][-1]["summary"].items() if t != "none"),
              flush=True)
    return 0


# ================================================================================================
# choosing: the evidence of docs/choosing.md.
# ================================================================================================
CHOOSING_DOC = """The evidence behind docs/choosing.md: every cache's passkey accuracy on the same prompts, paired against
the full cache, beside the KV it holds at its peak (through plain ``generate_step``) and after the prompt.

Reads the passkey result files named on the command line (``eval passkey`` JSONs; a cell's label is its
method, plus ``:stream`` for the ``decode`` regime, i.e. ``prompt_eviction="stream"`` with its prefill
chunk), pairs each label with the full cache on the prompts both ran, and measures each label's KV bytes once on one
prompt of the same length: the largest ``sum(c.nbytes)`` right after any layer's update (the KV part of
the peak) and after generation. Writes ``figures/choosing/summary_<model>.json`` and the figure
``figures/choosing/accuracy_vs_peak_<model>.png`` (accuracy with its Wilson 95 % interval against KV peak bytes)
with ``--publish``, else the same paths under ./veloxquant_bench/; prints the page's table (``lab.report_choosing``).

    python benchmark_scripts/bench_quality.py choosing figures/eval/passkey.json figures/eval/choosing/passkey_end.json
        figures/eval/choosing/passkey_stream.json figures/eval/quant/passkey_paired.json
        --labels full full-8bit full-4bit rotating kvzap kvzap:stream nexus nestedkv kvzip snapkv h2o nexus:recall=disk:stream
"""

CHOOSING_OUT = FIGURES / "choosing"


def choosing_label(cell: dict) -> str:
    return cell["method"] + (":stream" if cell["regime"] == "decode" else "")


def choosing_prompt(cell: dict) -> tuple:
    return cell["haystack"], cell["context"], cell["depth"], cell["key"]


def choosing_table(files, context: int, density: float) -> tuple:
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
            lab = choosing_label(c)
            by_label.setdefault(lab, {})[choosing_prompt(c)] = bool(c["correct"])
            chunk[lab] = step if c["regime"] == "decode" else c.get("prefill_step", 2048)
    full = by_label.get("full", {})
    return {lab: {p: v[p] for p in v if p in full} for lab, v in by_label.items()}, chunk


def choosing_caches(model, label: str, budget: int):
    """The label's caches as the harness builds them (full, full-8bit, rotating, a method or ablation
    label), with prompt_eviction="stream" for a ``:stream`` label."""
    from veloxquant_mlx.evaluation.labels import make_caches, method_specs

    name, stream = (label[:-len(":stream")], True) if label.endswith(":stream") else (label, False)
    return make_caches(model, method_specs([name])[0], budget, prompt_eviction="stream" if stream else "end")


def choosing_kv_bytes(model, prompt, label: str, budget: int, step: int) -> dict:
    import gc

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gc.collect()
    mx.clear_cache()
    caches = choosing_caches(model, label, budget)
    rec = AllocationRecorder(caches)
    for _ in generate_step(mx.array(prompt), model, max_tokens=4, prompt_cache=caches, prefill_step_size=step):
        pass
    rec.close()
    return {"kv_peak_bytes": rec.max_bytes, "kv_after_bytes": total_nbytes(caches)}


def choosing_figure(rows: list, path: Path, title: str) -> None:
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


def choosing_main(argv=None) -> int:
    p = argparse.ArgumentParser(description=CHOOSING_DOC.split("\n\n")[0])
    p.add_argument("files", nargs="+", type=Path)
    p.add_argument("--model", default="bundled")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--out-dir", type=Path, default=CHOOSING_OUT)
    p.add_argument("--labels", nargs="+", default=None, help="only these labels (default: every label found)")
    add_publish(p)
    args = p.parse_args(argv)
    preload_blas()  # re-executes this script once: its note below comes after
    route_outputs(args, "out_dir")
    from veloxquant_mlx.evaluation.passkey import make_passkey_prompt
    from veloxquant_mlx.models import load_model

    table, chunk = choosing_table(args.files, args.context, args.density)
    if args.labels:
        table = {lab: v for lab, v in table.items() if lab in set(args.labels) | {"full"}}
    out = args.out_dir / f"summary_{args.model}.json"
    measured = {}  # KV bytes of a label already measured at this setting (they do not depend on the prompts)
    if "full" not in table:
        raise SystemExit("the files hold no full-cache cells at this context: nothing to pair against")
    model, tokenizer = load_model(args.model)
    prompt, _ = make_passkey_prompt(tokenizer, args.context, 0.5, "12345")
    budget = _common.budget(args.density, len(prompt))
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
               **(measured.get(lab) or choosing_kv_bytes(model, prompt, lab, budget, chunk[lab]))}
        rows.append(row)
        print(f"{lab:>24}: {k}/{n}  KV peak {row['kv_peak_bytes'] / MIB:6.2f} MiB, after {row['kv_after_bytes'] / MIB:6.2f} MiB",
              flush=True)
    res = {"setting": {**setting, "files": [str(f) for f in args.files]}, "rows": rows}
    _common.stamp(res, sorted({r["label"].split(":")[0] for r in rows} - {"full", "full-8bit", "full-4bit", "rotating"}))
    _common.write_json(out, res)
    choosing_figure(rows, args.out_dir / f"accuracy_vs_peak_{args.model}.png",
                    f"{args.model}, passkey {args.context} tokens, {args.density:.0%} budget ({budget} rows); "
                    "each point: its prompts paired with the full cache's")
    print(f"\nwrote {out}\n\n{report_choosing.table(res)}")  # docs/choosing.md's table
    return 0


SUBCOMMANDS = {"quant-passkey": quant_main, "quant-report": report_main, "two-models": models_main,
               "recall": recall_main, "recall-cost": recall_cost_main, "choosing": choosing_main}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
