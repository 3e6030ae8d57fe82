"""Memory through plain ``mlx_lm.generate``, one subcommand per question:

* ``eviction``: what a user of ``mlx_lm.generate`` really holds with each eviction method and with
  mlx-lm's ``KVCache``: allocated KV, active-memory growth, peaks, on the bundled SmolLM2 (``--part
  bundled``: figures/memory/bundled.json) and on a tiny random llama up to 32K tokens (``--part tiny``:
  figures/memory/tiny.json), with their PNGs;
* ``quant``: quantized kept rows: allocated KV of every method with fp / 8-bit / 4-bit rows against
  ``KVCache`` and mlx-lm's ``QuantizedKVCache`` (``--part memory``: figures/memory/quant.json), decode
  speed of fp against 4-bit rows (``--part speed``: figures/eval/quant_speed.json), and the replay /
  table / figure views of those files;
* ``peak``: the KV peak and the process peak during the prompt as it grows (4K-32K) at a fixed prefill
  step, for caches that evict while the prompt streams in against ``KVCache``, ``RotatingKVCache`` and
  ``QuantizedKVCache`` (figures/memory/peak_stream.json).

    python benchmark_scripts/bench_memory.py eviction [--part tiny] [--quick]
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_memory.py quant --part memory

``python benchmark_scripts/bench_memory.py SUBCOMMAND --help`` describes each one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

import _common
from _common import (FIGURES, MIB, AllocationRecorder, add_publish, blas_info, output, preload_blas, provenance, resumed,
                     route_outputs, tiny_llama, run_subcommands, total_nbytes, weights_bytes)


# ================================================================================================
# eviction: Memory benchmark: what a user of plain ``mlx_lm.generate`` really holds.
# ================================================================================================
EVICTION_DOC = """Memory benchmark: what a user of plain ``mlx_lm.generate`` really holds.

Part ``bundled``: the bundled SmolLM2-135M (30 layers, 9 query / 3 KV heads, fp32) through
``mlx_lm.generate.generate_step`` with its default arguments (``prefill_step_size=2048``, greedy),
prose prompts of 2K and 4K tokens, 32 new tokens, budget = 20 % of the prompt, every registry method
(``KVCacheConfig(method=m, budget=...)`` with the default ``prompt_eviction="end"``) and mlx-lm's own
``KVCache``. Per cache, measured around one generation (``gc`` + ``mx.clear_cache()`` +
``mx.reset_peak_memory()`` first):

* ``kv_allocated_bytes``: ``sum(c.nbytes)`` after generation (every array the caches hold);
* ``kv_kept_bytes`` / ``kv_full_bytes``: ``veloxquant_mlx.caches.accounting.kv_report`` (kept rows' K/V; K/V of
  every token seen);
* ``active_growth_bytes``: ``mx.get_active_memory()`` after generation minus before it;
* ``peak_over_baseline_bytes``: ``mx.get_peak_memory()`` minus the active memory before generation
  (the prefill activations are in here), and ``process_peak_bytes`` (absolute; weights included);
* ``kv_allocated_max_bytes``: the largest ``sum(c.nbytes)`` seen right after any layer's
  ``update_and_fetch`` (a recording wrapper on every cache: the KV part of the peak).

Plus ``nexus`` with ``prompt_eviction="stream"`` at 4K, whose process peak is compared with
weights + 0.35x the full KV (weights = sum of the parameters' nbytes), at the default prefill step
and at smaller ones (the prefill activations of one chunk dominate the peak).

Part ``tiny``: a tiny random llama (2 layers, hidden 64, 4 query / 2 KV heads of 16, fp32) with a
fixed budget, prompts from 1K to 32K tokens through ``generate_step`` (8 new tokens): allocated KV
and active-memory growth per method after generation, and for one method both prompt-eviction
policies with their peaks.

    python benchmark_scripts/bench_memory.py eviction              # both parts -> figures/memory/*.json, *.png
    python benchmark_scripts/bench_memory.py eviction --part tiny  # the tiny-model sweep only (~1-2 min)
    python benchmark_scripts/bench_memory.py eviction --quick      # harness check (tiny model everywhere)

OpenBLAS is preloaded (``veloxquant_mlx.platform.blas``, 1 thread) unless ``--no-fast-blas``; the JSON says
which BLAS ran. Memory numbers do not depend on it; it only makes the run shorter.
"""

OUT = FIGURES / "memory"


def eviction_parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_memory.py eviction", description=EVICTION_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("bundled", "tiny", "all"), default="all")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096], help="bundled-model prompt lengths")
    p.add_argument("--density", type=float, default=0.2, help="bundled model: budget / prompt")
    p.add_argument("--max-tokens", type=int, default=32, help="bundled model: new tokens")
    p.add_argument("--methods", nargs="+", default=None, help="registry methods (default: all)")
    p.add_argument("--stream-context", type=int, default=4096, help="context of the nexus stream-peak run")
    p.add_argument("--stream-steps", type=int, nargs="+", default=[2048, 512],
                   help="prefill_step_size values of the nexus stream-peak run (2048 = mlx_lm default)")
    p.add_argument("--stream-first", action="store_true", help="run the nexus stream-peak run first")
    p.add_argument("--no-stream-peak", action="store_true", help="skip the stream-peak runs")
    p.add_argument("--tiny-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192],
                   help="tiny model: prompt lengths for every method and KVCache")
    p.add_argument("--tiny-stream-lengths", type=int, nargs="+", default=[16384, 32768],
                   help="tiny model: further lengths for the policy method under prompt_eviction='stream'")
    p.add_argument("--tiny-end-lengths", type=int, nargs="+", default=[16384, 32768],
                   help="tiny model: further lengths for KVCache and the policy method under 'end' (O(N^2))")
    p.add_argument("--tiny-budget", type=int, default=512)
    p.add_argument("--tiny-max-tokens", type=int, default=8)
    p.add_argument("--tiny-policy-method", default="nexus", help="method run under both prompt-eviction policies")
    p.add_argument("--resume", action="store_true", help="bundled part: keep the finished runs of bundled.json")
    p.add_argument("--markdown", action="store_true", help="print the markdown tables of the JSON files (docs/memory.md)")
    p.add_argument("--figures-only", action="store_true", help="redraw the figures from the JSON files")
    p.add_argument("--no-fast-blas", action="store_true", help="keep MLX's reference BLAS")
    p.add_argument("--quick", action="store_true", help="tiny model and short prompts everywhere (harness check)")
    p.add_argument("--out-dir", default=str(OUT), help="where the JSON files and PNGs are (default figures/memory)")
    add_publish(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# measurement
# ------------------------------------------------------------------------------------------------
def make_cache_list(model, method, budget, prompt_eviction="end"):
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig

    if method == "kvcache":
        return make_prompt_cache(model)
    return KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=budget,
                                                         prompt_eviction=prompt_eviction))


def measure(model, prompt, method, budget, max_tokens, prompt_eviction="end", prefill_step_size=None) -> dict:
    """One generation through plain ``mlx_lm.generate.generate_step`` (its defaults unless
    ``prefill_step_size`` is given) with fresh caches; memory and byte accounting around it."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from veloxquant_mlx.caches.accounting import kv_report

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    caches = make_cache_list(model, method, budget, prompt_eviction)
    rec = AllocationRecorder(caches)
    kw = {} if prefill_step_size is None else {"prefill_step_size": prefill_step_size}
    t0 = time.perf_counter()
    tokens = []
    for tok, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=caches, **kw):
        tokens.append(int(tok))
    wall = time.perf_counter() - t0
    rec.close()
    gc.collect()
    peak = mx.get_peak_memory()
    active = mx.get_active_memory()
    rep = kv_report(caches)
    out = {"method": method, "prompt_eviction": prompt_eviction if method != "kvcache" else None,
           "prompt_tokens": len(prompt), "new_tokens": len(tokens), "budget": budget if method != "kvcache" else None,
           "prefill_step_size": prefill_step_size or 2048,
           "kv_allocated_bytes": total_nbytes(caches), "kv_kept_bytes": rep["kept_bytes"],
           "kv_full_bytes": rep["full_bytes"], "kv_allocated_max_bytes": rec.max_bytes,
           "active_before_bytes": base, "active_growth_bytes": active - base,
           "peak_over_baseline_bytes": peak - base, "process_peak_bytes": peak,
           "wall_s": round(wall, 2), "tokens_head": tokens[:8]}
    if method != "kvcache":
        out["evictions"] = sum(getattr(c, "evictions", 0) for c in caches)
    del caches
    gc.collect()
    return out


