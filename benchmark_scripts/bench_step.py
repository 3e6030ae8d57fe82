"""Decode-step costs on the CPU, one subcommand per question:

* ``cost``: what one decode step costs beyond attention (the query tap, mask building, the step-state
  dependency, the amortized eviction step, Python per layer), against ``RotatingKVCache(max_size=B)``
  and ``KVCache``, on a wide random llama and the bundled SmolLM2 (figures/speed/step_cost.json;
  ``--components``: figures/speed/step_components.json);
* ``batch``: the cache-only cost of one batched decode step, ``BatchEvictionCache`` against mlx-lm's
  ``BatchRotatingKVCache`` (printed);
* ``nexus``: one Nexus eviction step against one decode step's attention (figures/bench_nexus_step.json);
* ``weight``: Python calls, graph nodes and CPU time of a decode step between evictions, per layer, for every
  method against ``RotatingKVCache`` and ``KVCache`` on a 28-layer tiny-width llama (figures/speed/step_weight.json).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py cost [--components] [...]
    python benchmark_scripts/bench_step.py cost --table figures/speed/step_cost.json   # markdown
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py batch --batch 8 --layers 30
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py nexus [--markdown JSON]
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py weight [--no-timing]

``python benchmark_scripts/bench_step.py SUBCOMMAND --help`` describes each one.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, RotatingKVCache

from _common import FIGURES, add_publish, blas_info, budget, output, provenance, route_outputs, tiny_llama, run_subcommands
import veloxquant_mlx
from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.caches.batch import BatchEvictionCache
from veloxquant_mlx.caches import PAD_POSITION
from veloxquant_mlx.evaluation.labels import method_specs
from veloxquant_mlx.ops import gather_rows
from veloxquant_mlx.registry import methods


# ================================================================================================
# cost: What one decode step costs beyond attention: the query tap, mask building, the step-state
# ================================================================================================
COST_DOC = """What one decode step costs beyond attention: the query tap, mask building, the step-state
dependency, the amortized eviction step and Python per layer, against the limit
``RotatingKVCache(max_size=B)`` (a plain window of the same B rows) and ``KVCache``.

Models: a tiny random llama with wide heads (2 layers, 16 query / 8 KV heads, head_dim 128, hidden
256), where attention dominates a step as it does at long context on a GPU, at 2K / 8K / 32K context;
and the bundled SmolLM2 (30 layers, 9 / 3 heads of 64) at 2K. Budget B = density x context.

Each cache starts a round from a synthetic state at ``context`` tokens seen (random keys / values,
the layout eviction leaves: B rows, sinks + spread middle + recent window, scores random, ragged
per-head counts for NestedKV), so a 32K prompt is never prefilled; then ``--steps`` greedy decode
steps run through the model (one ``mx.eval`` per token), decode evictions included. A component's
cost is measured by difference: the same method with that component switched off on the instance
(``no_depends``: no ``mx.depends`` on the step state; ``no_evict``: no decode eviction, so rows grow
by ``steps``; ``no_mask``: the tap keeps mlx-lm's mask; ``no_tap``: the tap passes straight to
attention: no observe, no mask, no dependency, no eviction). Switched-off variants are for timing only
(their outputs may be wrong). ``build`` is the host time of the model call (the lazy graph: Python).

Rounds run every configuration once, order reversed every other round; ratios are taken inside a
round (paired) and summarized as median [min, max] over rounds. Times are this process's CPU
time (all threads), which a shared machine disturbs far less than wall time (also recorded). Run with OpenBLAS preloaded:

  python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py cost
  python benchmark_scripts/bench_step.py cost --table figures/speed/step_cost.json   # markdown
