"""Recallable eviction on the follow-up task, paired against the same method without recall.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_recall.py --prompts 6 --length 1536 \\
        --density 0.2 --methods nexus snapkv --tiers none memory disk

Each prompt is the ``followup`` task of ``veloxquant_mlx.evaluation.tasks`` with two facts: turn 1
asks one, turn 2 the other, on the same cache (what ``serve``'s multi-turn reuse does). Every cache
list sees the same prompt (one shared prefill under ``prompt_eviction="end"``, as ``eval tasks``
runs it) and the same later turns. Per cell: each turn's correctness, the resident KV bytes after the
prompt and after the last turn (``kv_report``, which counts the cold tier's resident part) with the
byte split of ``byte_report``, and each later turn's prefill time (which includes the recall: the
paired ratio against no recall is the recall's cost; OpenBLAS preloaded, ratios within one run only).
Results are written after every prompt, and a re-run skips the prompts already in the file.
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

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig  # noqa: E402
from veloxquant_mlx.caches.accounting import kv_report  # noqa: E402
from veloxquant_mlx.caches.quant import model_caches  # noqa: E402
from veloxquant_mlx.evaluation.provenance import command_line, provenance  # noqa: E402
from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings  # noqa: E402
from veloxquant_mlx.evaluation.task_eval import run_prompt  # noqa: E402
from veloxquant_mlx.evaluation.tasks import build  # noqa: E402


def label(method: str, tier: str) -> str:
    return method if tier == "none" else f"{method}-recall-{tier}"


def cold_split(caches) -> dict:
    keys = ("hot_bytes", "cold_resident_bytes", "cold_disk_bytes", "summary_bytes")
    out = dict.fromkeys(keys, 0)
    for c in caches:
        r = c.byte_report() if hasattr(c, "byte_report") else {}
        for k in keys:
            out[k] += r.get(k, 0)
    return out


def summarize(data: dict) -> dict:
    """Per label: prompts, turn-1 / turn-2 correct counts, all turns right; the paired turn-2 prefill
    ratio (recall over the same method without it, median over prompts); mean resident bytes."""
    rows = data["prompts"]
    labels = sorted({n for r in rows for n in r["cells"]})
    out = {}
    for n in labels:
        cells = [r["cells"][n] for r in rows if "turns" in r["cells"].get(n, {})]
        if not cells:
            continue
        s = {"prompts": len(cells),
             "turn_correct": [sum(c["turns"][k]["correct"] for c in cells) for k in range(len(cells[0]["turns"]))],
             "all_turns": sum(all(t["correct"] for t in c["turns"]) for c in cells),
             "resident_bytes_end": statistics.mean(c["resident_bytes_end"] for c in cells)}
        base = n.split("-recall-")[0]
        if base != n:
            ratios = [r["cells"][n]["turns"][1]["turn_prefill_s"] / r["cells"][base]["turns"][1]["turn_prefill_s"]
                      for r in rows if "turns" in r["cells"].get(n, {}) and "turns" in r["cells"].get(base, {})]
            s["turn2_prefill_ratio_median"] = round(statistics.median(ratios), 3) if ratios else None
            lost = sum(1 for r in rows if "turns" in r["cells"].get(n, {}) and "turns" in r["cells"].get(base, {})
                       and any(b["correct"] and not a["correct"]
                               for a, b in zip(r["cells"][n]["turns"], r["cells"][base]["turns"])))
            s["turns_lost_vs_no_recall"] = lost
        out[n] = s
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bundled")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--length", type=int, default=1536)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--methods", nargs="+", default=["nexus", "snapkv"])
    p.add_argument("--tiers", nargs="+", default=["none", "memory", "disk"], choices=["none", "memory", "disk"])
    p.add_argument("--recall-bits", type=int, default=4)
    p.add_argument("--recall-pages", type=int, default=8)
    p.add_argument("--recall-page", type=int, default=32)
    p.add_argument("--quantized-baseline", action="store_true",
                   help="also run mlx-lm's QuantizedKVCache(bits=4, group 32) holding everything ('full-4bit')")
    p.add_argument("--out", default=str(ROOT / "figures" / "recall" / "followup_smollm2.json"))
    args = p.parse_args(argv)
    quiet_cache_warnings()
    model, tokenizer, desc = load_eval_model(args.model)
    eos = tuple(sorted(set(getattr(tokenizer, "eos_token_ids", None) or ())
                       | {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}))
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {"prompts": []}
    done = {r["index"] for r in data["prompts"]}
    setting = {"model": desc, "task": "followup", "n_facts": 2, "length": args.length, "density": args.density,
               "prompt_eviction": "end", "recall_bits": args.recall_bits, "recall_page": args.recall_page,
               "recall_pages": args.recall_pages, "methods": args.methods, "tiers": args.tiers,
               "quantized_baseline": "QuantizedKVCache(bits=4, group_size=32)" if args.quantized_baseline else None,
               "blas": "OpenBLAS preloaded (python -m veloxquant_mlx.platform.blas)"}
    for index in range(args.start, args.start + args.prompts):
        if index in done:
            continue
        from mlx_lm.models.cache import make_prompt_cache

        inst, tokens = build(tokenizer, "followup", args.length, index, 0, 2)
        budget = max(int(round(args.density * len(tokens))), 1)
        named = {"full": (make_prompt_cache(model), False)}
        if args.quantized_baseline:  # its prompt attends over its own 4-bit rows: its own prefill
            named["full-4bit"] = (model_caches(model, 4, 32), True)
        for m in args.methods:
            for tier in args.tiers:
                extra = {} if tier == "none" else {"recall": tier, "recall_bits": args.recall_bits,
                                                   "recall_page": args.recall_page, "recall_pages": args.recall_pages}
                named[label(m, tier)] = (KVCacheBuilder.for_model(model, KVCacheConfig(m, budget=budget, **extra)),
                                         False)
        held = {n: c for n, (c, _) in named.items()}  # run_prompt frees its references as it goes
        t0 = time.perf_counter()
        res = run_prompt(model, tokenizer, inst, tokens, named, shared=True, eos_ids=eos)
        for n, r in res.items():
            if "turns" in r:
                r["resident_bytes_end"] = kv_report(held[n])["allocated_bytes"]
                r.update(cold_split(held[n]))
        del held
        data["prompts"].append({"index": index, "prompt_tokens": len(tokens), "budget": budget,
                                "expected": [list(t.expected) for t in inst.turns], "cells": res,
                                "seconds": round(time.perf_counter() - t0, 1)})
        data["prompts"].sort(key=lambda r: r["index"])
        data["setting"] = setting
        data["summary"] = summarize(data)
        data["provenance"] = provenance(command_line(), ["full", *args.methods])
        data["provenance"]["note"] = ("the fingerprints cover each method without recall; the recall code is at "
                                      "the commit named")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        s = data["summary"]
        print(f"prompt {index}: " + "; ".join(f"{n} {v['turn_correct']}" for n, v in s.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