# ------------------------------------------------------------------------------------------------
# parts
# ------------------------------------------------------------------------------------------------
def _tiny_model():
    """2 layers, hidden 64, 4 query / 2 KV heads of 16, fp32 (the test suite's tiny llama)."""
    return tiny_llama(layers=2, heads=4, kv_heads=2, head_dim=16, max_position_embeddings=4096)


def bundled_jobs(args, methods):
    """(key, context, method, prompt_eviction, prefill_step_size) in priority order: the first
    context for every method, the stream-peak run, the other contexts, the smaller-step peak runs."""
    first = ["kvcache", "nexus", "nestedkv"]
    order = [m for m in first if m == "kvcache" or m in methods] + [m for m in methods if m not in first]
    jobs = [(args.stream_context, "nexus", "stream", 2048)] if args.stream_first else []
    for k, n in enumerate(args.contexts):
        jobs += [(n, m, "end", None) for m in order]
        if k == 0 and not args.no_stream_peak:
            jobs.append((args.stream_context, "nexus", "stream", 2048))
    for step in ([] if args.no_stream_peak else args.stream_steps):
        if step != 2048:
            jobs += [(args.stream_context, "nexus", "stream", step), (args.stream_context, "nexus", "end", step),
                     (args.stream_context, "kvcache", "end", step)]
    out, seen = [], set()
    for n, m, pe, step in jobs:
        key = f"{n}|{m}|{pe if m != 'kvcache' else '-'}|{step or 2048}"
        if key not in seen:
            seen.add(key)
            out.append((key, n, m, pe, step))
    return out


def derive_bundled(res):
    """Ratios from the measured rows: allocated / KVCache's at the same context and step,
    allocated / kept, and (process peak - weights) / full KV."""
    rows = list(res["runs"].values())
    wbytes = res["weights_bytes"]
    for r in rows:
        base = next((x for x in rows if x["method"] == "kvcache" and x["prompt_tokens"] == r["prompt_tokens"]
                     and x["prefill_step_size"] == r["prefill_step_size"]), None)
        if base:
            r["allocated_vs_kvcache"] = r["kv_allocated_bytes"] / base["kv_allocated_bytes"]
            r["active_growth_vs_kvcache"] = r["active_growth_bytes"] / base["active_growth_bytes"]
        r["allocated_vs_kept"] = r["kv_allocated_bytes"] / r["kv_kept_bytes"] if r["kv_kept_bytes"] else None
        r["peak_minus_weights_vs_full_kv"] = (r["process_peak_bytes"] - wbytes) / r["kv_full_bytes"]
    return res


def run_bundled(args, methods, log, save):
    import numpy as np

    if args.quick:
        model = _tiny_model()
        prompt_of = lambda n: np.random.default_rng(0).integers(0, 128, size=n).tolist()  # noqa: E731
        desc = "tiny random llama (--quick; numbers meaningless)"
    else:
        from veloxquant_mlx.evaluation.speed import _prompt
        from veloxquant_mlx.models import load_model

        model, tokenizer = load_model()
        prompt_of = lambda n: _prompt(tokenizer, n)  # noqa: E731
        desc = "SmolLM2-135M-Instruct (bundled GGUF, float32)"
    res = {"model": desc, "weights_bytes": weights_bytes(model), "density": args.density,
           "max_tokens": args.max_tokens, "runs": {}}
    path = Path(args.out_dir) / "bundled.json"
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old.get("model") == desc and old.get("max_tokens") == args.max_tokens:
            res["runs"] = old.get("runs", {})
    prompts = {}
    for key, n, m, pe, step in bundled_jobs(args, methods):
        if key in res["runs"]:
            continue
        if n not in prompts:
            prompts[n] = prompt_of(n)
        budget = _common.budget(args.density, n)
        r = measure(model, prompts[n], m, budget, args.max_tokens, prompt_eviction=pe, prefill_step_size=step)
        res["runs"][key] = r
        derive_bundled(res)
        save(res)
        log(f"bundled {key}: alloc {r['kv_allocated_bytes'] / MIB:7.2f} MiB  kept {r['kv_kept_bytes'] / MIB:7.2f}  "
            f"active+ {r['active_growth_bytes'] / MIB:7.2f}  peak+ {r['peak_over_baseline_bytes'] / MIB:7.1f}  "
            f"process peak {r['process_peak_bytes'] / MIB:7.1f} = weights + {r['peak_minus_weights_vs_full_kv']:.3f}x "
            f"full KV; KV max {r['kv_allocated_max_bytes'] / MIB:.2f} ({r['wall_s']:.0f} s)")
    return res


def tiny_jobs(args, methods):
    """(key, length, method, prompt_eviction) in priority order. Every method (default policy
    "end") and KVCache at ``--tiny-lengths``; the policy method under "stream" at those and at
    ``--tiny-stream-lengths``; KVCache and the policy method under "end" at ``--tiny-end-lengths``.
    Under "end" every cache attends over the whole held prompt, so those runs cost O(N^2): on a
    shared CPU the long lengths are run for the stream policy (O(N)) first."""
    pm = args.tiny_policy_method
    jobs = []
    for n in args.tiny_lengths:
        jobs += [(n, m, "end") for m in ["kvcache"] + methods] + [(n, pm, "stream")]
    jobs += [(n, pm, "stream") for n in args.tiny_stream_lengths]
    for n in args.tiny_end_lengths:
        jobs += [(n, "kvcache", "end"), (n, pm, "end")]
    out, seen = [], set()
    for n, m, pe in jobs:
        key = f"{n}|{m}|{pe if m != 'kvcache' else '-'}"
        if key not in seen:
            seen.add(key)
            out.append((key, n, m, pe))
    return out