"""

VARIANTS = ("full", "no_depends", "no_evict", "no_mask", "no_tap")


def budget_for_step(density: float, context: int) -> int:
    """The budget at ``density`` of ``context``, at least 64 rows (tiny contexts still evict)."""
    return budget(density, context, minimum=64)


def wide_model():
    """Wide heads (2 layers, 16 query / 8 KV heads of 128, hidden 256): attention dominates a step."""
    return tiny_llama(layers=2, heads=16, kv_heads=8, head_dim=128, hidden=256, vocab=256, seed=0,
                      intermediate_size=512, max_position_embeddings=65536)


def bundled_model():
    from veloxquant_mlx.models import load_model

    return load_model(None)[0]


def _shape(model):
    a = model.args
    hd = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    return a.num_key_value_heads, a.num_attention_heads, hd


def _kept_positions(T, R, n_sink, recent):
    """R kept positions out of T: sinks, the recent window and the middle spread evenly."""
    mid = R - n_sink - recent
    middle = np.linspace(n_sink, T - recent - 1, mid).round().astype(np.int64) if mid > 0 else []
    pos = np.unique(np.concatenate([np.arange(n_sink), middle, np.arange(T - recent, T)]))
    while len(pos) < R:  # rounding collisions (only at tiny T): fill from the unused positions
        pos = np.unique(np.concatenate([pos, np.setdiff1d(np.arange(T), pos)[:R - len(pos)]]))
    return pos[:R]


def fill(cache, T, kv_heads, q_heads, hd, seed):
    """Put ``cache`` at ``T`` tokens seen, holding what eviction leaves (see the module docstring)."""
    if isinstance(cache, (KVCache, RotatingKVCache)):
        keys = mx.random.normal((1, kv_heads, T, hd), key=mx.random.key(seed))
        cache.update_and_fetch(keys, keys + 1)
        mx.eval(cache.state)
        return
    R = min(T, cache.budget)
    k = mx.random.normal((1, kv_heads, R, hd), key=mx.random.key(seed))
    pos = np.broadcast_to(_kept_positions(T, R, cache.n_sink, cache.recent), (1, kv_heads, R)).copy()
    ragged = cache.config.method == "nestedkv"
    if ragged:  # heads keep different counts; real rows first, padding after (as NestedKV stores them)
        for h in range(kv_heads):
            drop = (h * R) // (4 * kv_heads)
            if drop:
                keep = np.sort(np.random.default_rng(h).choice(R - cache.recent, R - cache.recent - drop,
                                                               replace=False))
                pos[0, h] = np.concatenate([pos[0, h, keep], pos[0, h, R - cache.recent:], [PAD_POSITION] * drop])
    st = {"keys": k, "values": k + 1, "positions": mx.array(pos.astype(np.int32)), "rng": mx.random.key(seed)}
    for name in cache.store.fills:
        st["row." + name] = mx.random.uniform(shape=(1, kv_heads, R), key=mx.random.key(seed + 1))
    if cache.window.size:
        st["window_q"] = mx.random.normal((1, q_heads, cache.window.size, hd), key=mx.random.key(seed + 2))
    cache.state = st
    cache.offset, cache.scale, cache.store.ragged, cache.schedule.floor = T, hd ** -0.5, ragged, R
    cache.prompt.open, cache.prompt.saw_decode, cache.queries_observed = False, True, 1
    cache.note_fetched()
    mx.eval(cache.state)


def switch_off(cache, variant):
    if variant == "no_depends":
        cache.step_state = lambda: []
    elif variant == "no_evict":
        cache.schedule.threshold = lambda: 1 << 40
    elif variant == "no_mask":
        cache.attention_mask = lambda mask, queries: mask
    elif variant == "no_tap":
        cache.observe_queries = None


def make(model, label, T, budget, seed=0):
    kvh, qh, hd = _shape(model)
    if label == "kvcache":
        caches = [KVCache() for _ in model.layers]
    elif label == "rotating":
        caches = [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    else:
        method, variant = label.rsplit(":", 1)  # a method is a registry name or a label ("kvzap-each")
        caches = KVCacheBuilder.for_model(model, method_specs([method])[0].config(budget, seed=seed))
        for c in caches:
            switch_off(c, variant)
    for i, c in enumerate(caches):
        fill(c, T, kvh, qh, hd, seed + 7 * i)
    return caches


def decode(model, caches, steps):
    """(CPU ms, wall ms, host CPU ms building the graph) per step over ``steps`` greedy tokens.

    CPU time (this process, all threads) is what the ratios use: on a shared machine wall time mostly
    measures the neighbours."""
    y = mx.array([[1]])
    build = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        b0 = time.process_time()
        logits = model(y, cache=caches)
        y = mx.argmax(logits[:, -1:], axis=-1)
        build += time.process_time() - b0
        mx.eval(y)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return cpu / steps * 1e3, wall / steps * 1e3, build / steps * 1e3


def run_setting(model, name, T, density, methods, variants, rounds, steps, warmup):
    budget = budget_for_step(density, T)
    labels = ["rotating", "kvcache"] + [f"{m}:{v}" for m in methods for v in variants]
    for label in labels:  # warm-up (compiles, allocator)
        decode(model, make(model, label, T, budget), warmup)
    ms = {lb: [] for lb in labels}
    wall = {lb: [] for lb in labels}
    build = {lb: [] for lb in labels}
    for r in range(rounds):
        order = labels if r % 2 == 0 else labels[::-1]
        for label in order:
            caches = make(model, label, T, budget, seed=r)
            t, w, b = decode(model, caches, steps)
            ms[label].append(t)
            wall[label].append(w)
            build[label].append(b)
            del caches
        print(f"  {name} T={T} round {r + 1}/{rounds}: rotating {ms['rotating'][-1]:.2f} CPU ms/step "
              f"(wall {wall['rotating'][-1]:.2f})", flush=True)
    return {"model": name, "context": T, "budget": budget, "layers": len(model.layers),
            "cpu_ms_per_step": ms, "wall_ms_per_step": wall, "build_cpu_ms_per_step": build}


def _snapshot(c) -> dict:
    """What a decode step changes in a cache (its store, offset, key, window, eviction floor)."""
    return {"store": dict(vars(c.store)), "fields": dict(c.store.fields), "offset": c.offset, "rng": c._rng,
            "window": (c.window.q, c.window.at), "floor": c.schedule.floor}


def _restore(c, snap) -> None:
    vars(c.store).update(snap["store"])
    c.store.fields = dict(snap["fields"])
    c.offset, c._rng, c.schedule.floor = snap["offset"], snap["rng"], snap["floor"]
    c.window.q, c.window.at = snap["window"]


def components(model, T, budget, methods, repeats=25):
    """Per-layer CPU ms of each piece on its own (layer 0's cache, each piece evaluated alone, median
    of ``repeats``), as a fraction of one decode attention over the budget's rows (the limit's work):
    less disturbed by a shared machine than the step differences, but blind to fusion across pieces."""
    kvh, qh, hd = _shape(model)

    def med(fn):
        for _ in range(3):
            fn()
        xs = []
        for _ in range(repeats):
            c0 = time.process_time()
            fn()
            xs.append((time.process_time() - c0) * 1e3)
        return statistics.median(xs)

    # A method scoring hidden states (kvzap) gets one with each append, as the hidden-state tap hands it.
    x1 = mx.random.normal((1, 1, int(model.args.hidden_size)), key=mx.random.key(4))

    def put(cache):
        if cache.method.needs.hidden_states:
            cache.attention_input = x1
        return cache.update_and_fetch(k1, k1)

    K = mx.random.normal((1, kvh, budget, hd), key=mx.random.key(1))
    q = mx.random.normal((1, qh, 1, hd), key=mx.random.key(2))
    k1 = mx.random.normal((1, kvh, 1, hd), key=mx.random.key(3))
    mx.eval(K, q, k1)
    unit = med(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, K, K, scale=hd ** -0.5)))
    def appends(cache, n=16):  # consecutive single-token appends (buffers donated as in decode)
        xs = []
        for _ in range(n):
            c0 = time.process_time()
            mx.eval(put(cache))
            xs.append((time.process_time() - c0) * 1e3)
        return statistics.median(xs)

    rot = make(model, "rotating", T, budget)[0]
    put(rot)
    out = {"attention_ms": round(unit, 4), "rotating": {"append_fetch": round(appends(rot) / unit, 3)}}
    for m in methods:
        c = make(model, f"{m}:full", T, budget)[0]
        put(c)  # one decode append first: the buffers then have their decode headroom
        mx.eval(c.state)
        snap = _snapshot(c)

        def restore():
            _restore(c, snap)

        def append():
            restore()
            c.schedule.threshold = lambda: 1 << 40
            t = appends(c)
            del c.schedule.threshold
            return t / 1e3

        def observe():  # the scoring work of one step, no eviction
            restore()
            put(c)
            mx.eval(c.state)
            c0 = time.process_time()
            c.prompt.ending = False
            c.schedule.threshold = lambda: 1 << 40
            c.observe_queries(q, hd ** -0.5)
            mx.eval(c.step_state())
            del c.schedule.threshold
            return time.process_time() - c0

        def observe_attend():  # the tap's path: scoring, plus the layer output where the method fuses them
            restore()
            put(c)
            mx.eval(c.state)
            c0 = time.process_time()
            c.schedule.threshold = lambda: 1 << 40
            o = c.observe_and_attend(q, hd ** -0.5)
            if o is None:
                o = mx.fast.scaled_dot_product_attention(q, *c.store.fetch(), scale=hd ** -0.5)
            mx.eval(o, c.step_state())
            del c.schedule.threshold
            return time.process_time() - c0

        def mask():
            restore()
            put(c)
            mx.eval(c.state)
            c0 = time.process_time()
            mk = c.attention_mask(None, q)
            if isinstance(mk, mx.array):
                mx.eval(mk)
            return time.process_time() - c0

        def evict():
            restore()
            for _ in range(c.slack + 1):
                put(c)
            mx.eval(c.state)
            c0 = time.process_time()
            c.evict(c.schedule.keep())
            mx.eval(c.state)
            return time.process_time() - c0

        def inner(fn):  # the timed part only (set-up excluded)
            for _ in range(3):
                fn()
            return statistics.median(fn() * 1e3 for _ in range(repeats))

        decode_bounded = not c.prefill_only
        row = {"append_fetch": inner(append), "observe": inner(observe),
               "observe_and_attention": inner(observe_attend), "mask": inner(mask),
               "eviction_amortized": inner(evict) / c.slack if decode_bounded else 0.0}
        out[m] = {k: round(v / unit, 3) for k, v in row.items()}
        restore()
    return out


def _spread(xs):
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def summarize(setting, methods, variants):
    """Paired per-round ratios: speed vs the limit and vs KVCache, component shares of the limit step."""
    ms, build, L = setting["cpu_ms_per_step"], setting["build_cpu_ms_per_step"], setting["layers"]
    rot = ms["rotating"]
    out = {"kvcache_speed_vs_rotating": _spread([r / k for r, k in zip(rot, ms["kvcache"])])}
    for m in methods:
        full = ms[f"{m}:full"]
        row = {"speed_vs_rotating": _spread([r / f for r, f in zip(rot, full)]),
               "speed_vs_kvcache": _spread([k / f for k, f in zip(ms["kvcache"], full)]),
               "python_us_per_layer_over_rotating": _spread(
                   [(b - rb) / L * 1e3 for b, rb in zip(build[f"{m}:full"], build["rotating"])])}
        for v in variants:
            if v != "full":  # what switching v off saves, as a fraction of the limit's step
                row[f"cost_{v[3:]}_vs_rotating_step"] = _spread(
                    [(f - x) / r for f, x, r in zip(full, ms[f"{m}:{v}"], rot)])
        out[m] = row
    return out



def table(path) -> str:
    """Markdown tables of a result file (what docs/performance.md quotes)."""
    d = json.loads(Path(path).read_text())

    def f(x, signed=False):
        return (f"{x['median']:+.2f}" if signed else f"{x['median']:.2f}") + f" [{x['min']:.2f}, {x['max']:.2f}]"

    lines = [f"`{d['provenance']['command']}` at {d['provenance']['commit']}, {d['provenance']['date']}; "
             f"{d['settings']['rounds']} rounds x {d['settings']['steps']} steps; median [min, max] over rounds", ""]
    for r in d["runs"]:
        s = r["summary"]
        lines += [f"**{r['model']}, context {r['context']}, budget {r['budget']}** (KVCache: "
                  f"{f(s['kvcache_speed_vs_rotating'])} of the limit)", "",
                  "| method | speed vs limit | vs KVCache | tap (all) | eviction | step-state dep. | mask | "
                  "Python µs/layer |", "|---|---|---|---|---|---|---|---|"]
        for m in d["settings"]["methods"]:
            x = s[m]
            cell = lambda k: f(x[k], True) if k in x else "–"  # noqa: E731
            lines.append(f"| {m} | {f(x['speed_vs_rotating'])} | {f(x['speed_vs_kvcache'])} | "
                         f"{cell('cost_tap_vs_rotating_step')} | {cell('cost_evict_vs_rotating_step')} | "
                         f"{cell('cost_depends_vs_rotating_step')} | {cell('cost_mask_vs_rotating_step')} | "
                         f"{x['python_us_per_layer_over_rotating']['median']:+.0f} |")
        lines.append("")
    return "\n".join(lines)


def cost_main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--table"]:
        print(table(argv[1]))
        return 0
    ap = argparse.ArgumentParser(prog="bench_step.py cost", description=COST_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="2048,8192,32768", help="wide-model contexts")
    ap.add_argument("--bundled-contexts", default="2048", help="bundled SmolLM2 contexts ('' to skip)")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--methods", default="h2o,nexus,snapkv,nestedkv,streaming")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per timing (2 eviction steps at slack 32)")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--out", default=None, help="default figures/speed/step_cost.json "
                    "(--components: figures/speed/step_components.json)")
    ap.add_argument("--components", action="store_true",
                    help="time each piece of one layer's step on its own instead of whole decode steps")
    add_publish(ap)
    a = ap.parse_args(argv)
    a.out = output(a.out or str(FIGURES / "speed" / ("step_components.json" if a.components else "step_cost.json")),
                   a.publish)
    methods = [m for m in a.methods.split(",") if m]
    variants = [v for v in a.variants.split(",") if v]
    if "full" not in variants:
        variants.insert(0, "full")
    from veloxquant_mlx.evaluation.results import machine_info

    result = {"provenance": provenance(["full"] + methods), "machine": machine_info(), "blas": blas_info(),
              "settings": {"density": a.density, "rounds": a.rounds, "steps": a.steps, "methods": methods,
                           "variants": variants, "prompt_eviction": "end (state synthesized, no prefill)"},
              "runs": []}
    plan = [("wide", int(t)) for t in a.contexts.split(",") if t] +\
           [("bundled", int(t)) for t in a.bundled_contexts.split(",") if t]
    models = {}
    for name, T in plan:
        if name not in models:
            models[name] = wide_model() if name == "wide" else bundled_model()
        print(f"{name} T={T}", flush=True)
        if a.components:
            budget = budget_for_step(a.density, T)
            comp = components(models[name], T, budget, methods)
            result["runs"].append({"model": name, "context": T, "budget": budget, "per_layer_vs_attention": comp})
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(result, indent=1))
            print(json.dumps(comp), flush=True)
            continue
        s = run_setting(models[name], name, T, a.density, methods, variants, a.rounds, a.steps, a.warmup)
        s["summary"] = summarize(s, methods, variants)
        result["runs"].append(s)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        for m in methods:
            row = s["summary"][m]
            print(f"    {m:10s} vs rotating {row['speed_vs_rotating']['median']:.3f}  "
                  + "  ".join(f"{k[5:-17]} {row[k]['median']:+.3f}" for k in row if k.startswith("cost_"))
                  + f"  py/layer +{row['python_us_per_layer_over_rotating']['median']:.0f}us", flush=True)
    print("wrote", a.out)
    return 0


# ================================================================================================
# batch: Cache-only cost of one batched decode step: BatchEvictionCache against mlx-lm's BatchRotatingKVCache.
# ================================================================================================
BATCH_DOC = """Cache-only cost of one batched decode step: BatchEvictionCache against mlx-lm's BatchRotatingKVCache.

