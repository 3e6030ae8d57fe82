"""Serving benchmark: 1, 4, 8 and 16 concurrent 2K-token conversations on the bundled SmolLM2-135M.

For each cache (mlx-lm's KVCache, which batches as BatchKVCache; mlx-lm's RotatingKVCache at the
eviction budget, which batches as BatchRotatingKVCache: the limit, a cache that only holds that many
rows; and eviction methods at a fixed density) and each concurrency n: n conversations join one mlx-lm ``BatchGenerator`` (the engine of
``mlx_lm.server`` and ``batch_generate``) with their prompts already in their caches, the way the
server continues a stored conversation, and decode ``--tokens`` tokens each. Measured:

* total allocated KV: the sum of ``nbytes`` over the batch caches of every layer (what the buffers
  hold, capacity included), after every decode step; we report the largest value during decode and
  the value when the prompts were in (before the first decode step);
* aggregate decode tok/s: ``BatchGenerator.stats()`` (generated tokens of all rows / decode time).

Each conversation's prompt is prefilled once per eviction method, alone (exactly what one row of a
batch holds: tests/test_batching.py), its last token included, so eviction caches enter the batch
compressed, as a conversation the server stored after its turn; every concurrency level decodes
copies of those caches.
Under ``--prompt-eviction end`` (default) an eviction cache holds every prompt row until the prompt
ends, so mlx-lm's KVCache baseline is built from those same rows (bit-identical to its own prefill)
instead of a second prefill, and the RotatingKVCache holds the last ``budget`` of them. ``--distinct``
conversations are prefilled; higher concurrency repeats them (the decode work is the same). A
warm-up decode runs first for every cache; then, in each of ``--rounds`` rounds and for each
concurrency, every cache is measured in turn (the order reversed every other round), so they see
the same machine load; ratios are taken within a round and summarized as median [min, max]. ``--fast-blas`` (default on) re-runs the script
with OpenBLAS preloaded when one is installed; the JSON says whether it was.

    python benchmark_scripts/bench_serving.py                 # figures/serving/bench_serving.{json,png}
    python benchmark_scripts/bench_serving.py --quick         # tiny random model, seconds (harness check)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "figures" / "serving"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per conversation")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--distinct", type=int, default=8, help="distinct conversations prefilled (then repeated)")
    p.add_argument("--rounds", type=int, default=2, help="measurement rounds, alternating the cache order")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per conversation")
    p.add_argument("--density", type=float, default=0.2, help="eviction budget / context")
    p.add_argument("--methods", nargs="+", default=["nexus", "streaming"],
                   help="eviction methods (registry names) measured against mlx-lm's KVCache")
    p.add_argument("--prompt-eviction", choices=("end", "stream"), default="end")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--no-fast-blas", action="store_true", help="keep MLX's reference BLAS")
    p.add_argument("--quick", action="store_true", help="tiny random model (numbers meaningless)")
    p.add_argument("--out-dir", default=str(OUT))
    return p.parse_args(argv)


def load(args):
    if args.quick:
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_model, tiny_tokenizer

        return make_tiny_model("llama", layers=4), tiny_tokenizer(), "tiny random llama (--quick)"
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer, "SmolLM2-135M-Instruct (bundled GGUF, float32)"


def conversations(tokenizer, n, context, quick):
    if quick:
        import numpy as np

        rng = np.random.default_rng(0)
        return [rng.integers(1, 128, size=context).tolist() for _ in range(n)]
    from veloxquant_mlx.evaluation.passkey import make_passkey_prompt

    keys = ["31416", "27182", "14142", "17320", "22360", "16180", "57721", "69314"]
    return [make_passkey_prompt(tokenizer, context, (i + 0.5) / n, keys[i % len(keys)])[0][:context]
            for i in range(n)]


def prefill(model, make_cache, prompt, step):
    """Caches holding prompt[:-1] (``last_token`` feeds the last one)."""
    import mlx.core as mx

    caches = make_cache()
    body = prompt[:-1]
    for start in range(0, len(body), step):
        model(mx.array(body[start:start + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def last_token(model, caches, prompt):
    """Feed the prompt's last token (an eviction cache's one-shot compression runs here, as for a
    conversation the server stored after its turn); returns the greedy next token."""
    import mlx.core as mx

    logits = model(mx.array(prompt[-1:])[None], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    return int(mx.argmax(logits[0, -1]).item())


def kv_total(gen):
    return sum(c.nbytes for c in gen._generation_batch.prompt_cache)


def decode(model, prompts, caches, firsts, tokens, step):
    """n conversations in one BatchGenerator, their caches holding the whole prompts and ``firsts``
    their first decode inputs: (stats, max total KV bytes after a decode step, tokens)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         prefill_step_size=step)
    gen.insert([[t] for t in firsts], [tokens] * len(prompts), caches=copy.deepcopy(caches),
               all_tokens=[list(p) for p in prompts])
    with gen.stats() as stats:
        peak = 0
        out = []
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            now = kv_total(gen) if len(gen._generation_batch) else peak
            peak = max(peak, now)
            out.extend(r.token for r in responses)
    gen.close()
    return stats, peak, len(out)