def run_tiny(args, methods, log, save):
    import numpy as np

    model = _tiny_model()
    budget = args.tiny_budget if not args.quick else 256
    res = {"model": "tiny random llama: 2 layers, hidden 64, 4 query / 2 KV heads of 16, fp32 "
                    "(benchmark_scripts/_common.py tiny_llama)", "weights_bytes": weights_bytes(model), "budget": budget,
           "max_tokens": args.tiny_max_tokens, "policy_method": args.tiny_policy_method, "runs": {}}
    path = Path(args.out_dir) / "tiny.json"
    if args.resume and path.exists():
        old = json.loads(path.read_text())
        if old.get("budget") == budget and old.get("max_tokens") == args.tiny_max_tokens:
            res["runs"] = old.get("runs", {})
    for key, n, m, pe in tiny_jobs(args, methods):
        if key in res["runs"]:
            continue
        prompt = np.random.default_rng(n).integers(0, 128, size=n).tolist()
        r = measure(model, prompt, m, budget, args.tiny_max_tokens, prompt_eviction=pe)
        res["runs"][key] = r
        save(res)
        log(f"tiny {key}: alloc {r['kv_allocated_bytes'] / 1024:8.1f} KiB  active+ "
            f"{r['active_growth_bytes'] / 1024:8.1f} KiB  peak+ {r['peak_over_baseline_bytes'] / MIB:7.1f} MiB  "
            f"KV max {r['kv_allocated_max_bytes'] / 1024:8.1f} KiB ({r['wall_s']:.0f} s)")
    return res


# ------------------------------------------------------------------------------------------------
# figures
# ------------------------------------------------------------------------------------------------
def _colors(names):
    import matplotlib.pyplot as plt

    cmap = plt.get_cmap("tab10")
    return {n: ("black" if n == "kvcache" else cmap(i % 10)) for i, n in enumerate(names)}


