"""The peak during the prompt: what a long prompt holds at its largest, through plain ``mlx_lm.generate``.

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
The full and quantized caches grow with the prompt: they run only up to ``--full-max`` tokens.

    python benchmark_scripts/bench_peak.py --lengths 4096 8192 16384 32768 --budget 1024 --step 256
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

from _common import FIGURES, MIB, preload_blas, stamp, write_json
from bench_memory import AllocationRecorder, total_nbytes, weights_bytes

OUT = FIGURES / "memory" / "peak_stream.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--budget", type=int, default=1024, help="rows per KV head (and RotatingKVCache's max_size)")
    p.add_argument("--step", type=int, default=256, help="prefill_step_size")
    p.add_argument("--methods", nargs="+",
                   default=["kvzap", "kvzap:allocation=uniform", "kvcache", "rotating", "kvcache-8bit", "kvcache-4bit"],
                   help="method specs (run with prompt_eviction=stream), kvcache[-8bit|-4bit], rotating")
    p.add_argument("--full-max", type=int, default=8192, help="longest prompt for caches that hold it whole")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--out", type=Path, default=OUT)
    return p.parse_args(argv)


def make_caches(model, label: str, budget: int):
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.caches.quant import model_caches

    if label == "rotating":  # what --max-kv-size gives (make_prompt_cache ignores it for a model with make_cache)
        return [RotatingKVCache(max_size=budget, keep=4) if type(c) is KVCache else c for c in model_caches(model)]
    if label.startswith("kvcache"):
        bits = {"kvcache": None, "kvcache-8bit": 8, "kvcache-4bit": 4}[label]
        return model_caches(model, bits)
    return KVCacheBuilder.for_model(model, KVCacheConfig.parse(label, budget=budget, prompt_eviction="stream"))


def measure(model, prompt, label, budget, step, new_tokens) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    caches = make_caches(model, label, budget)
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


def prompt_tokens(tokenizer, n: int) -> list:
    from veloxquant_mlx.evaluation.tasks.filler import long_filler

    ids = tokenizer.encode(" ".join(long_filler(seed=0)))  # prose; the content does not change the bytes
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def main(argv=None) -> int:
    args = parse_args(argv)
    preload_blas()
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(args.model)
    res = {"setting": {"model": args.model, "budget": args.budget, "prefill_step_size": args.step,
                       "new_tokens": args.new_tokens, "weights_bytes": weights_bytes(model)}, "rows": []}
    if args.out.exists():
        import json

        old = json.loads(args.out.read_text())
        if old.get("setting") == res["setting"]:
            res = old
    done = {(r["label"], r["prompt_tokens"]) for r in res["rows"]}
    for n in args.lengths:
        prompt = prompt_tokens(tokenizer, n)
        for label in args.methods:
            grows = label.startswith("kvcache")
            if (label, n) in done or (grows and n > args.full_max):
                continue
            r = measure(model, prompt, label, args.budget, args.step, args.new_tokens)
            res["rows"].append(r)
            bound = f", bound {r['bound_bytes'] / MIB:.1f}" if "bound_bytes" in r else ""
            print(f"{label:>14} {n:>6}: KV max {r['kv_allocated_max_bytes'] / MIB:8.1f} MiB{bound}, peak - weights "
                  f"{r['peak_over_weights_bytes'] / MIB:8.1f} MiB ({r['wall_s']:.0f} s)", flush=True)
            stamp(res, sorted({lb.split(":")[0] for lb in args.methods if not lb.startswith("kvcache")} - {"rotating"}),
                  regime="stream")
            write_json(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
