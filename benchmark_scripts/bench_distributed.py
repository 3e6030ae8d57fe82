"""Eviction under tensor parallelism: per-rank KV memory and the bytes the caches exchange, against
the model's own tensor-parallel all-reduces (2 ranks on one machine, ring backend over localhost).

    mlx.launch --backend ring -n 2 --python "$(which python3)" benchmark_scripts/bench_distributed.py

The bundled SmolLM2-135M has 3 KV heads, which do not split over 2 ranks, so this uses a tiny
RANDOM llama with 8 KV heads (16 query heads, head_dim 32, hidden 512, bf16): 4 KV heads per rank.
Bytes are counted from shapes (no timing involved): ours by the caches' HeadShard counters
(veloxquant_mlx.caches.shard), the model's by wrapping ``mx.distributed.all_sum`` / ``all_gather``
during the run (ours subtracted). An ``all_sum`` counts its payload, an ``all_gather`` its gathered
result. Decode-phase figures are per decoded token; "per eviction step" is per layer and step.

Run as one process (``python benchmark_scripts/bench_distributed.py``), it instead reads the same
accounting off one eviction step of each cache on a Llama-3-8B-like shape (32 layers, 8 KV heads,
32 query heads, hidden 4096, bf16, budget 2048, an 8192-token prompt, default method options), the
collectives answered locally by a counting stand-in (the byte counts depend only on shapes); that
is where the ratio matters.

Writes figures/distributed/bench_distributed.json (2 ranks, rank 0 writes) or
figures/distributed/projection_llama3_8b_like.json (one process).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import mlx.core as mx

from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from _common import FIGURES, add_publish, provenance, route_outputs

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.caches.shard import HeadShard
from veloxquant_mlx.distributed import traffic

OUT = FIGURES / "distributed"
SHAPE = dict(hidden_size=512, num_hidden_layers=2, intermediate_size=1024, num_attention_heads=16,
             num_key_value_heads=8, rms_norm_eps=1e-5, vocab_size=256, max_position_embeddings=8192)

CASES = {  # name -> KVCacheConfig kwargs (budget added); default method options unless stated
    "full": None,
    "nexus": dict(method="nexus"),
    "nexus-ada": dict(method="nexus", allocation="ada"),
    "nexus-per-head": dict(method="nexus", nexus_per_head=True),
    "h2o": dict(method="h2o"),
    "h2o-ada": dict(method="h2o", allocation="ada"),
    "morphkv-ada": dict(method="morphkv", allocation="ada"),
    "snapkv-ada": dict(method="snapkv", allocation="ada"),
    "nestedkv": dict(method="nestedkv"),
    "random": dict(method="random"),
    "streaming": dict(method="streaming"),
}


class Counter:
    """Wraps mx.distributed.all_sum / all_gather / all_max and adds up their payload bytes."""

    def __init__(self):
        self.bytes = 0
        self.calls = 0
        self._orig = {}

    def __enter__(self):
        for name in ("all_sum", "all_gather", "all_max"):
            fn = getattr(mx.distributed, name)
            self._orig[name] = fn

            def wrapped(x, *a, _fn=fn, _name=name, **k):
                group = k.get("group")
                n = group.size() if group is not None else mx.distributed.init().size()
                self.bytes += x.nbytes * (n if _name == "all_gather" else 1)
                self.calls += 1
                return _fn(x, *a, **k)

            setattr(mx.distributed, name, wrapped)
        return self

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(mx.distributed, name, fn)


def make_model(group):
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **SHAPE))
    model.set_dtype(mx.bfloat16)
    model.shard(group)
    mx.eval(model.parameters())
    return model


def run_case(model, prompt, config, decode, step):
    caches = [KVCache() for _ in model.layers] if config is None else KVCacheBuilder.for_model(model, config)
    with Counter() as counter:
        marks = []
        for i, (tok, _) in enumerate(generate_step(mx.array(prompt), model, max_tokens=decode + 1,
                                                   prompt_cache=caches, prefill_step_size=step)):
            mx.eval(tok)
            if i == 0:  # the prompt is done (first token sampled): split prompt / decode phases
                marks.append((counter.bytes, traffic(caches)["bytes"], [getattr(c, "evictions", 0) for c in caches]))
        mx.eval([c.state for c in caches])
        end = (counter.bytes, traffic(caches)["bytes"], [getattr(c, "evictions", 0) for c in caches])
    (tot0, ours0, ev0), (tot1, ours1, ev1) = marks[0], end
    t = traffic(caches)
    steps_decode = sum(ev1) - sum(ev0)
    res = {
        "allocated_kv_bytes": sum(c.nbytes for c in caches),
        "kv_heads_per_layer": caches[0].keys.shape[1],
        "prompt": {"model_bytes": tot0 - ours0, "eviction_bytes": ours0, "eviction_steps": sum(ev0)},
        "decode": {"tokens": decode, "model_bytes": (tot1 - ours1) - (tot0 - ours0),
                   "eviction_bytes": ours1 - ours0, "eviction_steps": steps_decode},
        "collectives": t["collectives"],
    }
    d = res["decode"]
    d["model_bytes_per_token"] = d["model_bytes"] / decode
    d["eviction_bytes_per_token"] = d["eviction_bytes"] / decode
    d["eviction_bytes_per_step"] = d["eviction_bytes"] / steps_decode if steps_decode else 0.0
    d["ratio"] = d["eviction_bytes"] / d["model_bytes"] if d["model_bytes"] else 0.0
    p = res["prompt"]
    p["eviction_bytes_per_step"] = p["eviction_bytes"] / p["eviction_steps"] if p["eviction_steps"] else 0.0
    p["ratio"] = p["eviction_bytes"] / p["model_bytes"] if p["model_bytes"] else 0.0
    return res


class CountingShard(HeadShard):
    """A HeadShard for rank 0 of ``size`` that talks to nobody: collectives return arrays of the right
    shape (the local one, or ``size`` copies for a gather) and are counted exactly as the real one
    counts them. Used to read off, from the library's own code, the bytes one eviction step of a
    big model would exchange (the values are meaningless; the byte counts depend only on shapes)."""

    def __init__(self, size=2):
        self.group, self.rank, self.size = None, 0, size
        self.bytes_reduced = self.collectives = 0

    def all_sum(self, x):
        self._count(x.nbytes)
        return x

    def gather_heads(self, x, axis=1):
        self._count(x.nbytes * self.size)
        return mx.concatenate([x] * self.size, axis=axis)

    def all_max_int(self, x):
        self._count(4)
        return int(x.item())


def step_bytes(config, n_kv_local, n_q_local, head_dim, prompt_len, size=2):
    """Bytes one layer exchanges (rank 0 of ``size``): at the prompt's compression and at one later
    (steady-state, ragged where Ada) decode eviction step."""
    cache = EvictionCache(config, layer_idx=0, n_layers=32)
    cache.dist = CountingShard(size)
    cache.tap_active = True
    key = mx.random.key(0)

    def step(S):
        k = mx.random.normal((1, n_kv_local, S, head_dim), key=key).astype(mx.bfloat16)
        q = mx.random.normal((1, n_q_local, S, head_dim), key=key).astype(mx.bfloat16)
        cache.update_and_fetch(k, k)
        cache.observe_queries(q)

    step(prompt_len)
    before = cache.dist.bytes_reduced
    step(1)  # the prompt ends: one-shot compression (prompt_eviction="end")
    mx.eval(cache.state)
    prompt_bytes, first = cache.dist.bytes_reduced - before, cache.evictions
    marks = []  # bytes counted when each later (decode) eviction step has run
    for _ in range(4 * (cache.slack + 1)):
        if cache.prefill_only or len(marks) == 2:
            break
        n = cache.evictions
        before = cache.dist.bytes_reduced
        step(1)
        if cache.evictions > n:
            marks.append(cache.dist.bytes_reduced - before)
    mx.eval(cache.state)
    decode_bytes = marks[-1] if marks else 0  # the second decode step: ragged storage where Ada
    return prompt_bytes, decode_bytes, cache.slack


def projection(budget=2048, layers=32, hidden=4096, n_kv=8, n_q=32, ranks=2, dtype_bytes=2, prompt_len=8192):
    """Bytes per token for a Llama-3-8B-like model (B = 1, 2 ranks, default method options), from one
    eviction step of the library's own caches run on that shape (CountingShard).

    Model: two all_sums of the hidden state per layer and token (attention o_proj, MLP down_proj).
    Decode-bounded methods run one step per ``slack`` decoded tokens per layer; prefill-only ones
    (and every method's prompt-end compression) once per prompt, compared with the prompt's traffic."""
    model = 2 * hidden * dtype_bytes * layers
    out = {"model_bytes_per_token": model,
           "shape": dict(budget=budget, layers=layers, hidden=hidden, kv_heads=n_kv, q_heads=n_q, ranks=ranks,
                         dtype_bytes=dtype_bytes, prompt_tokens=prompt_len, head_dim=64),
           "methods": {}}
    for name, kw in CASES.items():
        if kw is None:
            continue
        cfg = KVCacheConfig(budget=budget, **kw)
        p_bytes, d_bytes, slack = step_bytes(cfg, n_kv // ranks, n_q // ranks, 64, prompt_len, ranks)
        per_token = d_bytes * layers / slack
        out["methods"][name] = {
            "decode_bytes_per_layer_step": d_bytes, "steps_every_tokens": slack,
            "decode_bytes_per_token": per_token, "decode_ratio": per_token / model,
            "prompt_bytes_per_layer": p_bytes, "prompt_ratio": p_bytes * layers / (prompt_len * model)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--prefill-step-size", type=int, default=256)
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--projection-prompt", type=int, default=8192)
    ap.add_argument("--out-dir", default=str(OUT))
    add_publish(ap)
    args = route_outputs(ap.parse_args(), "out_dir")
    group = mx.distributed.init()
    os.makedirs(args.out_dir, exist_ok=True)
    if group.size() == 1:  # one process: the closed-shape projection for a Llama-3-8B-like model
        doc = projection(prompt_len=args.projection_prompt)
        doc["provenance"] = provenance(["full", *CASES])
        with open(os.path.join(args.out_dir, "projection_llama3_8b_like.json"), "w") as f:
            json.dump(doc, f, indent=1)
        for name, m in doc["methods"].items():
            print(f"{name:15s} decode {m['decode_bytes_per_token']:8.0f} B/token = {100 * m['decode_ratio']:.3f} % of "
                  f"the model's {doc['model_bytes_per_token']} B/token; prompt compression "
                  f"{100 * m['prompt_ratio']:.4f} % of the prompt's", flush=True)
        return
    if group.size() != 2:
        sys.exit("run under: mlx.launch --backend ring -n 2 --python $(which python3) " + sys.argv[0])
    model = make_model(group)
    prompt = mx.random.randint(0, SHAPE["vocab_size"], (args.prompt,), key=mx.random.key(1)).tolist()
    results = {}
    for name in args.cases:
        kw = CASES[name]
        config = None if kw is None else KVCacheConfig(budget=args.budget, **kw)
        r = run_case(model, prompt, config, args.decode, args.prefill_step_size)
        both = mx.distributed.all_gather(mx.array([r["allocated_kv_bytes"]], mx.float32), group=group).tolist()
        r["allocated_kv_bytes_per_rank"] = [int(x) for x in both]
        results[name] = r
        if group.rank() == 0:
            d = r["decode"]
            print(f"{name:15s} KV/rank {r['allocated_kv_bytes'] / 1024:8.1f} KiB  decode: model "
                  f"{d['model_bytes_per_token']:8.0f} B/token, eviction {d['eviction_bytes_per_token']:7.1f} B/token "
                  f"({100 * d['ratio']:.3f} %), {d['eviction_bytes_per_step']:.0f} B per layer-step; prompt: "
                  f"{100 * r['prompt']['ratio']:.3f} %", flush=True)
    if group.rank() == 0:
        doc = {"setup": {"ranks": group.size(), "backend": "ring (localhost)", "model": "tiny random llama (bf16)",
                         **SHAPE, "prompt_tokens": args.prompt, "decode_tokens": args.decode,
                         "budget": args.budget, "prefill_step_size": args.prefill_step_size,
                         "prompt_eviction": "end (default)"},
               "measured": results, "provenance": provenance(["full", *args.cases])}
        with open(os.path.join(args.out_dir, "bench_distributed.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
