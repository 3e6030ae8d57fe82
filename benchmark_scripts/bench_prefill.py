"""Prefill costs on the bundled SmolLM2-135M, one subcommand per question:

* ``fused``: H2O with one attention pass (the layer's output from the scoring pass's own weights)
  against two (scoring pass + mlx-lm's fused kernel), and against mlx-lm's KVCache, prefill and decode
  (figures/speed/fused_scoring.json);
* ``kvzip``: KVzip's prefill with its reconstruction pass against a plain prefill, time and peak
  memory, and the pass's peak per reconstruction chunk (figures/kvzip/prefill_cost.json);
* ``attention``: where one prefill chunk's time goes on this backend at long context: the layer's
  weight matmuls against its attention, and the attention's softmax exponentials against numpy's
  (figures/speed/prefill_attention_<shape>.json). Shapes only, no model load.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_prefill.py fused --contexts 2048,4096
    python benchmark_scripts/bench_prefill.py kvzip [--quick]
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_prefill.py attention --contexts 2048 8192 16384

``python benchmark_scripts/bench_prefill.py SUBCOMMAND --help`` describes each one.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from _common import (FIGURES, MIB, add_publish, blas_info, budget, cpu_timed, output, preload_blas, provenance,
                     route_outputs, run_subcommands, stamp, write_json)
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.decode import greedy, prefill
from veloxquant_mlx.evaluation.speed import _prompt


# ================================================================================================
# fused: H2O with one attention pass (the layer's output from the scoring pass's own weights) against two
# ================================================================================================
FUSED_DOC = """H2O with one attention pass (the layer's output from the scoring pass's own weights) against two
(scoring pass + mlx-lm's fused kernel), and against mlx-lm's KVCache, on the bundled SmolLM2.

Prefill: the prompt fed as ``mlx_lm.generate`` does (chunks of 2048, state evaluated after each, the
last token alone: H2O's one-shot compression runs there). Decode: ``--decode`` greedy tokens after it.
Rounds run every cache once, order reversed every other round; ratios are paired within a round and
use this process's CPU time (a shared machine disturbs wall time far more; wall is recorded too).

  python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_prefill.py fused --contexts 2048,4096
"""


CACHES = ("kvcache", "h2o-fused", "h2o-separate")


def make(model, label, budget):
    from mlx_lm.models.cache import make_prompt_cache

    if label == "kvcache":
        return make_prompt_cache(model)
    mode = label.split("-")[1]
    return KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=budget, h2o_attention_pass=mode))



def fused_main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="bench_prefill.py fused", description=FUSED_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(FIGURES / "speed" / "fused_scoring.json"))
    add_publish(ap)
    a = route_outputs(ap.parse_args(argv), "out")
    from veloxquant_mlx.evaluation.results import machine_info
    from veloxquant_mlx.models import load_model

    model, tok = load_model(None)
    result = {"provenance": provenance(["full", "h2o"]),
              "machine": machine_info(), "blas": blas_info(), "model": "bundled SmolLM2-135M (fp32)",
              "settings": {"density": a.density, "decode_tokens": a.decode, "rounds": a.rounds,
                           "prefill_step": 2048, "prompt_eviction": "end"}, "runs": []}
    for T in [int(t) for t in a.contexts.split(",") if t]:
        x = mx.array(_prompt(tok, T))
        rows = budget(a.density, T)
        rec = {c: {"prefill_cpu_s": [], "prefill_wall_s": [], "decode_cpu_s": [], "decode_wall_s": []}
               for c in CACHES}
        for c in CACHES:  # warm-up on a short prompt (allocator, compiled graphs)
            prefill(model, x[:512], make(model, c, 128), 2048)
        for r in range(a.rounds):
            for c in (CACHES if r % 2 == 0 else CACHES[::-1]):
                caches = make(model, c, rows)
                y, pc, pw = cpu_timed(lambda: prefill(model, x, caches, 2048))
                _, dc, dw = cpu_timed(lambda: greedy(model, caches, y, a.decode + 1))
                for k, v in (("prefill_cpu_s", pc), ("prefill_wall_s", pw), ("decode_cpu_s", dc),
                             ("decode_wall_s", dw)):
                    rec[c][k].append(round(v, 4))
            print(f"T={T} round {r + 1}: " + "  ".join(f"{c} prefill {rec[c]['prefill_cpu_s'][-1]:.2f}s"
                                                    for c in CACHES), flush=True)

        def ratio(num, den, key):  # paired speed ratio: time of den / time of num, per round
            xs = [d / n for n, d in zip(rec[num][key], rec[den][key])]
            return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}

        summary = {f"{what}_speed_{c}_vs_kvcache": ratio(c, "kvcache", f"{what}_cpu_s")
                   for what in ("prefill", "decode") for c in CACHES[1:]}
        summary |= {f"{what}_speed_fused_vs_separate": ratio("h2o-fused", "h2o-separate", f"{what}_cpu_s")
                    for what in ("prefill", "decode")}
        result["runs"].append({"context": T, "budget": rows, "times": rec, "summary": summary})
        print(json.dumps(summary), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print("wrote", a.out)
    return 0


# ================================================================================================
# kvzip: KVzip's cost: prefill with the reconstruction pass vs a plain prefill.
# ================================================================================================
KVZIP_DOC = """KVzip's cost: prefill with the reconstruction pass vs a plain prefill.

On the bundled SmolLM2-135M (``veloxquant_mlx.models.load_model()``, fp32), prose prompts of 1K, 2K
and 4K tokens are fed exactly as ``mlx_lm.generate`` feeds them (all but the last token in chunks of
``prefill_step_size`` = 2048, then the last token alone, then ``mx.eval`` of the caches' state):

* ``plain``: mlx-lm's ``KVCache`` (no compression);
* ``kvzip``: ``KVCacheConfig("kvzip", budget=20 % of the prompt)`` from ``KVCacheBuilder.for_model``
  with the tokenizer; the last token's step runs the reconstruction pass (chunks of 2K) and every
  layer evicts.

Side by side, alternating which goes first, several rounds; the median of each is reported and the
ratio kvzip / plain. Memory: ``mx.get_peak_memory()`` minus the active memory before the step, for
the whole prefill and for the prompt's last step alone (where the pass runs), plus, at the longest
context, the pass's peak for several reconstruction chunk sizes (is the extra memory bounded by the
chunk?). OpenBLAS is preloaded (1 thread) unless ``--no-fast-blas``.

    python benchmark_scripts/bench_prefill.py kvzip               # -> figures/kvzip/prefill_cost.json
    python benchmark_scripts/bench_prefill.py kvzip --quick       # tiny random model, harness check
"""

MIB = 1024 * 1024


def kvzip_parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_prefill.py kvzip", description=KVZIP_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                   help="reconstruction chunk sizes whose pass peak is measured at the longest context")
    p.add_argument("--chunk-context", type=int, default=None, help="context of the chunk sweep (default: longest)")
    p.add_argument("--pass-attention", nargs="+", default=["auto"], choices=("auto", "fused", "separate"),
                   help="kvzip_pass_attention: the pass's attention from the scoring softmax (fused) or mlx-lm's "
                        "(separate); several values run side by side as kvzip[<mode>]")
    p.add_argument("--no-floor", dest="floor", action="store_false",
                   help="skip 'pass-forward': plain prefill + the pass's forward with mlx-lm's attention, no scoring")
    p.add_argument("--no-fast-blas", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny random model, short prompts")
    p.add_argument("--out", default=str(FIGURES / "kvzip" / "prefill_cost.json"))
    add_publish(p)
    return route_outputs(p.parse_args(argv), "out")


def feed(model, tokens, caches, step):
    """mlx_lm.generate's prefill; returns (seconds total, seconds of the last step, peak of the last
    step over the active memory before it, peak of everything over the active memory before)."""
    import mlx.core as mx

    x = mx.array(tokens)[None]
    n = x.shape[1]
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for s in range(0, n - 1, step):
        model(x[:, s:min(s + step, n - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    mx.clear_cache()
    before_last = mx.get_active_memory()
    peak_prefill = mx.get_peak_memory()
    mx.reset_peak_memory()
    t1 = time.perf_counter()
    logits = model(x[:, n - 1:], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    t2 = time.perf_counter()
    last_peak = mx.get_peak_memory()
    return {"total_s": t2 - t0, "last_step_s": t2 - t1, "last_step_peak_mib": (last_peak - before_last) / MIB,
            "peak_mib": (max(peak_prefill, last_peak) - base) / MIB,
            "kv_bytes_after": sum(c.nbytes for c in caches)}


def kvzip_main(argv=None):
    args = kvzip_parse_args(argv)
    preload_blas(num_threads=1, skip=args.no_fast_blas)
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.evaluation.retrieval import prose_text
    from veloxquant_mlx.evaluation.results import load_eval_model

    model, tokenizer, desc = load_eval_model("bundled", quick=args.quick)
    contexts = [128, 256] if args.quick else args.contexts
    all_tokens = list(tokenizer.encode(prose_text(seed=0)))
    if len(all_tokens) < max(contexts):
        raise SystemExit(f"prose gives {len(all_tokens)} tokens, need {max(contexts)}")
    step = 64 if args.quick else args.prefill_step_size
    chunk_default = 64 if args.quick else 2048

    modes = list(dict.fromkeys(args.pass_attention))
    names = ["kvzip"] if modes == ["auto"] else [f"kvzip[{m}]" for m in modes]

    def kvzip_caches(n, chunk=chunk_default, name="kvzip"):
        mode = name[6:-1] if name.startswith("kvzip[") else "auto"
        cfg = KVCacheConfig("kvzip", budget=budget(args.density, n, minimum=16), kvzip_chunk=chunk,
                            kvzip_pass_attention=mode)
        return KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer)

    def floor_run(tokens):
        """The pass's model forward with mlx-lm's own attention and no scoring: a plain prefill, then the
        reconstruction input (repeat prompt + context, one chunk) over that cache. What any pass costs
        at least with this attention (exact shapes when the context fits one chunk)."""
        from veloxquant_mlx.methods.kvzip.method import KVzipOptions
        from veloxquant_mlx.model_pass import PassPrompt, chunk_parts

        caches = make_prompt_cache(model)
        r = feed(model, tokens, caches, step)
        pp, overlap = PassPrompt(tokenizer), KVzipOptions().overlap
        t = time.perf_counter()
        for lo in range(0, len(tokens), chunk_default):
            parts = chunk_parts(pp, lambda a, b: tokens[a:b], lo, min(lo + chunk_default, len(tokens)), overlap)
            model(mx.array(sum(parts, []))[None], cache=caches)
            mx.eval([c.state for c in caches])
        r["pass_forward_s"] = time.perf_counter() - t
        r["total_s"] += r["pass_forward_s"]
        return r

    rows, chunk_peaks = [], []
    path = Path(args.out)

    def write(sweep_at=None):  # after every context: a partial run still leaves its numbers
        out = {"experiment": "kvzip prefill cost", "model": desc, "density": args.density,
               "prefill_step_size": step, "reconstruction_chunk": chunk_default, "rows": rows,
               "chunk_peaks_at": sweep_at, "chunk_peaks": chunk_peaks,
               "provenance": {**provenance(["full", "kvzip"]),
                              "load_average_at_end": os.getloadavg(), "mlx": mx.__version__, **blas_info()}}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))

    warm = min(256, contexts[0])  # warm-up (first-call costs), short: the machine is shared
    feed(model, all_tokens[:warm], make_prompt_cache(model), step)
    feed(model, all_tokens[:warm], kvzip_caches(warm), step)
    for n in contexts:
        tokens = all_tokens[:n]
        runs = {k: [] for k in ["plain", *names, *(["pass-forward"] if args.floor else [])]}
        for r in range(args.rounds):
            order = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for name in order:
                if name == "pass-forward":
                    runs[name].append(floor_run(tokens))
                    continue
                caches = make_prompt_cache(model) if name == "plain" else kvzip_caches(n, name=name)
                runs[name].append(feed(model, tokens, caches, step))
                if name != "plain":
                    assert all(c.zip_passes == 1 for c in caches if hasattr(c, "zip_passes"))
        med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
        row = {"context": n, "budget": budget(args.density, n, minimum=16), "rounds": args.rounds,
               "runs": runs, "median": med,
               "ratio_total": med[names[0]]["total_s"] / med["plain"]["total_s"],
               "pass_extra_s": med[names[0]]["last_step_s"] - med["plain"]["last_step_s"]}
        # per round, kvzip / plain of the same round (the machine's load moves between rounds)
        row["ratio_by_round"] = {k: [a["total_s"] / b["total_s"] for a, b in zip(runs[k], runs["plain"])]
                                 for k in runs if k != "plain"}
        rows.append(row)
        for k in [k for k in runs if k != "plain"]:
            print(f"{n:>5} tokens: plain {med['plain']['total_s']:.2f} s, {k} {med[k]['total_s']:.2f} s "
                  f"(x{med[k]['total_s'] / med['plain']['total_s']:.2f}; per round "
                  f"{', '.join(f'{x:.2f}' for x in row['ratio_by_round'][k])}); last step peak plain "
                  f"{med['plain']['last_step_peak_mib']:.0f} MiB, {k} {med[k]['last_step_peak_mib']:.0f} MiB; "
                  f"prefill peak plain {med['plain']['peak_mib']:.0f} / {k} {med[k]['peak_mib']:.0f} MiB", flush=True)
        write()

    n = args.chunk_context or max(contexts)
    for chunk in ([32, 64, 128, 256] if args.quick else args.chunks):
        r = feed(model, all_tokens[:n], kvzip_caches(n, chunk), step)
        chunk_peaks.append({"chunk": chunk, "last_step_peak_mib": r["last_step_peak_mib"],
                            "last_step_s": r["last_step_s"]})
        print(f"  {n} tokens, reconstruction chunk {chunk}: pass step peak {r['last_step_peak_mib']:.0f} MiB, "
              f"{r['last_step_s']:.2f} s", flush=True)
        write(n)
    print(f"wrote {path}")
    return 0


# ================================================================================================
# attention: where a long prefill's time goes (weights against attention, exp against numpy's)
# ================================================================================================
# (query heads, KV heads, head_dim, layers, hidden, intermediate) of the models the long-context runs use
SHAPES = {"smollm2-135m": (9, 3, 64, 30, 576, 1536), "qwen2.5-coder-1.5b": (12, 2, 128, 28, 1536, 8960)}


def attention_main(argv=None):
    import numpy as np

    ap = argparse.ArgumentParser(prog="bench_prefill.py attention", description=(
        "One prefill chunk of one layer, as mlx-lm runs it: the last chunk of a prompt of N tokens against "
        "all N keys (mx.fast.scaled_dot_product_attention, causal), split into its score matmul, its softmax "
        "and the softmax's exponentials alone, beside the layer's weight matmuls for the same chunk and "
        "numpy's exp over as many elements. CPU seconds, median of --repeats."))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-coder-1.5b")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--chunk", type=int, default=2048, help="prefill step (mlx_lm.generate's default 2048)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None, help="default figures/speed/prefill_attention_<shape>.json")
    add_publish(ap)
    args = ap.parse_args(argv)
    args.out = output(args.out or str(FIGURES / "speed" / f"prefill_attention_{args.shape}.json"), args.publish)
    n_q, n_kv, d, layers, hidden, inter = SHAPES[args.shape]

    def cpu(fn):
        mx.eval(fn())  # warm
        return statistics.median(cpu_timed(lambda: mx.eval(fn()))[1] for _ in range(args.repeats))

    c = args.chunk
    x = mx.random.normal((c, hidden))
    w = {name: mx.random.normal(shape) * 0.02 for name, shape in {
        "qkv": (hidden, (n_q + 2 * n_kv) * d), "o": (n_q * d, hidden), "up_gate": (hidden, 2 * inter),
        "down": (inter, hidden)}.items()}
    h = mx.random.normal((c, n_q * d))
    g = mx.random.normal((c, inter))
    weights_s = cpu(lambda: [x @ w["qkv"], h @ w["o"], x @ w["up_gate"], g @ w["down"]])
    rows = []
    for n in args.contexts:
        q = mx.random.normal((1, n_q, c, d))
        k, v = mx.random.normal((1, n_kv, n, d)), mx.random.normal((1, n_kv, n, d))
        qg = q.reshape(n_kv, n_q // n_kv * c, d)
        scores = qg @ k[0].swapaxes(-1, -2)
        mx.eval(q, k, v, scores)
        sdpa_s = cpu(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask="causal"))
        row = {"context": n, "chunk": c, "attention_s": sdpa_s, "score_matmul_s": cpu(lambda: qg @ k[0].swapaxes(-1, -2)),
               "softmax_s": cpu(lambda: mx.softmax(scores, axis=-1)), "exp_s": cpu(lambda: mx.exp(scores)),
               "weights_s": weights_s, "exp_elements": scores.size}
        a = np.asarray(scores)
        row["numpy_exp_s"] = statistics.median(cpu_timed(lambda: np.exp(a))[1] for _ in range(args.repeats))
        row["attention_share"] = sdpa_s / (sdpa_s + weights_s)
        row["ns_per_exp"] = {"mlx": 1e9 * row["exp_s"] / scores.size, "numpy": 1e9 * row["numpy_exp_s"] / scores.size}
        rows.append(row)
        print(f"{args.shape} chunk {c} vs {n} keys, one layer: attention {sdpa_s:.2f} s (softmax {row['softmax_s']:.2f}, "
              f"exp {row['exp_s']:.2f}; numpy exp {row['numpy_exp_s']:.2f}), weights {weights_s:.2f} s -> attention "
              f"{100 * row['attention_share']:.0f} % of the chunk", flush=True)
    out = {"experiment": "prefill_attention", "shape": dict(zip(
        ("query_heads", "kv_heads", "head_dim", "layers", "hidden", "intermediate"), SHAPES[args.shape]), name=args.shape),
        "device": str(mx.default_device()), "blas": blas_info(), "rows": rows}
    path = write_json(args.out, stamp(out, labels=[]))
    print(f"wrote {path}")
    return 0


SUBCOMMANDS = {"fused": fused_main, "kvzip": kvzip_main, "attention": attention_main}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