def kvcache_from(cache):
    """mlx-lm's KVCache holding the same rows as an eviction cache that has not evicted yet."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    kv = KVCache()
    kv.keys, kv.values = mx.contiguous(cache.stored("keys")), mx.contiguous(cache.stored("values"))
    kv.offset = cache.offset
    mx.eval(kv.keys, kv.values)
    return kv


def rotating_from(cache, budget):
    """mlx-lm's RotatingKVCache(max_size=budget) holding the last ``budget`` rows of an eviction cache
    that has not evicted yet: what a plain window of the eviction budget holds after the prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    rc = RotatingKVCache(max_size=budget)
    rc.keys = mx.contiguous(cache.stored("keys")[:, :, -budget:])
    rc.values = mx.contiguous(cache.stored("values")[:, :, -budget:])
    rc.offset, rc._idx = cache.offset, rc.keys.shape[2]
    mx.eval(rc.keys, rc.values)
    return rc


def summarize(results):
    """Per cache and concurrency: median tok/s over rounds, and ratios to KVCache and to the rotating
    limit taken within each round (same machine load), as median [min, max]."""
    import statistics

    out = []
    keys = list(dict.fromkeys((r["cache"], r["concurrency"]) for r in results))
    by = {(r["cache"], r["concurrency"], r["round"]): r for r in results}
    rounds = sorted({r["round"] for r in results})
    for cache, n in keys:
        rows = [by[cache, n, k] for k in rounds]
        row = {**{k: v for k, v in rows[0].items() if k not in ("round", "decode_tps", "decode_time_s",
                                                                "load_average_1min_before")},
               "decode_tps": statistics.median(r["decode_tps"] for r in rows),
               "decode_tps_rounds": [r["decode_tps"] for r in rows],
               "kv_allocated_peak_decode_bytes": max(r["kv_allocated_peak_decode_bytes"] for r in rows)}
        for ref in ("kvcache", "rotating"):
            ratios = [by[cache, n, k]["decode_tps"] / by[ref, n, k]["decode_tps"] for k in rounds]
            row[f"decode_tps_vs_{ref}"] = statistics.median(ratios)
            row[f"decode_tps_vs_{ref}_range"] = [min(ratios), max(ratios)]
            row[f"kv_vs_{ref}"] = row["kv_allocated_peak_decode_bytes"] / max(
                by[ref, n, k]["kv_allocated_peak_decode_bytes"] for k in rounds)
        out.append(row)
    return out


def prompt_kv(caches_per_conv):
    return sum(c.nbytes for caches in caches_per_conv for c in caches)