B rows, L layers with SmolLM2-135M's attention shapes (3 KV heads, 9 query heads, head_dim 64), each row
holding a compressed 2K prompt (``--budget`` rows): per step and layer, ``update_and_fetch``, the query
tap's work (``observe_queries``, the layer mask, the step-state dependency) and mlx-lm's attention.
No model weights, so the cache's own cost shows. CPU time per step (process time, robust to other
jobs on a shared machine), the two caches stepped alternately; min and median over ``--steps``.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py batch --batch 8 --layers 30
    ... --no-state-dependency   # ablation: skip the rows' step-state dependency (not a valid mode)
"""

H, batch_HQ, batch_D = 3, 9, 64


def ours(args):
    cfg = KVCacheConfig(method=args.method, budget=args.budget, prompt_eviction="end")
    layers = []
    for layer in range(args.layers):
        rows = []
        for _ in range(args.batch):
            c = EvictionCache(cfg, layer, args.layers)
            c.tap_active = True
            k = mx.random.normal((1, H, args.context - 1, batch_D))
            c.update_and_fetch(k, k)
            c.observe_queries(mx.repeat(k[:, :, -16:], batch_HQ // H, axis=1), batch_D ** -0.5)
            x = mx.random.normal((1, H, 1, batch_D))  # the prompt's last token: the one-shot compression
            c.update_and_fetch(x, x)
            c.observe_queries(mx.repeat(x, batch_HQ // H, axis=1), batch_D ** -0.5)
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
            k = mx.random.normal((1, H, args.context, batch_D))
            r.update_and_fetch(k, k)
            rows.append(r)
        layers.append(RotatingKVCache.merge(rows))
    return layers


def step(layers, args, tap: bool) -> float:
    t = time.process_time()
    x = mx.random.normal((args.batch, H, 1, batch_D))
    q = mx.random.normal((args.batch, batch_HQ, 1, batch_D))
    outs = []
    for c in layers:
        k, v = c.update_and_fetch(x, x)
        if tap:
            c.observe_queries(q, batch_D ** -0.5)
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=batch_D ** -0.5, mask=c.attention_mask(None, q))
            if not args.no_state_dependency:
                o = mx.depends(o, c.step_state())
        else:
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=batch_D ** -0.5, mask=None)
        outs.append(o)
    mx.eval(outs)
    return (time.process_time() - t) * 1e3


def batch_main(argv=None):
    p = argparse.ArgumentParser(prog="bench_step.py batch", description=BATCH_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return 0


# ================================================================================================
# nexus: Cost of one Nexus eviction step vs one decode-step attention (CPU, SmolLM2-like shapes).
# ================================================================================================
NEXUS_DOC = """Cost of one Nexus eviction step vs one decode-step attention (CPU, SmolLM2-like shapes).

