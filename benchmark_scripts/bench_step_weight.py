"""The weight of one decode step between evictions, per layer: Python calls, MLX graph nodes, time.

For every registry method, against mlx-lm's ``RotatingKVCache(max_size=B)`` (the limit: a plain window
of the same B rows) and ``KVCache``, on a random llama of real layer count and tiny width (28 layers like
Qwen2.5-1.5B, 4 query / 2 KV heads of 16, hidden 64), where a step's time is the host work that builds
it (as on a GPU, docs/gpu.md):

* ``calls``: Python function calls per layer-step (cProfile over ``--steps`` steps of the model call,
  divided by steps x layers), all of them and those whose code lives in ``veloxquant_mlx``;
* ``nodes``: MLX graph nodes per layer-step: the primitives (not the inputs) of the graph of one step's
  logits plus every array the caches hold afterwards (``mx.export_to_dot``), divided by layers;
* ``ms``: decode CPU ms per step (this process, all threads) over ``--steps`` greedy tokens, paired
  rounds in alternating order; ratios to the rotating cache inside a round, median [min, max].

Each cache starts from a synthetic state at ``--context`` tokens seen holding B = density x context rows
(``bench_step.fill``: what eviction leaves), decodes two warm-up tokens (the first outgrows the buffer),
then the measured steps: fewer than the eviction slack, so no eviction runs (between evictions).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_step_weight.py [--out figures/speed/step_weight.json]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import mlx.core as mx

from _common import FIGURES, blas_info, provenance, tiny_llama
from bench_step import budget_for_step, decode, fill, _shape
from mlx_lm.models.cache import KVCache, RotatingKVCache
from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.evaluation.labels import method_specs
from veloxquant_mlx.registry import methods

PACKAGE = str(Path(__file__).resolve().parents[1] / "veloxquant_mlx")
BASELINES = ("rotating", "kvcache")


def step_model(layers: int = 28):
    return tiny_llama(layers=layers, heads=4, kv_heads=2, head_dim=16, hidden=64, vocab=256, seed=0,
                      intermediate_size=128, max_position_embeddings=65536)


_SCORER_DIR = None


def make(model, label, T, budget, seed=0):
    """Caches of ``label`` ("rotating", "kvcache" or a registry method) at T tokens seen."""
    global _SCORER_DIR
    kvh, qh, hd = _shape(model)
    if label == "kvcache":
        caches = [KVCache() for _ in model.layers]
    elif label == "rotating":
        caches = [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    else:
        spec = method_specs([label])[0]
        cfg = spec.config(budget, seed=seed)
        if getattr(cfg.cache_class, "needs_hidden_states", False):  # kvzap: a scorer fitted for this model
            from veloxquant_mlx.evaluation.kvzap_collect import tiny_scorer

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
    caches = make(model, label, T, budget)
    y = warm(model, caches)
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        y, _ = _step(model, caches, y)
        prof.disable()
        mx.eval(y)
    st = pstats.Stats(prof).stats
    total = sum(v[0] for v in st.values())  # primitive + recursive calls
    ours = sum(v[0] for k, v in st.items() if k[0].startswith(PACKAGE))
    per = steps * len(model.layers)
    return total / per, ours / per


def _state_arrays(caches):
    out = []
    for c in caches:
        st = c.state
        for a in (st.values() if isinstance(st, dict) else st):
            if isinstance(a, mx.array):
                out.append(a)
            elif isinstance(a, (tuple, list)):
                out.extend(x for x in a if isinstance(x, mx.array))
    return out


def nodes(model, label, T, budget):
    """MLX graph primitives of one step (logits + what the caches hold after it), per layer."""
    caches = make(model, label, T, budget)
    y = warm(model, caches)
    _, logits = _step(model, caches, y)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "g.dot")
        mx.export_to_dot(path, logits, *_state_arrays(caches))
        text = Path(path).read_text()
    # Primitives are drawn as labelled rectangles; arrays (inputs included) as bare names.
    prims = len(re.findall(r'\[label ="[^"]*", shape=rectangle\]', text))
    return prims / len(model.layers)


def timing(model, labels, T, budget, rounds, steps):
    ms = {lb: [] for lb in labels}
    for lb in labels:  # warm-up (compiles, allocator)
        c = make(model, lb, T, budget)
        warm(model, c)
        decode(model, c, 4)
    for r in range(rounds):
        for lb in (labels if r % 2 == 0 else labels[::-1]):
            c = make(model, lb, T, budget, seed=r)
            warm(model, c)
            ms[lb].append(decode(model, c, steps)[0])
            del c
        print(f"  round {r + 1}/{rounds}: rotating {ms['rotating'][-1]:.2f} CPU ms/step", flush=True)
    return ms


def _spread(xs):
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--methods", nargs="*", default=None, help="registry methods (default: all)")
    ap.add_argument("--steps", type=int, default=16, help="measured steps per run (< the eviction slack)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-timing", action="store_true", help="calls and nodes only (deterministic)")
    ap.add_argument("--out", default=str(FIGURES / "speed" / "step_weight.json"))
    ap.add_argument("--note", default="")
    args = ap.parse_args(argv)
    if not 0 < args.steps < 30:
        raise SystemExit("--steps must be in 1..29: the steps must fall between evictions (slack 32, 2 warm-up)")
    names = list(args.methods or methods())
    labels = [*BASELINES, *names]
    model = step_model(args.layers)
    T, B = args.context, budget_for_step(args.density, args.context)
    rows = {}
    for lb in labels:
        total, ours = calls(model, lb, T, B, args.steps)
        rows[lb] = {"calls": round(total, 2), "calls_veloxquant": round(ours, 2), "nodes": round(nodes(model, lb, T, B), 2)}
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


if __name__ == "__main__":
    sys.exit(main())
