"""Decode speed with recall on and off, side by side in one process.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_recall_decode.py --rounds 3 \\
        --methods snapkv nexus --every 8

Per method, three caches on the same prompt (the follow-up task's first prompt, ``--length`` tokens,
``--density`` of them kept): no recall, ``recall="memory"`` (recalls at a new input only, so decode
runs the method's own code plus the gathering of what a decode-time eviction drops) and
``recall="memory", recall_every=N``. Each prefills, then decodes ``--tokens`` tokens greedily; only
the decode is timed (after one untimed warm-up run). The cells run in a rotated order each round; the figure is the median over
rounds of each cell's decode time over the same round's no-recall time (ratios within one run only).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.evaluation.provenance import command_line, provenance  # noqa: E402
from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings  # noqa: E402
from veloxquant_mlx.evaluation.tasks import build  # noqa: E402


def decode_seconds(model, tokens, config, n) -> tuple[float, int]:
    """Seconds of ``n`` decode steps after the prompt (its prefill and first token untimed), and the
    recalls the first layer ran."""
    caches = KVCacheBuilder.for_model(model, config)
    steps = generate_step(mx.array(tokens), model, max_tokens=n + 1, prompt_cache=caches)
    tok, _ = next(steps)
    mx.eval(tok)
    t0 = time.perf_counter()
    for tok, _ in steps:
        mx.eval(tok)
    dt = time.perf_counter() - t0
    return dt, caches[0].cold.recalls if caches[0].cold is not None else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--length", type=int, default=1536)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every", type=int, default=8)
    p.add_argument("--methods", nargs="+", default=["snapkv", "nexus"])
    p.add_argument("--out", default=str(ROOT / "figures" / "recall" / "decode_speed_smollm2.json"))
    args = p.parse_args(argv)
    quiet_cache_warnings()
    model, tokenizer, desc = load_eval_model(args.model)
    _, tokens = build(tokenizer, "followup", args.length, 0, 0, 2)
    budget = max(int(round(args.density * len(tokens))), 1)
    cells = {}
    for m in args.methods:
        cells[m] = KVCacheConfig(m, budget=budget)
        cells[f"{m}-recall-memory"] = KVCacheConfig(m, budget=budget, recall="memory")
        cells[f"{m}-recall-every{args.every}"] = KVCacheConfig(m, budget=budget, recall="memory",
                                                               recall_every=args.every)
    names = list(cells)
    times = {n: [] for n in names}
    recalls = {}
    decode_seconds(model, tokens, cells[names[0]], args.tokens)  # untimed: first-call compilation and caches
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            dt, recalls[n] = decode_seconds(model, tokens, cells[n], args.tokens)
            times[n].append(dt)
        print(f"round {r}: " + ", ".join(f"{n} {times[n][-1]:.2f}s" for n in names), flush=True)
    summary = {}
    for n in names:
        base = n.split("-recall-")[0]
        summary[n] = {"decode_ratio_vs_no_recall_median": round(statistics.median(
            a / b for a, b in zip(times[n], times[base])), 3), "recalls_layer0": recalls[n]}
    data = {"setting": {"model": desc, "prompt_tokens": len(tokens), "budget": budget, "decode_tokens": args.tokens,
                        "rounds": args.rounds, "recall_every": args.every, "recall_bits": 4, "recall_page": 32,
                        "recall_pages": 8, "blas": "OpenBLAS preloaded (python -m veloxquant_mlx.platform.blas)"},
            "seconds": times, "summary": summary, "provenance": provenance(command_line(), args.methods)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
