"""Per-layer speed of H2O and NestedKV-adapted against mlx-lm's KVCache (CPU, fp32).

B=1, 8 KV heads, 8 query heads, D=128, budget 512. Median of repeats after a warm-up, mx.eval
around every timed call. Writes figures/bench_h2o_nestedkv.json.

Run with an optimized BLAS (recorded in the JSON):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
      python benchmark_scripts/bench_h2o_nestedkv.py
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veloxquant_mlx import KVCacheConfig  # noqa: E402
from veloxquant_mlx.methods.h2o.cache import H2OKVCache  # noqa: E402
from veloxquant_mlx.methods.nestedkv.cache import NestedKVKVCache  # noqa: E402
from veloxquant_mlx.evaluation.provenance import command_line, provenance  # noqa: E402

B, H, HQ, D, BUDGET, CHUNK = 1, 8, 8, 128, 512, 2048
SCALE = D ** -0.5
sdpa = mx.fast.scaled_dot_product_attention


def data(T, seed=0):
    k = mx.random.normal((B, H, T, D), key=mx.random.key(seed))
    v = mx.random.normal((B, H, T, D), key=mx.random.key(seed + 1))
    q = mx.random.normal((B, HQ, T, D), key=mx.random.key(seed + 2))
    mx.eval(k, v, q)
    return k, v, q


def timeit(fn, repeats, warmup=1):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def layer_step(cache, k, v, q):
    """One model layer's cache work: update, (tap) observe + mask, attention."""
    K, V = cache.update_and_fetch(k, v)
    mask = "causal" if k.shape[2] > 1 else None
    if hasattr(cache, "observe_queries"):
        cache.observe_queries(q, SCALE)
        mask = cache.attention_mask(mask, q)
    return sdpa(q, K, V, scale=SCALE, mask=mask)


def prefill(make, k, v, q):
    c = make()
    T = k.shape[2]
    for s in range(0, T, CHUNK):  # mlx-lm's prefill: chunks of 2048, eval after each
        o = layer_step(c, k[:, :, s:s + CHUNK], v[:, :, s:s + CHUNK], q[:, :, s:s + CHUNK])
        mx.eval(o, c.state)
    return c


def h2o_cache(tap=True):
    c = H2OKVCache(KVCacheConfig(method="h2o", budget=BUDGET, n_sink=4))
    c.tap_active = tap
    return c


def nkv_cache():
    c = NestedKVKVCache(KVCacheConfig(method="nestedkv", budget=BUDGET, n_sink=4))
    c.tap_active = True
    return c


def decode_ms(make, k, v, q, steps):
    """Median and mean of single decode steps after a prefill of k (mean includes amortized eviction)."""
    c = prefill(make, k, v, q)
    k1, v1, q1 = data(1, seed=99)
    mx.eval(layer_step(c, k1, v1, q1), c.state)  # first decode call (NestedKV compresses here)
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        o = layer_step(c, k1, v1, q1)
        mx.eval(o, c.state)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, statistics.mean(ts) * 1e3, c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--only", choices=("all", "nestedkv"), default="all",
                    help="nestedkv: only the NestedKV section (merged into an existing JSON's h2o section)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "figures" / "bench_h2o_nestedkv.json"))
    args = ap.parse_args()
    preload = os.environ.get("LD_PRELOAD", "")
    res = {"shapes": dict(B=B, H_kv=H, H_q=HQ, D=D, budget=BUDGET, dtype="float32", prefill_chunk=CHUNK),
           "blas": {"openblas_preloaded": "openblas" in preload, "LD_PRELOAD": preload,
                    "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS")},
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__},
           "h2o": {}, "nestedkv": {}}
    if args.only == "nestedkv" and Path(args.out).exists():
        res["h2o"] = json.loads(Path(args.out).read_text()).get("h2o", {})
    for T in (1024, 4096, 8192) if args.only == "all" else ():
        k, v, q = data(T)
        base = timeit(lambda: prefill(KVCache, k, v, q), args.repeats)
        h2o = timeit(lambda: prefill(h2o_cache, k, v, q), args.repeats)
        res["h2o"][f"prefill_{T}"] = {"kvcache_ms": base, "h2o_ms": h2o, "ratio": h2o / base, "target_ratio": 3.0}
        print(f"H2O prefill {T}: KVCache {base:.1f} ms, H2O {h2o:.1f} ms ({h2o / base:.2f}x)", flush=True)
    if args.only == "all":
        k, v, q = data(4096)
        kv_med, kv_mean, _ = decode_ms(KVCache, k, v, q, args.steps)
        h_med, h_mean, c = decode_ms(h2o_cache, k, v, q, args.steps)
        res["h2o"]["decode_after_4096"] = {"kvcache_ms": kv_med, "h2o_median_ms": h_med, "h2o_mean_ms": h_mean,
                                           "kvcache_mean_ms": kv_mean, "ratio_median": h_med / kv_med,
                                           "ratio_mean": h_mean / kv_mean, "target_ratio": 2.0,
                                           "h2o_rows": c.size(), "kvcache_rows": 4096 + args.steps + 1}
        print(f"decode after 4K: KVCache {kv_med:.2f} ms, H2O median {h_med:.2f} / mean {h_mean:.2f} ms", flush=True)
        # same rows: KVCache holding as many rows as H2O does
        k5, v5, q5 = data(BUDGET + 16)
        kv5_med, kv5_mean, _ = decode_ms(KVCache, k5, v5, q5, args.steps)
        res["h2o"]["decode_vs_kvcache_same_rows"] = {"kvcache_rows": BUDGET + 16, "kvcache_ms": kv5_med,
                                                     "kvcache_mean_ms": kv5_mean,
                                                     "ratio_median": h_med / kv5_med, "ratio_mean": h_mean / kv5_mean}
        print(f"  KVCache with {BUDGET + 16} rows: {kv5_med:.2f} ms", flush=True)
    for T in (2048, 4096, 8192):
        k, v, q = data(T)
        ts = []
        for r in range(args.repeats + 1):
            c = prefill(nkv_cache, k[:, :, :T - 1], v[:, :, :T - 1], q[:, :, :T - 1])
            t0 = time.perf_counter()
            # the prompt's last token as its own step (as mlx_lm.generate feeds it): the one-shot
            # compression runs in its observe_queries, after that token attends to the whole prompt
            o = layer_step(c, k[:, :, T - 1:], v[:, :, T - 1:], q[:, :, T - 1:])
            mx.eval(o, c.state)
            if r:
                ts.append(time.perf_counter() - t0)
        comp = statistics.median(ts) * 1e3
        n_med, n_mean, c = decode_ms(nkv_cache, k, v, q, args.steps)
        kv_med, _, _ = decode_ms(KVCache, k, v, q, args.steps)
        res["nestedkv"][f"prompt_{T}"] = {
            "compression_ms": comp, "compression_target_ms": 50.0 if T == 4096 else None,
            "decode_median_ms": n_med, "kvcache_decode_ms": kv_med, "decode_ratio": n_med / kv_med,
            "decode_target_ratio": 1.2, "stored_rows_per_head": c.size(),
            "real_rows_per_head_mean": float(c.kept_per_head().astype(mx.float32).mean().item())}
        print(f"NestedKV {T}: compression {comp:.1f} ms, decode {n_med:.2f} ms vs KVCache {kv_med:.2f} ms "
              f"({n_med / kv_med:.2f}x), stored rows {c.size()}", flush=True)
    res["provenance"] = provenance(command_line(), ["full", "h2o", "nestedkv"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