def figure_bundled(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["runs"].values() if r["prefill_step_size"] == 2048]

    def label(r):
        return r["method"] + (" (stream)" if r["prompt_eviction"] == "stream" else "")

    ctxs = sorted({r["prompt_tokens"] for r in rows})
    names = list(dict.fromkeys(label(r) for r in rows))
    fig, axes = plt.subplots(1, len(ctxs), figsize=(6.5 * len(ctxs), 4.2), squeeze=False)
    w = 0.27
    for ax, n in zip(axes[0], ctxs):
        sub = {label(r): r for r in rows if r["prompt_tokens"] == n}
        if "kvcache" not in sub:
            continue
        names_n = [m for m in names if m in sub]
        xs = range(len(names_n))
        for k, (key, lab) in enumerate((("kv_kept_bytes", "kept rows"), ("kv_allocated_bytes", "allocated (sum nbytes)"),
                                        ("active_growth_bytes", "mx active memory growth"))):
            ax.bar([x + (k - 1) * w for x in xs], [sub[m][key] / MIB for m in names_n], w, label=lab)
        ax.axhline(0.25 * sub["kvcache"]["kv_allocated_bytes"] / MIB, color="red", ls="--", lw=1,
                   label="target: 0.25x KVCache")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(names_n, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("MiB")
        ax.set_title(f"{n}-token prompt + {res['max_tokens']} new, budget {_common.budget(res['density'], n)}")
        ax.legend(fontsize=7)
    fig.suptitle(f"{res['model']}: KV memory after plain mlx_lm generate_step", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure_tiny(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(res["runs"].values())
    end = [r for r in rows if r["prompt_eviction"] in (None, "end")]
    names = list(dict.fromkeys(r["method"] for r in end))
    col = _colors(names)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for m in names:
        sub = sorted((r for r in end if r["method"] == m), key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in sub]
        style = dict(marker="o", color=col[m], label=m, lw=2 if m in ("kvcache", "nexus") else 1)
        axes[0].plot(xs, [r["kv_allocated_bytes"] / MIB for r in sub], **style)
        axes[1].plot(xs, [r["active_growth_bytes"] / MIB for r in sub], **style)
    pm = res["policy_method"]
    sub = sorted((r for r in rows if r["method"] == pm and r["prompt_eviction"] == "stream"), key=lambda r: r["prompt_tokens"])
    for ax, key in ((axes[0], "kv_allocated_bytes"), (axes[1], "active_growth_bytes")):
        ax.plot([r["prompt_tokens"] for r in sub], [r[key] / MIB for r in sub], ls="--", marker="x",
                color=col.get(pm, "tab:blue"), label=f"{pm} (prompt_eviction=stream)")
    for pe, ls in (("end", "-"), ("stream", "--")):
        sub = sorted((r for r in rows if r["method"] == pm and r["prompt_eviction"] == pe), key=lambda r: r["prompt_tokens"])
        xs = [r["prompt_tokens"] for r in sub]
        axes[2].plot(xs, [r["peak_over_baseline_bytes"] / MIB for r in sub], ls=ls, marker="o", color="tab:blue",
                     label=f"{pm} {pe}: mx peak over baseline")
        axes[2].plot(xs, [r["kv_allocated_max_bytes"] / MIB for r in sub], ls=ls, marker="s", color="tab:orange",
                     label=f"{pm} {pe}: max allocated KV")
    sub = sorted((r for r in end if r["method"] == "kvcache"), key=lambda r: r["prompt_tokens"])
    axes[2].plot([r["prompt_tokens"] for r in sub], [r["peak_over_baseline_bytes"] / MIB for r in sub], color="black",
                 marker="o", label="kvcache: mx peak over baseline")
    titles = ("allocated KV after generation (sum nbytes)", "mx.get_active_memory() growth",
              f"peak during generation: {pm} end vs stream")
    for ax, t in zip(axes, titles):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("MiB")
        ax.set_title(t, fontsize=9)
        ax.grid(alpha=0.3, which="both")
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].legend(fontsize=6)
    fig.suptitle(f"{res['model']}; budget {res['budget']} tokens, {res['max_tokens']} new tokens, "
                 "mlx_lm generate_step defaults (prefill_step_size 2048)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------
# markdown
# ------------------------------------------------------------------------------------------------
def _f(x, d=2):
    return "–" if x is None else f"{x:.{d}f}"


def markdown(bundled, tiny) -> str:
    """The tables of docs/memory.md, from the JSON files (numbers never typed by hand)."""
    L = ["Tables printed by `python benchmark_scripts/bench_memory.py eviction --figures-only --markdown` from "
         "`figures/memory/bundled.json` and `figures/memory/tiny.json` (measured by "
         "`python benchmark_scripts/bench_memory.py eviction`; see its docstring for the definitions). "
         "Every run is one fresh generation through `mlx_lm.generate.generate_step` with its defaults "
         "(`prefill_step_size=2048`, greedy) unless a step is named, caches from "
         "`KVCacheBuilder.for_model(model, KVCacheConfig(method=..., budget=...))` (default "
         "`prompt_eviction=\"end\"`) or mlx-lm's `make_prompt_cache` (`kvcache`). Memory numbers do not "
         "depend on machine load; no timing is claimed here.", "",
         "* **allocated** = `sum(c.nbytes)` after generation: every array the caches hold (keys, values, "
         "positions, per-row state, the saved query window), capacity included; mlx-lm's `KVCache` by its own "
         "`nbytes` (capacity in steps of 256 rows).",
         "* **kept** = K/V bytes of the kept rows (`veloxquant_mlx.caches.accounting.kv_report`, `kept_bytes`).",
         "* **active +** = `mx.get_active_memory()` after generation minus before it.",
         "* **peak +** = `mx.get_peak_memory()` during generation minus the active memory before it "
         "(`mx.reset_peak_memory()` first): the prefill activations of one 2048-token chunk are in here.",
         "* **KV max** = the largest `sum(c.nbytes)` right after any layer's `update_and_fetch` during "
         "generation (a recording wrapper): the KV part of the peak.", ""]
    if bundled:
        meta = bundled.get("meta", {})
        runs = list(bundled["runs"].values())
        L += [f"## Bundled model: {bundled['model']}", "",
              f"30 layers, 9 query / 3 KV heads of 64; weights {bundled['weights_bytes'] / MIB:.1f} MiB "
              f"(sum of parameter nbytes). Prose prompt (`veloxquant_mlx.evaluation.speed._prompt`), "
              f"{bundled['max_tokens']} new tokens, budget = {bundled['density']:.0%} of the prompt. "
              f"BLAS: {meta.get('blas', '?')}; load average at the last write {meta.get('load_average_now', '?')} "
              f"on {meta.get('cpu_count', '?')} cores.", ""]
        main_rows = [r for r in runs if r["prefill_step_size"] == 2048 and r["prompt_eviction"] != "stream"]
        misses = []
        for n in sorted({r["prompt_tokens"] for r in main_rows}):
            sub = [r for r in main_rows if r["prompt_tokens"] == n]
            L += [f"### {n}-token prompt (budget {_common.budget(bundled['density'], n)})", "",
                  "| cache | allocated MiB | ×KVCache | kept MiB | allocated ÷ kept | active + MiB | active ×KVCache "
                  "| peak + MiB | KV max MiB | evictions |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
            for r in sub:
                L.append(f"| {r['method']} | {r['kv_allocated_bytes'] / MIB:.2f} | {_f(r.get('allocated_vs_kvcache'), 3)}× | "
                         f"{r['kv_kept_bytes'] / MIB:.2f} | {_f(r.get('allocated_vs_kept'))}× | "
                         f"{r['active_growth_bytes'] / MIB:.2f} | {_f(r.get('active_growth_vs_kvcache'), 3)}× | "
                         f"{r['peak_over_baseline_bytes'] / MIB:.0f} | {r['kv_allocated_max_bytes'] / MIB:.1f} | "
                         f"{r.get('evictions', '–')} |")
                if r["method"] != "kvcache" and r.get("allocated_vs_kvcache") is not None\
                        and r["allocated_vs_kvcache"] > 0.25:
                    misses.append(f"{r['method']} at {n}: {r['allocated_vs_kvcache']:.3f}×")
            L.append("")
        done = sorted({(r["prompt_tokens"], r["method"]) for r in main_rows})
        nk = [r for r in main_rows if r["method"] == "nestedkv"]
        L += ["**Targets.**", "",
              f"* Allocated KV ≤ 0.25× `KVCache` for every method: "
              + ("**met** for every measured (context, method)" if not misses else "**missed** for " + ", ".join(misses))
              + f" ({len([d for d in done if d[1] != 'kvcache'])} method runs measured).",
              "* NestedKV allocated ≤ 1.25× its kept rows: " +
              ("; ".join(f"{r['prompt_tokens']}: {r['allocated_vs_kept']:.2f}× "
                         f"(**{'met' if r['allocated_vs_kept'] <= 1.25 else 'missed'}**)" for r in nk) or "not measured")
              + "."]
        st = [r for r in runs if r["prompt_eviction"] == "stream" or r["prefill_step_size"] != 2048]
        full_rows = [r for r in runs if r["prompt_tokens"] == (st[0]["prompt_tokens"] if st else 0)
                     and r["prefill_step_size"] == 2048 and r["method"] in ("kvcache", "nexus")
                     and r["prompt_eviction"] != "stream"]
        if st:
            n = st[0]["prompt_tokens"]
            L += ["", f"### Peak process memory during a {n}-token prompt", "",
                  f"`process peak` = `mx.get_peak_memory()` (absolute: weights "
                  f"{bundled['weights_bytes'] / MIB:.1f} MiB and everything else the process holds). "
                  f"Target: nexus with `prompt_eviction=\"stream\"` ≤ weights + 0.35× the full KV "
                  f"(full KV = K/V of every token seen).", "",
                  "| cache | prompt_eviction | prefill_step_size | process peak MiB | (peak − weights) ÷ full KV "
                  "| KV max MiB | full KV MiB | allocated after MiB |",
                  "|---|---|---|---|---|---|---|---|"]
            for r in sorted(st + full_rows, key=lambda r: (-r["prefill_step_size"], r["method"], str(r["prompt_eviction"]))):
                L.append(f"| {r['method']} | {r['prompt_eviction'] or '–'} | {r['prefill_step_size']} | "
                         f"{r['process_peak_bytes'] / MIB:.1f} | {r['peak_minus_weights_vs_full_kv']:.3f}× | "
                         f"{r['kv_allocated_max_bytes'] / MIB:.1f} | {r['kv_full_bytes'] / MIB:.1f} | "
                         f"{r['kv_allocated_bytes'] / MIB:.2f} |")
            s0 = next((r for r in st if r["method"] == "nexus" and r["prompt_eviction"] == "stream"
                       and r["prefill_step_size"] == 2048), None)
            if s0:
                v = s0["peak_minus_weights_vs_full_kv"]
                L += ["", f"* nexus, stream, mlx-lm's default step 2048: process peak = weights + {v:.3f}× full KV: "
                          f"**{'met' if v <= 0.35 else 'missed'}**; its KV part alone (KV max) is "
                          f"{s0['kv_allocated_max_bytes'] / s0['kv_full_bytes']:.3f}× the full KV."]
            for r in st:
                if r["method"] == "nexus" and r["prompt_eviction"] == "stream" and r["prefill_step_size"] != 2048:
                    v = r["peak_minus_weights_vs_full_kv"]
                    L.append(f"* nexus, stream, step {r['prefill_step_size']}: weights + {v:.3f}× full KV "
                             f"(**{'within' if v <= 0.35 else 'above'}** 0.35×).")
        L += ["", "![bundled](../figures/memory/memory_bundled.png)", ""]
    if tiny:
        runs = list(tiny["runs"].values())
        meta = tiny.get("meta", {})
        L += [f"## Memory vs prompt length: {tiny['model']}", "",
              f"Fixed budget {tiny['budget']} tokens, {tiny['max_tokens']} new tokens, random prompts, "
              f"`generate_step` defaults. BLAS: {meta.get('blas', '?')}.", ""]
        end = [r for r in runs if r["prompt_eviction"] != "stream"]
        lens = sorted({r["prompt_tokens"] for r in runs})
        names = list(dict.fromkeys(r["method"] for r in end))
        for key, title, unit, div in (("kv_allocated_bytes", "Allocated KV after generation", "KiB", 1024),
                                      ("active_growth_bytes", "`mx.get_active_memory()` growth", "KiB", 1024)):
            L += [f"**{title} ({unit})**", "", "| cache | " + " | ".join(str(n) for n in lens) + " |",
                  "|---|" + "---|" * len(lens)]
            for m in names:
                by = {r["prompt_tokens"]: r for r in end if r["method"] == m}
                L.append(f"| {m} | " + " | ".join(f"{by[n][key] / div:.0f}" if n in by else "–" for n in lens) + " |")
            L.append("")
        pm = tiny["policy_method"]
        L += [f"**{pm}: `prompt_eviction` end vs stream, and KVCache (MiB)**", "",
              "| run | " + " | ".join(str(n) for n in lens) + " |", "|---|" + "---|" * len(lens)]
        for m, pe in ((pm, "end"), (pm, "stream"), ("kvcache", None)):
            for key, lab in (("peak_over_baseline_bytes", "peak +"), ("kv_allocated_max_bytes", "KV max"),
                             ("kv_allocated_bytes", "allocated after")):
                by = {r["prompt_tokens"]: r for r in runs if r["method"] == m and (r["prompt_eviction"] or "end") == (pe or "end")}
                L.append(f"| {m} {pe or ''} {lab} | " +
                         " | ".join(f"{by[n][key] / MIB:.2f}" if n in by else "–" for n in lens) + " |")
        L += ["", "![tiny](../figures/memory/memory_tiny.png)", ""]
    return "\n".join(L) + "\n"


def eviction_main(argv=None):
    args = eviction_parse_args(argv)
    preload_blas(num_threads=None, skip=args.no_fast_blas)
    import mlx.core as mx
    import mlx_lm

    import veloxquant_mlx
    from veloxquant_mlx.evaluation.results import quiet_cache_warnings

    quiet_cache_warnings()
    methods = args.methods or list(veloxquant_mlx.methods())
    src = Path(args.out_dir)  # --figures-only and --markdown read the files here
    route_outputs(args, "out_dir")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    read = src if args.figures_only else out
    t_start = time.perf_counter()

    def log(msg):
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    meta = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "quick": args.quick,
            "load_average_at_start": os.getloadavg(), "command": " ".join(sys.argv), **blas_info()}
    parts = ("bundled", "tiny") if args.part == "all" else (args.part,)
    figure = {"bundled": figure_bundled, "tiny": figure_tiny}
    for part in parts:
        path = out / f"{part}.json"
        if not args.figures_only:
            t0 = time.perf_counter()

            extends = args.resume and path.exists()  # a resumed file keeps runs of the code that made them
            old = json.loads(path.read_text()).get("provenance") if extends else None

            def save(res, _t0=t0, _path=path, _old=old, _extends=extends):
                res["meta"] = {**meta, "wall_s": round(time.perf_counter() - _t0, 1),
                               "load_average_now": os.getloadavg()}
                new = provenance(["full", *methods, *(() if args.no_stream_peak else ("nexus:stream",))])
                res["provenance"] = resumed(_old, new) if _extends else new
                tmp = _path.with_suffix(".tmp")
                tmp.write_text(json.dumps(res, indent=1) + "\n")
                os.replace(tmp, _path)

            res = (run_bundled if part == "bundled" else run_tiny)(args, methods, log, save)
            save(res)
        if (read / path.name).exists():
            figure[part](json.loads((read / path.name).read_text()), out / f"memory_{part}.png")
            log(f"wrote {out / f'memory_{part}.png'} from {read / path.name}; BLAS: {meta['blas']}")
    if args.markdown:
        data = {p: json.loads((read / f"{p}.json").read_text()) if (read / f"{p}.json").exists() else None
                for p in ("bundled", "tiny")}
        print(markdown(data["bundled"], data["tiny"]))
    return 0


# ================================================================================================
# quant: Quantized kept rows: allocated KV through plain ``mlx_lm.generate`` and decode speed.
# ================================================================================================
QUANT_DOC = """Quantized kept rows: allocated KV through plain ``mlx_lm.generate`` and decode speed.

Part ``memory``: the bundled SmolLM2-135M (30 layers, 3 KV heads of 64, float32) through
``mlx_lm.generate.generate_step`` with its defaults (prefill_step_size 2048, greedy), a prose prompt of
2K or 4K tokens, 16 new tokens, budget = 20 % of the prompt, ``prompt_eviction="end"``. Per run:
``kv_allocated_bytes`` = sum of ``c.nbytes`` after generation (packed words + scales + biases for
quantized rows, positions, per-row state, query window: everything held), the kept rows' bytes and the
K/V of every token in fp32 (``veloxquant_mlx.caches.accounting.kv_report``; ``allocated_vs_full`` is the
fraction ``generate`` prints), and ``mx.get_peak_memory()`` over the run (``process_peak_bytes``; minus the
weights: ``peak_over_weights_bytes``). Caches from ``KVCacheBuilder.for_model(model, config,
tokenizer=tokenizer)``, as the README's quick start makes them (KVzip's reconstruction pass reads its repeat
prompt through the tokenizer). References: mlx-lm's ``KVCache`` and its ``QuantizedKVCache`` (8 / 4 bits, no
eviction). Labels: ``<method>[-8bit|-4bit]``, ``nestedkv-nocap`` (the spec's per-head bound,
``max_head_factor=None``), ``kvcache``, ``kvcache-4bit``.

Part ``speed``: decode tokens/s of a method with fp rows against the same method with 4-bit rows at
the same budget (``stream_generate``'s generation_tps), prompt 1K tokens, 20 %, 64 new tokens,
rounds alternating the order (fp first, then 4-bit first, ...). Only ratios measured side by side
are meant to be quoted (a shared CPU).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_memory.py quant --part memory   # OpenBLAS preloaded
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_memory.py quant --part speed

Results: figures/memory/quant.json, figures/eval/quant_speed.json with ``--publish``, else the same paths under
./veloxquant_bench/ (resumable: finished runs are kept),
each with the project's provenance (commit, command, date, behaviour fingerprint of every label in
the file; stale when a run extends rows of other code) and each run's machine and BLAS under
``runs_provenance``.
"""

def run_info() -> dict:
    try:
        blas = blas_info()
    except Exception as e:  # reported, never fatal
        blas = {"error": str(e)}
    return {"commit": _common.commit(), "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.platform(),
            "processor": platform.processor(), "blas": blas}


def stamp(res: dict, labels):
    """The figure's provenance over ``labels`` (every label it holds) plus this run's machine record."""
    new = provenance(sorted({parse_label(lb)[0] for lb in labels}))
    old = res.get("provenance")
    res["provenance"] = new if old is None else resumed(old if isinstance(old, dict) else None, new)
    res.setdefault("runs_provenance", []).append(run_info())


def parse_label(label: str):
    """label -> (method or 'kvcache', kwargs for KVCacheConfig)."""
    extra = {}
    for suffix, kw in (("-4bit", {"kv_bits": 4, "kv_group_size": 64}), ("-8bit", {"kv_bits": 8}), ("-nocap", {"max_head_factor": None})):
        if label.endswith(suffix):
            label, extra = label[:-len(suffix)], {**kw, **extra}
    return label, extra


def make_caches(model, label: str, budget: int, tokenizer=None):
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.caches.quant import model_caches

    method, extra = parse_label(label)
    if method == "kvcache":
        return model_caches(model, extra.get("kv_bits"), extra.get("kv_group_size", 64))
    return KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=budget, **extra), tokenizer=tokenizer)


def measure_memory(model, prompt, label, budget, max_tokens, tokenizer=None) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from veloxquant_mlx.caches.accounting import kv_report

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    caches = make_caches(model, label, budget, tokenizer)
    t0 = time.perf_counter()
    toks = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=caches)]
    wall = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    rep = kv_report(caches)
    out = {"label": label, "prompt_tokens": len(prompt), "budget": budget, "new_tokens": len(toks),
           "kv_allocated_bytes": rep["allocated_bytes"], "kv_kept_bytes": rep["kept_bytes"],
           "kv_full_bytes": rep["full_bytes"], "allocated_vs_full": rep["fraction"],
           "process_peak_bytes": peak, "peak_over_weights_bytes": peak - weights_bytes(model),
           "wall_s": round(wall, 1), "tokens_head": toks[:8]}
    if hasattr(caches[0], "tokens_kept"):
        out["tokens_kept_mean"] = sum(c.tokens_kept for c in caches) / len(caches)
        out["evictions"] = sum(c.evictions for c in caches)
    del caches
    gc.collect()
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def save(path: Path, res: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)