One eviction step = scoring (Eq. 1-5) + selection (Eq. 6, top-K) over the stored rows, timed as
``cache.method.select(...)``; "+gather" also gathers the kept keys/values (what ``evict`` then does).
It runs once every b = block_size decoded tokens, so its amortized cost per token is step / b,
reported as a percentage of one decode step's attention (``mx.fast.scaled_dot_product_attention``,
1 query, over the same number of kept keys). Target: <= 10 %.

Run with an optimized BLAS (MLX's Linux CPU wheel ships a slow reference BLAS):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \
        python benchmark_scripts/bench_step.py nexus

Writes figures/bench_nexus_step.json (records whether OpenBLAS was preloaded).
"""

B, nexus_HQ, HKV, nexus_D = 1, 9, 3, 64  # SmolLM2-135M attention shapes


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
    cache = EvictionCache(cfg)
    rows = tokens + b + 1  # the step fires once rows exceed budget + b
    mx.random.seed(0)
    k = mx.random.normal((B, HKV, rows, nexus_D))
    v = mx.random.normal((B, HKV, rows, nexus_D))
    q = mx.random.normal((B, nexus_HQ, cfg.options.window, nexus_D))
    mx.eval(k, v, q)
    cache.update_and_fetch(k, v)  # no eviction yet: it runs after the queries arrive
    cache.scale = nexus_D ** -0.5
    cache.window.add(q)
    mx.eval(cache.state)

    def select():
        return cache.method.select(cache.view, cache.schedule.keep(), cache.allocation())

    t_select = median_time(select, repeats)

    def select_gather():  # what the cache's eviction does: one flat mx.take of whole rows
        idx = select()
        return gather_rows(cache.keys, idx), gather_rows(cache.values, idx)

    def select_gather_base():  # the base class's take_along_axis gather, for comparison
        idx = cache.select_rows()
        return gather_rows(cache.stored("keys"), idx), gather_rows(cache.stored("values"), idx)

    t_step = median_time(select_gather, repeats)
    t_step_base = median_time(select_gather_base, max(repeats // 3, 3))

    kk, vv = k[:, :, :tokens], v[:, :, :tokens]
    q1 = mx.random.normal((B, nexus_HQ, 1, nexus_D))
    mx.eval(kk, vv, q1)
    t_attn = median_time(lambda: mx.fast.scaled_dot_product_attention(q1, kk, vv, scale=nexus_D ** -0.5), repeats)
    return {
        "stored_tokens": tokens, "per_head": per_head, "block_size": b,
        "select_ms": 1e3 * t_select, "select_gather_ms": 1e3 * t_step, "decode_attention_ms": 1e3 * t_attn,
        "amortized_select_pct_of_attention": 100 * t_select / b / t_attn,
        "amortized_select_gather_pct_of_attention": 100 * t_step / b / t_attn,
        "select_base_gather_ms": 1e3 * t_step_base,
        "amortized_select_base_gather_pct_of_attention": 100 * t_step_base / b / t_attn,
    }


def markdown(path) -> str:
    """The docs table (docs/methods/nexus.md) of a written JSON, between its generated markers."""
    d = json.load(open(path))
    prov = d.get("provenance", {})
    rows = ["<!-- bench_nexus_step:begin (generated by benchmark_scripts/bench_step.py nexus --markdown) -->",
            f"From `figures/bench_nexus_step.json` ({prov.get('date', '?')[:10]}, commit {prov.get('commit', '?')}; "
            f"OpenBLAS preloaded: {d['blas'].get('openblas_preloaded')}; median of {d['repeats']}):", "",
            "| stored tokens | per_head | step | +gather | attention | amortized step | amortized +gather |",
            "|---|---|---|---|---|---|---|"]
    for r in d["results"]:
        rows.append(f"| {r['stored_tokens'] // 1024}K | {r['per_head']} | {r['select_ms']:.1f} ms | "
                    f"{r['select_gather_ms']:.1f} ms | {r['decode_attention_ms']:.2f} ms | "
                    f"{r['amortized_select_pct_of_attention']:.1f} % | "
                    f"{r['amortized_select_gather_pct_of_attention']:.1f} % |")
    pct = [r["amortized_select_pct_of_attention"] for r in d["results"]]
    rows += ["", f"Amortized step: {min(pct):.1f}–{max(pct):.1f} % of a decode step's attention "
             f"(target ≤ {d['target_pct']:.0f} %).", "<!-- bench_nexus_step:end -->"]
    return "\n".join(rows)


def nexus_main(argv=None):
    ap = argparse.ArgumentParser(prog="bench_step.py nexus", description=NEXUS_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--markdown", metavar="JSON", help="print the docs table of a written JSON and exit")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--out", default=str(FIGURES / "bench_nexus_step.json"))
    add_publish(ap)
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown(args.markdown))
        return 0
    route_outputs(args, "out")
    blas = blas_info()
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
        "shapes": {"B": B, "H_q": nexus_HQ, "H_kv": HKV, "D": nexus_D, "dtype": "float32", "window": 16, "walk_depth": 3,
                   "n_samples": 5},
        "timing": "median of repeats after 3 warm-ups, mx.eval around each call",
        "repeats": args.repeats, "target_pct": 10.0, "blas": blas,
        "mlx_version": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "results": results,
    }
    out["provenance"] = provenance(["nexus"])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print("wrote", os.path.abspath(args.out), "| openblas preloaded:", blas.get("openblas_preloaded"))
    return 0


# ================================================================================================
# weight: a decode step's Python calls, graph nodes and time between evictions, per layer
# ================================================================================================
WEIGHT_DOC = """The weight of one decode step between evictions, per layer: Python calls, MLX graph nodes, time.

For every registry method, against mlx-lm's ``RotatingKVCache(max_size=B)`` (the limit: a plain window
of the same B rows) and ``KVCache``, on a random llama of real layer count and tiny width (28 layers like
Qwen2.5-1.5B, 4 query / 2 KV heads of 16, hidden 64), where a step's time is the host work that builds
it (as on a GPU, docs/gpu.md):

