"""Cache-only cost of one batched decode step: BatchEvictionCache against mlx-lm's BatchRotatingKVCache.

B rows, L layers with SmolLM2-135M's attention shapes (3 KV heads, 9 query heads, head_dim 64), each row
holding a compressed 2K prompt (``--budget`` rows): per step and layer, ``update_and_fetch``, the query
tap's work (``observe_queries``, the layer mask, the step-state dependency) and mlx-lm's attention.
No model weights, so the cache's own cost shows. CPU time per step (process time, robust to other
jobs on a shared machine), the two caches stepped alternately; min and median over ``--steps``.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_batch_step.py --batch 8 --layers 30
    ... --no-state-dependency   # ablation: skip the rows' step-state dependency (not a valid mode)
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import RotatingKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.caches.batch import BatchEvictionCache

H, HQ, D = 3, 9, 64


def ours(args):
    cfg = KVCacheConfig(method=args.method, budget=args.budget, prompt_eviction="end")
    layers = []
    for layer in range(args.layers):
        rows = []
        for _ in range(args.batch):
            c = cfg.cache_class(cfg, layer, args.layers)
            c.tap_active = True
            k = mx.random.normal((1, H, args.context - 1, D))
            c.update_and_fetch(k, k)
            c.observe_queries(mx.repeat(k[:, :, -16:], HQ // H, axis=1), D ** -0.5)
            x = mx.random.normal((1, H, 1, D))  # the prompt's last token: the one-shot compression
            c.update_and_fetch(x, x)
            c.observe_queries(mx.repeat(x, HQ // H, axis=1), D ** -0.5)
            mx.eval(c.state)
            rows.append(c)
        layers.append(BatchEvictionCache.merge(rows))
    return layers


def rotating(args):
    layers = []
    for _ in range(args.layers):
        rows = []
        for _ in range(args.batch):
            r = RotatingKVCache(max_size=args.budget)
            k = mx.random.normal((1, H, args.context, D))
            r.update_and_fetch(k, k)
            rows.append(r)
        layers.append(RotatingKVCache.merge(rows))
    return layers


def step(layers, args, tap: bool) -> float:
    t = time.process_time()
    x = mx.random.normal((args.batch, H, 1, D))
    q = mx.random.normal((args.batch, HQ, 1, D))
    outs = []
    for c in layers:
        k, v = c.update_and_fetch(x, x)
        if tap:
            c.observe_queries(q, D ** -0.5)
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=D ** -0.5, mask=c.attention_mask(None, q))
            if not args.no_state_dependency:
                o = mx.depends(o, c.step_state())
        else:
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=D ** -0.5, mask=None)
        outs.append(o)
    mx.eval(outs)
    return (time.process_time() - t) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--budget", type=int, default=410)
    p.add_argument("--method", default="nexus")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--no-state-dependency", action="store_true")
    args = p.parse_args(argv)
    a_layers, b_layers = ours(args), rotating(args)
    a, b = [], []
    for _ in range(args.steps):  # alternating: both see the same machine load
        a.append(step(a_layers, args, True))
        b.append(step(b_layers, args, False))
    print(f"B={args.batch} L={args.layers} {args.method} budget {args.budget}: CPU ms/step ours min {min(a):.1f} "
          f"median {statistics.median(a):.1f}; BatchRotatingKVCache min {min(b):.1f} median {statistics.median(b):.1f}; "
          f"speed vs rotating: {min(b) / min(a):.2f} (min), {statistics.median(b) / statistics.median(a):.2f} (median)")


if __name__ == "__main__":
    main()
