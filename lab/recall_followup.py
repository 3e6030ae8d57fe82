"""Recallable eviction on the follow-up task, paired against the same method without recall
(``bench_quality.py recall``, figures/recall/followup*.json).

Each prompt is the ``followup`` task of :mod:`.tasks` with 2-4 facts: turn 1 asks one, every later turn
another, on the same cache (what ``serve``'s multi-turn reuse does). Every cache list sees the same
prompt (one shared prefill under ``prompt_eviction="end"``, as ``eval tasks`` runs it) and the same
later turns. Per cell: each turn's correctness, the resident KV bytes after the last turn (``kv_report``,
which counts the cold tier's resident part) with its byte split, and each later turn's prefill time
(which includes the recall: the paired ratio against no recall, per turn, is the recall's cost).
"""

from __future__ import annotations

import statistics
import time

from veloxquant_mlx.builder import KVCacheBuilder
from veloxquant_mlx.caches.accounting import COLD_KEYS, kv_report
from veloxquant_mlx.caches.quant import model_caches
from veloxquant_mlx.config import budget_for
from .provenance import resumed
from veloxquant_mlx.evaluation.task_run import run_prompt
from veloxquant_mlx.evaluation.tasks import build

TIERS = ("none", "memory", "disk", "memory-hold", "disk-hold")


def label(method: str, tier: str) -> str:
    """The row name of ``method`` with cold tier ``tier`` (``none``: the method itself)."""
    return method if tier == "none" else f"{method}-recall-{tier}"


def recall_options(tier: str, bits: int, page: int, pages: int, every: int | None = None) -> dict:
    """KVCacheConfig fields of one tier: ``memory`` / ``disk``, ``-hold`` for recall_hold=True; with
    ``every``, a memory tier that also recalls every N decode steps."""
    if tier == "none":
        return {}
    kind, _, hold = tier.partition("-")
    return {"recall": kind, "recall_bits": bits, "recall_page": page, "recall_pages": pages,
            **({"recall_hold": True} if hold else {}), **({"recall_every": every} if every else {})}


def prompt_caches(model, specs: dict, tiers, budget: int, bits: int, page: int, pages: int,
                  every: int | None = None, quantized_baseline: bool = False) -> dict:
    """{label: (caches, own prefill?)} for one prompt: the full cache, optionally mlx-lm's 4-bit
    QuantizedKVCache (its prompt attends over its own 4-bit rows, so it prefills alone), and every
    method of ``specs`` ({name: MethodSpec}) at ``budget`` with each tier (and ``every<N>``)."""
    from mlx_lm.models.cache import make_prompt_cache

    named = {"full": (make_prompt_cache(model), False)}
    if quantized_baseline:
        named["full-4bit"] = (model_caches(model, 4, 32), True)
    for m, spec in specs.items():
        for tier in tiers:
            cfg = spec.config(budget, **recall_options(tier, bits, page, pages))
            named[label(m, tier)] = (KVCacheBuilder.for_model(model, cfg), False)
        if every:
            cfg = spec.config(budget, **recall_options("memory", bits, page, pages, every))
            named[label(m, f"every{every}")] = (KVCacheBuilder.for_model(model, cfg), False)
    return named


def run_followup_prompt(model, tokenizer, index: int, length: int, facts: int, density: float,
                        make_caches, eos_ids=()) -> dict:
    """One prompt's record: its turns' expected answers and, per label of ``make_caches(budget)``,
    every turn's outcome with the resident bytes after the last turn and their cold split."""
    inst, tokens = build(tokenizer, "followup", length, index, 0, facts)
    budget = budget_for(density, len(tokens))
    named = make_caches(budget)
    held = {n: c for n, (c, _) in named.items()}  # run_prompt frees its references as it goes
    t0 = time.perf_counter()
    res = run_prompt(model, tokenizer, inst, tokens, named, shared=True, eos_ids=eos_ids)
    for n, r in res.items():
        if "turns" in r:
            report = kv_report(held[n])
            r["resident_bytes_end"] = report["allocated_bytes"]
            r.update({k: report.get(k, 0) for k in COLD_KEYS})
    return {"index": index, "prompt_tokens": len(tokens), "budget": budget,
            "expected": [list(t.expected) for t in inst.turns], "cells": res,
            "seconds": round(time.perf_counter() - t0, 1)}


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
        if base != n:  # paired per prompt: this row's turns beside the same method's without recall
            pairs = [list(zip(r["cells"][n]["turns"], r["cells"][base]["turns"])) for r in rows
                     if "turns" in r["cells"].get(n, {}) and "turns" in r["cells"].get(base, {})]
            ratios = [[a["turn_prefill_s"] / b["turn_prefill_s"] for a, b in turns[1:]] for turns in pairs]
            s["turn2_prefill_ratio_median"] = round(statistics.median(t[0] for t in ratios), 3) if ratios else None
            if any(len(t) > 1 for t in ratios):  # three or more turns: every later turn's ratio too
                s["later_turns_prefill_ratio_median"] = round(statistics.median(x for t in ratios for x in t), 3)
            s["turns_lost_vs_no_recall"] = sum(any(b["correct"] and not a["correct"] for a, b in turns)
                                               for turns in pairs)
        out[n] = s
    return out


def stamp_recall_provenance(old: dict | None, new: dict) -> dict:
    """The provenance of a recall file after another prompt: ``new``, marked stale when the prompts it
    extends came from code with other fingerprints (``provenance.resumed``), and naming the commit the
    file's first prompt ran at when that differs (the recall code is named by its commit only)."""
    prov = resumed(old, new) if old else dict(new)
    first = (old or {}).get("first_commit") or (old or {}).get("commit")
    if first and first != new.get("commit"):
        prov["first_commit"] = first
    prov["note"] = ("the fingerprints cover each method without recall; the recall code is at the commit "
                    "named (first_commit: where the file's first prompt ran)")
    return prov