def derive(res: dict):
    """allocated / KVCache's at the same context, and allocated / the same method's fp rows."""
    runs = res["runs"]
    for key, r in runs.items():
        n = r["prompt_tokens"]
        base = runs.get(f"{n}|kvcache")
        if base:
            r["allocated_vs_kvcache"] = r["kv_allocated_bytes"] / base["kv_allocated_bytes"]
        fp = runs.get(f"{n}|{parse_label(r['label'])[0]}")
        if fp and fp is not r:
            r["allocated_vs_fp_rows"] = r["kv_allocated_bytes"] / fp["kv_allocated_bytes"]
        r["allocated_vs_kept"] = r["kv_allocated_bytes"] / r["kv_kept_bytes"] if r["kv_kept_bytes"] else None


def run_memory(args):
    from veloxquant_mlx.evaluation.speed import _prompt
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    path = Path(args.out_memory)
    res = load(path)
    res.update({"what": "allocated KV through plain mlx_lm.generate (generate_step defaults), 20 % budget, "
                        "prompt_eviction='end', caches from KVCacheBuilder.for_model(model, config, tokenizer=tokenizer)",
                "model": "SmolLM2-135M-Instruct (bundled GGUF, float32)",
                "density": args.density, "max_tokens": args.max_tokens})
    stamp(res, [k.split("|")[1] for k in res["runs"]] + args.labels)
    for n in args.contexts:
        prompt = _prompt(tokenizer, n)
        budget = _common.budget(args.density, n)
        for label in args.labels:
            key = f"{n}|{label}"
            if key in res["runs"]:
                continue
            r = measure_memory(model, prompt, label, budget, args.max_tokens, tokenizer)
            r["commit"] = res["runs_provenance"][-1]["commit"]
            res["runs"][key] = r
            derive(res)
            save(path, res)
            print(f"{key}: allocated {r['kv_allocated_bytes'] / MIB:8.2f} MiB  vs KVCache "
                  f"{r.get('allocated_vs_kvcache', float('nan')):.3f}  vs fp rows "
                  f"{r.get('allocated_vs_fp_rows', float('nan')):.3f}  ({r['wall_s']} s)", flush=True)