def main(argv=None):
    args = parse_args(argv)
    if not args.no_fast_blas:
        from veloxquant_mlx.platform.blas import reexec_with_openblas

        reexec_with_openblas()  # returns when already preloaded or when none is installed
    import mlx.core as mx
    import mlx_lm

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, __version__ as vq_version
    from veloxquant_mlx.platform.blas import blas_info

    model, tokenizer, model_name = load(args)
    n_max = min(max(args.concurrency), args.distinct)
    distinct = conversations(tokenizer, n_max, args.context, args.quick)
    budget = max(int(round(args.density * args.context)), 1)
    caches_kinds = [("kvcache", None), ("rotating", None)] + [
        (m, KVCacheConfig(method=m, budget=budget, prompt_eviction=args.prompt_eviction)) for m in args.methods]
    stored, prefill_s = {}, {}
    prompts = distinct
    for label, config in caches_kinds[2:]:
        make = lambda c=config: KVCacheBuilder.for_model(model, c)  # noqa: E731
        t0 = time.perf_counter()
        stored[label] = [prefill(model, make, p, args.prefill_step_size) for p in prompts]
        prefill_s[label] = time.perf_counter() - t0
        print(f"{label}: prefilled {n_max} x {args.context} tokens in {prefill_s[label]:.1f} s", flush=True)
    first = caches_kinds[2][0] if len(caches_kinds) > 2 else None
    derived = first is not None and all(
        c.evictions == 0 and c.size() == len(p) - 1 for p, caches in zip(prompts, stored[first]) for c in caches)
    if derived:
        # Under prompt_eviction="end" the eviction cache holds every prompt row until the prompt ends,
        # and attention saw all of them: its keys/values are exactly what mlx-lm's KVCache holds after
        # the same prefill, so the baseline reuses them instead of a second prefill.
        stored["kvcache"] = [[kvcache_from(c) for c in caches] for caches in stored[first]]
        stored["rotating"] = [[rotating_from(c, budget) for c in caches] for caches in stored[first]]
        prefill_s["kvcache"] = prefill_s["rotating"] = 0.0
    else:
        from mlx_lm.models.cache import make_prompt_cache

        KVCacheBuilder.uninstall(model)
        for label, kw in (("kvcache", {}), ("rotating", {"max_kv_size": budget})):
            t0 = time.perf_counter()
            stored[label] = [prefill(model, lambda kw=kw: make_prompt_cache(model, **kw), p, args.prefill_step_size)
                             for p in prompts]
            prefill_s[label] = time.perf_counter() - t0
    firsts = {}
    for label in stored:  # the prompts' last tokens: eviction caches compress here, before the batch
        t0 = time.perf_counter()
        firsts[label] = [last_token(model, c, p) for c, p in zip(stored[label], prompts)]
        prefill_s[label] += time.perf_counter() - t0
    prompts = [distinct[i % n_max] for i in range(max(args.concurrency))]  # conversations repeat past --distinct
    firsts = {k: [v[i % n_max] for i in range(len(prompts))] for k, v in firsts.items()}
    stored = {k: [v[i % n_max] for i in range(len(prompts))] for k, v in stored.items()}
    configs = dict(caches_kinds)
    for label in configs:  # warm-up (compiles the eviction graphs)
        decode(model, prompts[:1], stored[label][:1], firsts[label][:1], 4, args.prefill_step_size)
    results = []
    for rnd, n in ((rnd, n) for rnd in range(args.rounds) for n in args.concurrency):
        order = caches_kinds if rnd % 2 == 0 else caches_kinds[::-1]
        for label, config in order:  # interleaved: every cache sees the same machine load
            load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            stats, peak, n_tokens = decode(model, prompts[:n], stored[label][:n], firsts[label][:n], args.tokens,
                                           args.prefill_step_size)
            row = {"cache": label, "round": rnd, "method": None if config is None else config.method,
                   "config": None if config is None else config.to_dict(), "concurrency": n,
                   "context": args.context, "decode_tokens_per_conversation": args.tokens,
                   "generated_tokens": stats.generation_tokens, "decode_time_s": stats.decode_time,
                   "decode_tps": stats.generation_tps, "kv_allocated_peak_decode_bytes": peak,
                   "kv_allocated_prompt_bytes": prompt_kv(stored[label][:n]),
                   "prefill_s_all_conversations": prefill_s[label], "peak_memory_gb": stats.peak_memory,
                   "load_average_1min_before": load_before}
            results.append(row)
            print(f"  round {rnd} {label} n={n}: decode {row['decode_tps']:.1f} tok/s aggregate ({n_tokens} tokens), "
                  f"KV allocated peak {peak / 2**20:.1f} MiB (prompt held: "
                  f"{row['kv_allocated_prompt_bytes'] / 2**20:.1f} MiB); load {load_before}", flush=True)
    summary = summarize(results)
    meta = {"model": model_name, "context": args.context, "density": args.density, "budget": budget,
            "prompt_eviction": args.prompt_eviction, "tokens": args.tokens, "concurrency": args.concurrency,
            "prefill_step_size": args.prefill_step_size, "rounds": args.rounds,
            "distinct_conversations": n_max, "engine": "mlx_lm.generate.BatchGenerator",
            "kvcache_prefill": ("rows of the first eviction method's prefill (prompt_eviction=end holds "
                                "them all: identical to a KVCache prefill)") if derived else "own prefill",
            "compression": ("the prompt's last token is fed before the batch, so eviction caches enter it "
                            "compressed (as a conversation the server stored after its turn); that "
                            "compression is prefill time"),
            "order": ("prefill all, warm-up each cache, then per round and concurrency every cache in turn, "
                      "the order reversed every other round"),
            "rotating": f"mlx-lm RotatingKVCache(max_size={budget}) -> BatchRotatingKVCache (the limit)",
            "prompts": "passkey-filler prompts, one key/depth per conversation" if not args.quick else "random",
            "quick": args.quick, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "veloxquant_mlx": vq_version, "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None, **blas_info()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    from veloxquant_mlx.evaluation.provenance import command_line, provenance

    prov = provenance(command_line(), ["full", *args.methods], "stream" if args.prompt_eviction == "stream" else "end")
    (out / "bench_serving.json").write_text(json.dumps({"meta": meta, "summary": summary, "results": results,
                                                        "provenance": prov},
                                                       indent=1) + "\n")
    figure(summary, meta, out / "bench_serving.png")
    for r in summary:
        lo, hi = r["decode_tps_vs_rotating_range"]
        print(f"{r['cache']:>10s} n={r['concurrency']}: KV {r['kv_vs_kvcache']:.3f}x kvcache, decode "
              f"{r['decode_tps_vs_kvcache']:.2f}x kvcache, {r['decode_tps_vs_rotating']:.2f}x rotating "
              f"[{lo:.2f}, {hi:.2f}] ({r['decode_tps']:.1f} tok/s)")
    print(f"wrote {out / 'bench_serving.json'} and bench_serving.png; BLAS: {meta['blas']}")
    return 0


def figure(results, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["cache"] for r in results))
    ns = sorted({r["concurrency"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        rows = {r["concurrency"]: r for r in results if r["cache"] == label}
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(ns))]
        name = {"kvcache": "mlx-lm KVCache (BatchKVCache)",
                "rotating": f"mlx-lm RotatingKVCache({meta['budget']}) (limit)"}.get(
            label, f"{label} @ {meta['density']:.0%}")
        axes[0].bar(xs, [rows[n]["kv_allocated_peak_decode_bytes"] / 2**20 for n in ns], width, label=name)
        axes[1].bar(xs, [rows[n]["decode_tps"] for n in ns], width, label=name)
    for ax, title in zip(axes, ("total allocated KV during decode (MiB)",
                                f"aggregate decode tokens/s (median of {meta['rounds']} rounds)")):
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel(f"concurrent {meta['context']}-token conversations")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    blas = "OpenBLAS preloaded" if meta.get("openblas_preloaded") else "reference BLAS"
    fig.suptitle(f"{meta['model']} served through mlx-lm's BatchGenerator (CPU, {blas})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
