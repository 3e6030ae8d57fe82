"""Cost of one Nexus eviction step vs one decode-step attention (CPU, SmolLM2-like shapes).

One eviction step = scoring (Eq. 1-5) + selection (Eq. 6, top-K) over the stored rows, timed as
``cache.select_rows()``; "+gather" also gathers the kept keys/values (what ``_evict`` then does).
It runs once every b = block_size decoded tokens, so its amortized cost per token is step / b,
reported as a percentage of one decode step's attention (``mx.fast.scaled_dot_product_attention``,
1 query, over the same number of kept keys). Target: <= 10 %.

Run with an optimized BLAS (MLX's Linux CPU wheel ships a slow reference BLAS):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        python benchmark_scripts/bench_nexus_step.py

Writes figures/bench_nexus_step.json (records whether OpenBLAS was preloaded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.caches.nexus import NexusKVCache  # noqa: E402
from veloxquant_mlx.ops import gather_rows  # noqa: E402
from veloxquant_mlx.ops import gather_rows  # noqa: E402

B, HQ, HKV, D = 1, 9, 3, 64  # SmolLM2-135M attention shapes


def median_time(fn, repeats, warmup=3):
    for _ in range(warmup):
        mx.eval(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench(tokens: int, per_head: bool, repeats: int) -> dict:
    b = 32
    cfg = KVCacheConfig(method="nexus", budget=tokens, nexus_per_head=per_head)
    cache = NexusKVCache(cfg)
    rows = tokens + b + 1  # the step fires once rows exceed budget + b
    mx.random.seed(0)
    k = mx.random.normal((B, HKV, rows, D))
    v = mx.random.normal((B, HKV, rows, D))
    q = mx.random.normal((B, HQ, cfg.options.window, D))
    mx.eval(k, v, q)
    cache.update_and_fetch(k, v)  # no eviction yet: it runs after the queries arrive
    cache.scale = D ** -0.5
    cache.on_queries(q)
    mx.eval(cache.state)

    t_select = median_time(cache.select_rows, repeats)

    def select_gather():  # what NexusKVCache._evict does: one flat mx.take of whole rows
        idx = cache.select_rows()
        return gather_rows(cache.keys, idx), gather_rows(cache.values, idx)

    def select_gather_base():  # the base class's take_along_axis gather, for comparison
        idx = cache.select_rows()
        return gather_rows(cache.stored("keys"), idx), gather_rows(cache.stored("values"), idx)

    t_step = median_time(select_gather, repeats)
    t_step_base = median_time(select_gather_base, max(repeats // 3, 3))

    kk, vv = k[:, :, :tokens], v[:, :, :tokens]
    q1 = mx.random.normal((B, HQ, 1, D))
    mx.eval(kk, vv, q1)
    t_attn = median_time(lambda: mx.fast.scaled_dot_product_attention(q1, kk, vv, scale=D ** -0.5), repeats)
    return {
        "stored_tokens": tokens, "per_head": per_head, "block_size": b,
        "select_ms": 1e3 * t_select, "select_gather_ms": 1e3 * t_step, "decode_attention_ms": 1e3 * t_attn,
        "amortized_select_pct_of_attention": 100 * t_select / b / t_attn,
        "amortized_select_gather_pct_of_attention": 100 * t_step / b / t_attn,
        "select_base_gather_ms": 1e3 * t_step_base,
        "amortized_select_base_gather_pct_of_attention": 100 * t_step_base / b / t_attn,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "figures",
                                                  "bench_nexus_step.json"))
    args = ap.parse_args()
    try:
        from veloxquant_mlx._blas import blas_info
        blas = blas_info()
    except ImportError:
        blas = {"ld_preload": os.environ.get("LD_PRELOAD", "")}
        blas["openblas_preloaded"] = "openblas" in blas["ld_preload"]
    results = []
    for per_head in (False, True):
        for t in args.tokens:
            r = bench(t, per_head, args.repeats)
            results.append(r)
            print(f"per_head={per_head!s:5} N={t:6d}  step {r['select_ms']:7.3f} ms (+gather "
                  f"{r['select_gather_ms']:7.3f})  attention {r['decode_attention_ms']:6.3f} ms  "
                  f"amortized {r['amortized_select_pct_of_attention']:5.1f}% "
                  f"(+gather {r['amortized_select_gather_pct_of_attention']:5.1f}%; base gather "
                  f"{r['amortized_select_base_gather_pct_of_attention']:5.1f}%)", flush=True)
    out = {
        "benchmark": "nexus eviction step vs decode attention",
        "shapes": {"B": B, "H_q": HQ, "H_kv": HKV, "D": D, "dtype": "float32", "window": 16, "walk_depth": 3,
                   "n_samples": 5},
        "timing": "median of repeats after 3 warm-ups, mx.eval around each call",
        "repeats": args.repeats, "target_pct": 10.0, "blas": blas,
        "mlx_version": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "results": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", os.path.abspath(args.out), "| openblas preloaded:", blas.get("openblas_preloaded"))


if __name__ == "__main__":
    main()