def run_speed(args):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from veloxquant_mlx.evaluation.speed import _prompt
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    path = Path(args.out_speed)
    res = load(path)
    res.update({"what": "decode tokens/s, fp rows vs 4-bit rows at the same budget (stream_generate "
                        "generation_tps), alternating order per round; quote ratios only",
                "model": "SmolLM2-135M-Instruct (bundled GGUF, float32)", "context": args.speed_context,
                "density": args.density, "decode_tokens": args.decode_tokens})
    methods = [k.split("|")[0] for k in res["runs"]] + args.speed_methods
    stamp(res, methods + [m + "-4bit" for m in methods])
    prompt = _prompt(tokenizer, args.speed_context)
    budget = _common.budget(args.density, args.speed_context)
    for method in args.speed_methods:
        pair = [method, method + "-4bit"]
        for rnd in range(args.rounds):
            key = f"{method}|round{rnd}"
            if key in res["runs"]:
                continue
            row = {}
            for label in (pair if rnd % 2 == 0 else pair[::-1]):
                caches = make_caches(model, label, budget)
                last = None
                for last in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=args.decode_tokens,
                                            prompt_cache=caches):
                    pass
                row[label] = {"generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps,
                              "tokens": last.generation_tokens}
                del caches
                gc.collect()
            row["decode_ratio_4bit_over_fp"] = row[pair[1]]["generation_tps"] / row[pair[0]]["generation_tps"]
            row["prefill_ratio_4bit_over_fp"] = row[pair[1]]["prompt_tps"] / row[pair[0]]["prompt_tps"]
            row["order"] = pair if rnd % 2 == 0 else pair[::-1]
            res["runs"][key] = row
            save(path, res)
            print(f"{key}: decode 4-bit/fp {row['decode_ratio_4bit_over_fp']:.3f}  prefill 4-bit/fp "
                  f"{row['prefill_ratio_4bit_over_fp']:.3f}", flush=True)


def replay_bytes(label: str, n_prompt: int, budget: int, decode_steps: int, shapes: dict, seed: int = 0) -> dict:
    """The cache calls plain mlx_lm.generate makes (prompt[:-1] in chunks of 2048, the last prompt
    token alone, then one token per decode step; queries through the tap after each fetch) on random
    K/V / queries of the model's shapes, without the model. For uniform storage the allocated bytes
    depend on shapes only, so they equal a real run's (checked against real runs in the JSON); ragged
    storage (NestedKV, Ada) depends on the key values and needs the real model."""
    import mlx.core as mx

    from veloxquant_mlx import EvictionCache, KVCacheConfig

    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from veloxquant_mlx.caches.accounting import kv_report

    method, extra = parse_label(label)
    L, H, Hq, D = shapes["layers"], shapes["kv_heads"], shapes["q_heads"], shapes["head_dim"]
    caches = []
    for i in range(L):
        if method == "kvcache":
            c = QuantizedKVCache(group_size=64, bits=extra["kv_bits"]) if "kv_bits" in extra else KVCache()
        else:
            config = KVCacheConfig(method=method, budget=budget, **extra)
            c = EvictionCache(config, layer_idx=i, n_layers=L)
            c.tap_active = True
        caches.append(c)
    steps, left = [], n_prompt - 1
    while left > 0:
        steps.append(min(2048, left))
        left -= steps[-1]
    steps += [1] * (1 + decode_steps)
    key = mx.random.key(seed)
    for S in steps:
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, H, S, D), key=k1)
        q = mx.random.normal((1, Hq, S, D), key=k2)
        for c in caches:
            c.update_and_fetch(k, k)
            if hasattr(c, "observe_queries"):
                c.observe_queries(q, D ** -0.5)
        mx.eval([c.state for c in caches])
    rep = kv_report(caches)
    return {"label": label, "prompt_tokens": n_prompt, "budget": budget, "decode_steps": decode_steps,
            "kv_allocated_bytes": rep["allocated_bytes"], "kv_kept_bytes": rep["kept_bytes"],
            "kv_full_bytes": rep["full_bytes"], "offset": caches[0].offset,
            "source": "replay (random K/V of the model's shapes through the calls generate makes)"}