* ``calls``: Python function calls per layer-step (cProfile over ``--steps`` steps of the model call,
  divided by steps x layers), all of them and those whose code lives in ``veloxquant_mlx``;
* ``nodes``: MLX graph nodes per layer-step: the primitives (not the inputs) of the graph of one step's
  logits plus every array the caches hold afterwards, as held (``mx.export_to_dot``), divided by layers;
* ``ms``: decode CPU ms per step (this process, all threads) over ``--steps`` greedy tokens, paired
  rounds in alternating order; ratios to the rotating cache inside a round, median [min, max].

Each cache starts from a synthetic state at ``--context`` tokens seen holding B = density x context rows
(``bench_step.fill``: what eviction leaves), decodes two warm-up tokens (the first outgrows the buffer),
then the measured steps: fewer than the eviction slack, so no eviction runs (between evictions).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step.py weight [--out figures/speed/step_weight.json]
"""

WEIGHT_PACKAGE = str(Path(veloxquant_mlx.__file__).resolve().parent)  # calls whose code is the package's
WEIGHT_BASELINES = ("rotating", "kvcache")


def step_model(layers: int = 28):
    return tiny_llama(layers=layers, heads=4, kv_heads=2, head_dim=16, hidden=64, vocab=256, seed=0,
                      intermediate_size=128, max_position_embeddings=65536)


_SCORER_DIR = None


def make_weight(model, label, T, budget, seed=0):
    """Caches of ``label`` ("rotating", "kvcache" or a registry method) at T tokens seen."""
    global _SCORER_DIR
    kvh, qh, hd = _shape(model)
    KVCacheBuilder.uninstall(model)  # the last label's taps (kvzap's hidden-state tap) leave with it
    if label == "kvcache":
        caches = [KVCache() for _ in model.layers]
    elif label == "rotating":
        caches = [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    else:
        spec = method_specs([label])[0]
        cfg = spec.config(budget, seed=seed)
        if cfg.method_class.needs.hidden_states:  # kvzap: a scorer fitted for this model
            from veloxquant_mlx.evaluation.kvzap_fit import tiny_scorer

            _SCORER_DIR = _SCORER_DIR or tempfile.mkdtemp(prefix="vq-step-scorer-")
            cfg = spec.config(budget, seed=seed, scorer=str(tiny_scorer(model, _SCORER_DIR)))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches = KVCacheBuilder.for_model(model, cfg)
    for i, c in enumerate(caches):
        fill(c, T, kvh, qh, hd, seed + 7 * i)
    return caches


def _step(model, caches, y):
    logits = model(y, cache=caches)
    return mx.argmax(logits[:, -1:], axis=-1), logits


def warm(model, caches, n=2):
    y = mx.array([[1]])
    for _ in range(n):
        y, _ = _step(model, caches, y)
        mx.eval(y, [c.state for c in caches])
    return y


def calls(model, label, T, budget, steps):
    """(all calls, calls in veloxquant_mlx) per layer-step."""
    caches = make_weight(model, label, T, budget)
    y = warm(model, caches)
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        y, _ = _step(model, caches, y)
        prof.disable()
        mx.eval(y)
    st = pstats.Stats(prof).stats
    total = sum(v[0] for v in st.values())  # primitive + recursive calls
    ours = sum(v[0] for k, v in st.items() if k[0].startswith(WEIGHT_PACKAGE))
    per = steps * len(model.layers)
    return total / per, ours / per


def _held_arrays(caches):
    """Every array the caches hold (buffers, positions, windows, per-row state), as held: a state
    getter's slices would add nodes of their own."""
    out = []
    for c in caches:
        st = getattr(c, "store", None)
        held = [*vars(c).values()] if st is None else [st.keys, st.values, st.positions, *st.fields.values(),
                                                        c.window.q]
        for a in held:
            out.extend(x for x in (a if isinstance(a, (tuple, list)) else (a,)) if isinstance(x, mx.array))
    return out


