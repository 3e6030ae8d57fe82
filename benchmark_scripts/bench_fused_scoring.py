"""H2O with one attention pass (the layer's output from the scoring pass's own weights) against two
(scoring pass + mlx-lm's fused kernel), and against mlx-lm's KVCache, on the bundled SmolLM2.

Prefill: the prompt fed as ``mlx_lm.generate`` does (chunks of 2048, state evaluated after each, the
last token alone: H2O's one-shot compression runs there). Decode: ``--decode`` greedy tokens after it.
Rounds run every cache once, order reversed every other round; ratios are paired within a round and
use this process's CPU time (a shared machine disturbs wall time far more; wall is recorded too).

  python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_fused_scoring.py --contexts 2048,4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.evaluation.speed import _prompt, greedy_continue, prefill  # noqa: E402

CACHES = ("kvcache", "h2o-fused", "h2o-separate")


def make(model, label, budget):
    from mlx_lm.models.cache import make_prompt_cache

    if label == "kvcache":
        return make_prompt_cache(model)
    mode = label.split("-")[1]
    return KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=budget, h2o_attention_pass=mode))


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - w


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "figures/speed/fused_scoring.json"))
    a = ap.parse_args(argv)
    from bench_step_cost import provenance  # same folder

    from veloxquant_mlx.platform.blas import blas_info
    from veloxquant_mlx.evaluation.results import machine_info
    from veloxquant_mlx.models import load_model

    model, tok = load_model(None)
    result = {"provenance": provenance(argv, ["full", "h2o"]) | {"command": "python -m veloxquant_mlx.platform.blas "
                                                "benchmark_scripts/bench_fused_scoring.py " + " ".join(argv)},
              "machine": machine_info(), "blas": blas_info(), "model": "bundled SmolLM2-135M (fp32)",
              "settings": {"density": a.density, "decode_tokens": a.decode, "rounds": a.rounds,
                           "prefill_step": 2048, "prompt_eviction": "end"}, "runs": []}
    for T in [int(t) for t in a.contexts.split(",") if t]:
        x = mx.array(_prompt(tok, T))
        budget = int(T * a.density)
        rec = {c: {"prefill_cpu_s": [], "prefill_wall_s": [], "decode_cpu_s": [], "decode_wall_s": []}
               for c in CACHES}
        for c in CACHES:  # warm-up on a short prompt (allocator, compiled graphs)
            prefill(model, x[:512], make(model, c, 128), 2048)
        for r in range(a.rounds):
            for c in (CACHES if r % 2 == 0 else CACHES[::-1]):
                caches = make(model, c, budget)
                y, pc, pw = timed(lambda: prefill(model, x, caches, 2048))
                _, dc, dw = timed(lambda: greedy_continue(model, caches, y, a.decode + 1))
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
        result["runs"].append({"context": T, "budget": budget, "times": rec, "summary": summary})
        print(json.dumps(summary), flush=True)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