def runs_file(args) -> Path:
    """The real runs: --out-memory where this run writes, when a file is there, else --out-memory as given."""
    return Path(args.out_memory) if Path(args.out_memory).exists() else args.src_memory


def run_replay(args):
    real_runs = load(runs_file(args))["runs"]  # the real generate runs (written by --part memory)
    path = Path(args.out_memory).with_name("quant_replay.json")
    res = load(path)
    stamp(res, [k.split("|")[1] for k in res.get("replay", {})] + args.labels)
    shapes = {"layers": 30, "kv_heads": 3, "q_heads": 9, "head_dim": 64}  # SmolLM2-135M
    res["what"] = replay_bytes.__doc__.split("\n\n")[0].replace("\n", " ")
    res.setdefault("replay", {})
    for n in args.contexts:
        budget = _common.budget(args.density, n)
        for label in args.labels:
            key = f"{n}|{label}"
            r = replay_bytes(label, n, budget, args.max_tokens, shapes)
            real = real_runs.get(key)
            if real:
                r["equals_real_run"] = r["kv_allocated_bytes"] == real["kv_allocated_bytes"]
            base = res["replay"].get(f"{n}|kvcache")
            if base:
                r["allocated_vs_kvcache"] = r["kv_allocated_bytes"] / base["kv_allocated_bytes"]
            res["replay"][key] = r
            save(path, res)
            print(f"replay {key}: {r['kv_allocated_bytes'] / MIB:.2f} MiB vs KVCache "
                  f"{r.get('allocated_vs_kvcache', float('nan')):.4f} real-equal {r.get('equals_real_run')}", flush=True)


def table(args):
    """Markdown table of allocated KV / KVCache (real generate runs where measured, else the replay)."""
    real = load(runs_file(args))["runs"]
    replay = load(runs_file(args).with_name("quant_replay.json")).get("replay", {})
    lines = []
    for n in args.contexts:
        base = (real.get(f"{n}|kvcache") or replay.get(f"{n}|kvcache") or {}).get("kv_allocated_bytes")
        if not base:
            continue
        lines += [f"\n{n}-token prompt, budget {_common.budget(args.density, n)} (20 %): allocated KV after "
                  f"generation / mlx-lm `KVCache` ({base / MIB:.2f} MiB); `r` = real `generate_step` run, "
                  "`p` = replay\n", "| cache | fp32 rows | 8-bit | 4-bit | 4-bit / fp rows |", "|---|---|---|---|---|"]
        for m in ("kvcache", "nexus", "nestedkv", "nestedkv-nocap", "h2o", "snapkv", "pyramidkv", "streaming",
                  "morphkv", "random"):
            cells, vals = [], {}
            for suffix in ("", "-8bit", "-4bit"):
                key = f"{n}|{m}{suffix}"
                r, src = (real[key], "r") if key in real else (replay.get(key), "p")
                if r is None:
                    cells.append("–")
                    continue
                vals[suffix] = r["kv_allocated_bytes"]
                cells.append(f"{r['kv_allocated_bytes'] / base:.3f} ({src})")
            ratio = f"{vals['-4bit'] / vals['']:.3f}" if "" in vals and "-4bit" in vals else "–"
            if any(c != "–" for c in cells):
                lines.append(f"| {m} | " + " | ".join(cells) + f" | {ratio} |")
    print("\n".join(lines))


def summary(args):
    """The README's row and docs/memory.md's table (lab.report_memory) of a one-context --out-memory, with
    kvzip's peak at other lengths from kvzip_peak.json beside it when there is one."""
    from lab import report_memory

    data = load(runs_file(args))
    side = runs_file(args).with_name("kvzip_peak.json")
    more = load(side) if side.exists() else None
    print(report_memory.allocated_table(data), "", report_memory.kvzip_peak(data, more), "",
          report_memory.readme_row(data, more), sep="\n")


def figure(args):
    """Allocated KV / KVCache per method for fp, 8-bit and 4-bit rows, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = load(runs_file(args))
    replay = load(runs_file(args).with_name("quant_replay.json")).get("replay", {})
    runs = {**replay, **res["runs"]}  # real runs where measured, else the replay (hatched)
    ctxs = sorted({r["prompt_tokens"] for r in runs.values()})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(7 * len(ctxs), 4.2), squeeze=False)
    for ax, n in zip(axes[0], ctxs):
        names = [m for m in ("kvcache", "nexus", "nestedkv", "nestedkv-nocap", "h2o", "snapkv", "pyramidkv",
                             "streaming", "morphkv", "random") if f"{n}|{m}" in runs or f"{n}|{m}-4bit" in runs]
        if f"{n}|kvcache" not in runs:
            continue
        for j, (suffix, color) in enumerate((("", "tab:gray"), ("-8bit", "tab:blue"), ("-4bit", "tab:green"))):
            base = runs[f"{n}|kvcache"]["kv_allocated_bytes"]
            for i, m in enumerate(names):
                r = runs.get(f"{n}|{m}{suffix}")
                if r:
                    ax.bar(i + (j - 1) * 0.27, r["kv_allocated_bytes"] / base, 0.27, color=color,
                           hatch="//" if "source" in r else None,
                           label={"": "fp32 rows", "-8bit": "8-bit", "-4bit": "4-bit"}[suffix] if i == 0 else None)
        ax.set_xlabel("hatched: replay of generate's cache calls (uniform storage: bytes equal a real run)")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.axhline(0.06, color="k", lw=0.6, ls="--")
        ax.set_title(f"{n}-token prompt, budget 20 %: allocated KV / mlx-lm KVCache")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out_memory).with_name("quant_memory.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    print(out)


def quant_main(argv=None):
    p = argparse.ArgumentParser(prog="bench_memory.py quant", description=QUANT_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("memory", "speed", "figure", "replay", "table", "summary"), required=True,
                   help="summary: print the README's row and docs/memory.md's table of --out-memory (one context; "
                        "kvzip's peak at other lengths from kvzip_peak.json beside it)")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--labels", nargs="+", default=[
        "kvcache", "nexus-4bit", "nestedkv-4bit", "nexus", "nestedkv", "nestedkv-nocap", "kvcache-4bit",
        "nexus-8bit", "nestedkv-8bit", "h2o-4bit", "snapkv-4bit", "pyramidkv-4bit", "streaming-4bit",
        "morphkv-4bit", "random-4bit", "h2o", "snapkv", "pyramidkv", "streaming", "morphkv", "random",
        "kvcache-8bit", "h2o-8bit", "snapkv-8bit", "pyramidkv-8bit", "streaming-8bit", "morphkv-8bit",
        "random-8bit"])
    p.add_argument("--out-memory", default=str(FIGURES / "memory" / "quant.json"))
    p.add_argument("--speed-context", type=int, default=1024)
    p.add_argument("--speed-methods", nargs="+", default=["nexus", "nestedkv"])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-speed", default=str(FIGURES / "eval" / "quant_speed.json"))
    add_publish(p)
    args = p.parse_args(argv)
    args.src_memory = Path(args.out_memory)  # table, figure and replay read the real runs here (or this run's copy)
    if args.part in ("memory", "replay", "figure"):
        route_outputs(args, "out_memory")
    elif args.part == "speed":
        route_outputs(args, "out_speed")
    {"memory": run_memory, "speed": run_speed, "figure": figure, "replay": run_replay, "table": table,
     "summary": summary}[args.part](args)
    return 0


# ================================================================================================
# peak: the KV peak during the prompt as it grows.
# ================================================================================================
PEAK_DOC = """The peak during the prompt: what a long prompt holds at its largest, through plain ``mlx_lm.generate``.