def nodes(model, label, T, budget):
    """MLX graph primitives of one step (its logits and what the caches hold after it), per layer."""
    caches = make_weight(model, label, T, budget)
    y = warm(model, caches)
    _, logits = _step(model, caches, y)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, logits, *_held_arrays(caches))
        text = Path(path).read_text()
    # Primitives are drawn as labelled rectangles; arrays (inputs included) as bare names.
    prims = len(re.findall(r'\[label ="[^"]*", shape=rectangle\]', text))
    return prims / len(model.layers)


def timing(model, labels, T, budget, rounds, steps):
    ms = {lb: [] for lb in labels}
    for lb in labels:  # warm-up (compiles, allocator)
        c = make_weight(model, lb, T, budget)
        warm(model, c)
        decode(model, c, 4)
    for r in range(rounds):
        for lb in (labels if r % 2 == 0 else labels[::-1]):
            c = make_weight(model, lb, T, budget, seed=r)
            warm(model, c)
            ms[lb].append(decode(model, c, steps)[0])
            del c
        print(f"  round {r + 1}/{rounds}: rotating {ms['rotating'][-1]:.2f} CPU ms/step", flush=True)
    return ms


def _spread(xs):
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def weight_main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench_step.py weight", description=WEIGHT_DOC,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--methods", nargs="*", default=None, help="registry methods (default: all)")
    ap.add_argument("--steps", type=int, default=16, help="measured steps per run (< the eviction slack)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-timing", action="store_true", help="calls and nodes only (deterministic)")
    ap.add_argument("--out", default=str(FIGURES / "speed" / "step_weight.json"))
    ap.add_argument("--note", default="")
    add_publish(ap)
    args = route_outputs(ap.parse_args(argv), "out")
    if not 0 < args.steps < 30:
        raise SystemExit("--steps must be in 1..29: the steps must fall between evictions (slack 32, 2 warm-up)")
    names = list(args.methods or methods())
    labels = [*WEIGHT_BASELINES, *names]
    model = step_model(args.layers)
    T, B = args.context, budget_for_step(args.density, args.context)
    rows = {}
    for lb in labels:
        total, ours = calls(model, lb, T, B, args.steps)
        rows[lb] = {"calls": round(total, 2), "calls_veloxquant": round(ours, 2),
                    "nodes": round(nodes(model, lb, T, B), 2)}
        print(f"{lb:>10}: {total:7.2f} calls/layer-step ({ours:6.2f} ours), {rows[lb]['nodes']:7.2f} nodes", flush=True)
    rot = rows["rotating"]
    for lb in names:
        r = rows[lb]
        r["calls_vs_rotating"] = round(r["calls"] / rot["calls"], 3)
        r["extra_calls"] = round(r["calls"] - rot["calls"], 2)
        r["extra_nodes"] = round(r["nodes"] - rot["nodes"], 2)
    if not args.no_timing:
        ms = timing(model, labels, T, B, args.rounds, args.steps)
        for lb in labels:
            rows[lb]["cpu_ms_per_step"] = _spread(ms[lb])
            rows[lb]["speed_vs_rotating"] = _spread([a / b for a, b in zip(ms["rotating"], ms[lb])])
    out = {"benchmark": "decode step weight between evictions, per layer",
           "model": {"layers": args.layers, "heads": 4, "kv_heads": 2, "head_dim": 16, "hidden": 64,
                     "note": "random llama of real layer count and tiny width: a step's time is its host work"},
           "context": T, "density": args.density, "budget": B, "steps": args.steps, "rounds": args.rounds,
           "targets": {"extra_nodes": 4, "extra_calls": 8, "calls_vs_rotating": 1.25, "speed_vs_rotating": 0.95},
           "mlx_version": mx.__version__, "device": str(mx.default_device()), "blas": blas_info(),
           "note": args.note, "results": rows, "provenance": provenance(names)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", args.out)
    return 0




SUBCOMMANDS = {"cost": cost_main, "batch": batch_main, "nexus": nexus_main, "weight": weight_main}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