For each cache and prompt length, one ``generate_step`` with mlx-lm's own loop at a fixed
``prefill_step_size`` (fresh caches, ``gc`` + ``mx.clear_cache()`` + ``mx.reset_peak_memory()`` first):

* ``kv_allocated_max_bytes``: the largest ``sum(c.nbytes)`` right after any layer's ``update_and_fetch``
  (bench_memory's recorder): the KV part of the peak, before an eviction that follows the step;
* ``peak_over_weights_bytes``: ``mx.get_peak_memory()`` minus the weights' bytes (attention's score
  scratch for one chunk and the chunk's logits are in here, so the step is named with every number);
* ``bound_bytes`` for an eviction cache: (budget + slack + one chunk) rows of K/V per head and layer
  (uniform heads; Ada-KV's ragged heads pad each layer's buffer to its widest head, up to
  ``max_head_factor`` x its share, which is headroom over this line).

Caches: ``kvzap`` (and any registry method) with ``prompt_eviction="stream"``, mlx-lm's ``KVCache``,
``RotatingKVCache(max_size=budget)`` (``--max-kv-size``) and ``QuantizedKVCache`` (``--kv-bits 8`` / ``4``).
The full and quantized caches grow with the prompt: they run only up to ``--full-max`` tokens. Writes
figures/memory/peak_stream.json (``--out``) with ``--publish``, else the same path under ./veloxquant_bench/.

    python benchmark_scripts/bench_memory.py peak --lengths 4096 8192 16384 32768 --budget 1024 --step 256
    python benchmark_scripts/bench_memory.py peak --lengths 2048 --budget 410 --step 2048 256 --methods kvzap kvcache
"""

PEAK_OUT = FIGURES / "memory" / "peak_stream.json"


def peak_parse_args(argv=None):
    p = argparse.ArgumentParser(description=PEAK_DOC.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--budget", type=int, default=1024, help="rows per KV head (and RotatingKVCache's max_size)")
    p.add_argument("--step", type=int, nargs="+", default=[256],
                   help="prefill_step_size (several: each cache at each step; mlx-lm's default is 2048)")
    p.add_argument("--methods", nargs="+",
                   default=["kvzap", "kvzap:allocation=uniform", "kvcache", "rotating", "kvcache-8bit", "kvcache-4bit"],
                   help="method specs (run with prompt_eviction=stream), kvcache[-8bit|-4bit], rotating")
    p.add_argument("--full-max", type=int, default=8192, help="longest prompt for caches that hold it whole")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=PEAK_OUT)
    add_publish(p)
    return p.parse_args(argv)


def peak_caches(model, label: str, budget: int):
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.caches.quant import model_caches
    from veloxquant_mlx.evaluation.labels import rotating_caches

    if label == "rotating":  # what --max-kv-size gives
        return rotating_caches(model, budget)
    if label.startswith("kvcache"):
        bits = {"kvcache": None, "kvcache-8bit": 8, "kvcache-4bit": 4}[label]
        return model_caches(model, bits)
    return KVCacheBuilder.for_model(model, KVCacheConfig.parse(label, budget=budget, prompt_eviction="stream"))


def peak_measure(model, prompt, label, budget, step, new_tokens) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    caches = peak_caches(model, label, budget)
    rec = AllocationRecorder(caches)
    t0 = time.perf_counter()
    toks = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=new_tokens, prompt_cache=caches,
                                              prefill_step_size=step)]
    wall = time.perf_counter() - t0
    rec.close()
    peak = mx.get_peak_memory()
    out = {"label": label, "prompt_tokens": len(prompt), "prefill_step_size": step, "new_tokens": len(toks),
           "kv_allocated_max_bytes": rec.max_bytes, "kv_allocated_after_bytes": total_nbytes(caches),
           "peak_over_weights_bytes": peak - weights_bytes(model), "process_peak_bytes": peak,
           "wall_s": round(wall, 1)}
    first = caches[0]
    if hasattr(first, "slack"):
        n_heads = sum(c.keys.shape[1] for c in caches)  # KV heads over every layer
        row = first.keys.shape[-1] * first.keys.dtype.size * 2  # one K and one V row of one head
        out["bound_bytes"] = n_heads * row * (budget + first.slack + step)
        out["evictions"] = sum(c.evictions for c in caches)
    del caches
    gc.collect()
    return out


def peak_prompt(tokenizer, n: int) -> list:
    from veloxquant_mlx.evaluation.tasks.filler import long_filler

    ids = tokenizer.encode(" ".join(long_filler(seed=0)))  # prose; the content does not change the bytes
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def peak_main(argv=None) -> int:
    args = peak_parse_args(argv)
    preload_blas()  # re-executes this script once: its note below comes after
    route_outputs(args, "out")
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(args.model)
    steps = args.step[0] if len(args.step) == 1 else list(args.step)
    res = {"setting": {"model": args.model, "budget": args.budget, "prefill_step_size": steps,
                       "new_tokens": args.new_tokens, "weights_bytes": weights_bytes(model)}, "rows": []}
    if args.out.exists():
        import json

        old = json.loads(args.out.read_text())
        if old.get("setting") == res["setting"]:
            res = old
    done = {(r["label"], r["prompt_tokens"], r["prefill_step_size"]) for r in res["rows"]}
    for n in args.lengths:
        prompt = peak_prompt(tokenizer, n)
        for step in args.step:
            for label in args.methods:
                grows = label.startswith("kvcache")
                if (label, n, step) in done or (grows and n > args.full_max):
                    continue
                r = peak_measure(model, prompt, label, args.budget, step, args.new_tokens)
                res["rows"].append(r)
                bound = f", bound {r['bound_bytes'] / MIB:.1f}" if "bound_bytes" in r else ""
                print(f"{label:>14} {n:>6} step {step:>5}: KV max {r['kv_allocated_max_bytes'] / MIB:8.1f} MiB{bound}, "
                      f"peak - weights {r['peak_over_weights_bytes'] / MIB:8.1f} MiB ({r['wall_s']:.0f} s)", flush=True)
                _common.stamp(res, sorted({lb.split(":")[0] for lb in args.methods if not lb.startswith("kvcache")}
                                          - {"rotating"}), regime="stream")
                _common.write_json(args.out, res)
    return 0


SUBCOMMANDS = {"eviction": eviction_main, "quant": quant_main, "peak": peak_main}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
