"""Passkey / needle retrieval on a real model under every eviction method.

Two haystacks: ``grass`` (the classic repeated filler with the "pass key" needle, from
:mod:`.passkey`) and ``text`` (real prose from the stdlib's ``pydoc_data.topics``, only paragraphs
without digits, with the needle "The magic number is N" so it cannot collide with Python words).
Two regimes: ``prefill`` (the whole prompt is one prefill chunk, so eviction happens once at the
end of the prompt) and ``decode`` (small prefill chunks, so decode-time eviction runs throughout the
prompt). For prefill-only methods (and the full cache) both regimes are the same computation; the
``decode`` cells are not re-run for them and the report marks the copied rows.
"""

from __future__ import annotations

import dataclasses
import random
import time

import mlx.core as mx

from ..caches.accounting import kv_report
from ..caches.quant import model_caches
from ..config import budget_for
from .passkey import extract_digits, make_passkey_prompt, prose_text
from .needle import key_token_spans, needle_cut_stats  # noqa: F401 (re-exported)
from .outputs import check_lengths, writes
from .speed import greedy_generate
from .results import (FULL, ResultStore, cell_id, machine_info, make_caches, method_specs,
                      quiet_cache_warnings, run_experiment)
from ..decode import greedy, last_prompt_step
from .fanout import FanOutCache, run_shared_cells, shared_pass  # noqa: F401 (FanOutCache re-exported)

MAGIC_NEEDLE = "The magic number is {key}. Remember it: the magic number is {key}. "
MAGIC_QUESTION = "\nWhat is the magic number? The magic number is"
# The two regimes are the two prompt-time policies, each run as mlx_lm.generate runs it:
# "prefill": prompt_eviction="end" (compress once when the prompt ends; generate's 2048-token chunks);
# "decode": prompt_eviction="stream" with --chunk-token prefill chunks (eviction through the prompt).
REGIME_POLICY = {"prefill": "end", "decode": "stream"}


def make_prompt(tokenizer, haystack: str, n_tokens: int, depth: float, key: str, filler_seed: int = 0):
    """(tokens, needle_position) for one passkey cell."""
    if haystack == "grass":
        return make_passkey_prompt(tokenizer, n_tokens, depth, key)
    if haystack == "text":
        # ~5 characters per token is plenty of filler; make_passkey_prompt cuts it to size.
        filler = prose_text(seed=filler_seed, min_chars=max(8 * n_tokens, 2000))
        return make_passkey_prompt(tokenizer, n_tokens, depth, key, filler=filler + " ",
                                   needle=MAGIC_NEEDLE.format(key=key), question=MAGIC_QUESTION)
    raise ValueError(f"unknown haystack {haystack!r} (grass, text)")


def shared_prefill_generate(model, tokens, named_caches: dict, max_new_tokens: int, eos_ids=(),
                            prefill_step: int = 2048, needle_spans: list | None = None,
                            kv_bits: int | None = None, kv_group_size: int = 64,
                            dequantized_prefill: bool = False) -> dict:
    """The ``prompt_eviction="end"`` regime for several cache lists with one prompt pass.

    All but the last prompt token go once, in mlx_lm.generate's chunks (``prefill_step``), through
    a full KVCache plus every cache list of ``named_caches`` ({name: per-layer caches}). Under "end"
    nothing is evicted before the prompt ends, so every list sees exactly what it would see alone.
    Then each list takes the last prompt token alone (its compression runs there) and decodes
    greedily: the tokens ``mlx_lm.generate`` gives with that list.

    Returns {name: {"tokens", "decode_s", "kv_bytes_end"} or {"error"}} plus "__full__" (the full
    cache) and "__prefill_s__". With ``needle_spans`` (:func:`key_token_spans`) each entry also has
    :func:`needle_cut_stats` of its caches after generation.

    With ``kv_bits`` every list stores 4/8-bit rows and the primary is mlx-lm's ``QuantizedKVCache``
    ("__full__" is then the full-<bits>bit cache) and the pass goes through mlx-lm's quantized
    attention, as each list would alone. ``dequantized_prefill`` reads the primary's stored rows
    dequantized through float attention instead (faster on the CPU; not what a lone run computes)."""
    full = model_caches(model, kv_bits, kv_group_size)
    x = mx.array(tokens)
    prefill_s, errors = shared_pass(model, x, full, named_caches, prefill_step, dequantized_prefill)
    out = {"__prefill_s__": prefill_s}
    rows = [("__full__", full)] + list(named_caches.items())
    firsts = {}
    for name, caches in rows:  # every list compresses before any decodes: one uncompressed copy at a time after
        if name in errors:
            continue
        try:
            t = time.perf_counter()
            firsts[name] = (last_prompt_step(model, x, caches), time.perf_counter() - t)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
    for name, caches in rows:
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        try:
            t = time.perf_counter()
            y, first_s = firsts.pop(name)
            toks = greedy(model, caches, y, max_new_tokens, eos_ids)
            out[name] = {"tokens": toks, "decode_s": time.perf_counter() - t + first_s,
                         "kv_bytes_end": kv_report(caches)["allocated_bytes"]}
            if needle_spans:
                out[name]["needle"] = needle_cut_stats(caches, needle_spans)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def make_keys(n: int, seed: int = 1234) -> list:
    rng = random.Random(seed)
    return [str(rng.randint(10_000, 99_999)) for _ in range(n)]


def _stage_cells(stage: dict, specs: dict, keys: list) -> list:
    """Prompt-major order (every method on prompt 1, then prompt 2, ...): a stage cut short by the
    time budget still compares all its methods on the same prompts."""
    cells = []
    for ctx in stage["contexts"]:
        for hay in stage["haystacks"]:
            for density in stage["densities"]:
                for depth in stage["depths"]:
                    for key in keys[:stage.get("n_keys", len(keys))]:
                        for regime in stage["regimes"]:
                            for m in stage["methods"]:
                                spec = specs[m]
                                if m == FULL and regime != "prefill":
                                    continue  # full cache: regime-independent, run once
                                if regime == "decode" and spec.prefill_only:
                                    continue  # identical to the prefill regime (report copies it)
                                for seed in (stage.get("seeds", [0]) if spec.method == "nexus" else [0]):
                                    d = None if m == FULL else density
                                    p = {"haystack": hay, "context": ctx, "depth": depth, "key": key,
                                         "density": d, "regime": regime, "method": m, "seed": seed}
                                    cells.append((cell_id(exp="passkey", **p), p))
    return cells


def spread_order(cells: list, keys: list) -> list:
    """Reorder prompts (methods of one prompt stay together, in order) so that every prefix of the
    run is balanced: key by key, depths in a golden-ratio sequence (each prefix spreads over (0, 1)),
    haystacks and contexts alternating. A run cut short then still covers every haystack and depth."""
    depths = sorted({p["depth"] for _, p in cells})
    golden = {d: (i * 0.6180339887498949) % 1.0 for i, d in enumerate(depths)}

    def rank(t):
        p = t[1]
        return (keys.index(p["key"]) if p["key"] in keys else len(keys), golden[p["depth"]])

    return sorted(cells, key=rank)  # stable: stage / haystack / context order kept within a rank


def default_plan(specs: dict, quick: bool) -> list:
    """Stages in priority order; the runner walks them in this order and stops on the time budget."""
    allm = list(specs)
    few = [m for m in ("nexus", "h2o", "snapkv", "streaming") if m in specs]
    dec = [m for m in allm if not specs[m].prefill_only]
    depths = [0.1, 0.5, 0.9]
    if quick:
        return [{"name": "quick", "contexts": [640], "haystacks": ["grass", "text"], "densities": [0.2, 0.5],
                 "regimes": ["prefill", "decode"], "methods": allm, "depths": [0.5], "n_keys": 1}]
    base = {"contexts": [1024], "depths": depths, "n_keys": 3}
    text_few = [m for m in (FULL, "nexus", "h2o", "snapkv", "streaming") if m in specs]
    return [
        {**base, "name": "A: grass 1K, 20%, prefill-only, all methods", "haystacks": ["grass"], "densities": [0.2],
         "regimes": ["prefill"], "methods": allm},
        {**base, "name": "B: grass 1K, 20%, prefill+decode, decode-evicting methods", "haystacks": ["grass"],
         "densities": [0.2], "regimes": ["decode"], "methods": dec},
        {**base, "name": "C: nexus reservoir seeds 1-2, grass 1K, 20%, both regimes", "haystacks": ["grass"],
         "densities": [0.2], "regimes": ["prefill", "decode"], "methods": ["nexus"], "seeds": [1, 2]},
        {**base, "name": "D: text 1K, 20%, prefill-only, full + few methods", "haystacks": ["text"],
         "densities": [0.2], "regimes": ["prefill"], "methods": text_few},
        {**base, "name": "E: grass 1K, 10% and 50%, both regimes, few methods", "haystacks": ["grass"],
         "densities": [0.1, 0.5], "regimes": ["prefill", "decode"], "methods": few},
        {**base, "name": "F: text 1K, 20%, both regimes, all methods", "haystacks": ["text"], "densities": [0.2],
         "regimes": ["prefill", "decode"], "methods": allm},
        {**base, "name": "G: grass 2K, 20%, both regimes, all methods", "contexts": [2048], "haystacks": ["grass"],
         "densities": [0.2], "regimes": ["prefill", "decode"], "methods": allm},
    ]


@dataclasses.dataclass(frozen=True)
class PasskeySettings:
    """Which cells ``eval passkey`` runs: the default plan, or a custom grid when any of contexts,
    densities, haystacks, regimes, depths or methods is set, or the stages of ``plan``."""

    quick: bool = False
    methods: tuple | None = None
    contexts: tuple | None = None
    densities: tuple | None = None
    haystacks: tuple | None = None
    regimes: tuple | None = None
    depths: tuple | None = None
    n_keys: int = 3
    out_name: str = "passkey.json"  # result file inside the output folder
    seeds: tuple | None = None  # Nexus reservoir seeds (custom grid)
    chunk: int = 256  # prefill chunk of the prefill + decode regime
    max_new_tokens: int = 8
    spread: bool = False  # prompt order balanced for partial runs (spread_order)
    prefill_first: bool = False  # every prefill-regime cell before the decode regime
    shared_prefill: bool = True  # prefill regime: one shared single-chunk pass per prompt
    plan: tuple | None = None  # a script's own stages (dicts as default_plan gives)
    dequantized_prefill: bool = False  # quantized shared passes read dequantized rows (not exact)


def run(model, tokenizer, settings: PasskeySettings, control, desc: str = "") -> int:
    quiet_cache_warnings()
    a = settings
    quick = a.quick
    specs = {s.name: s for s in method_specs(a.methods)}
    if FULL not in specs:
        specs = {FULL: method_specs([FULL])[0], **specs}
    keys = make_keys(max(a.n_keys, 1))
    custom = any(v is not None for v in (a.contexts, a.densities, a.haystacks, a.regimes, a.depths))
    if a.plan:
        plan = [dict(st) for st in a.plan]
    elif custom or a.methods:
        plan = [{"name": "custom", "contexts": list(a.contexts or ([640] if quick else [1024])),
                 "haystacks": list(a.haystacks or ["grass"]), "densities": list(a.densities or [0.2]),
                 "regimes": list(a.regimes or ["prefill", "decode"]), "methods": list(specs),
                 "depths": list(a.depths or [0.1, 0.5, 0.9]), "n_keys": a.n_keys, "seeds": list(a.seeds or [0])}]
    else:
        plan = default_plan(specs, quick)
    check_lengths(model, sorted({c for st in plan for c in st["contexts"]}), "--contexts", headroom=max(a.max_new_tokens, 1))
    cells, seen = [], set()
    for stage in plan:
        for cid, p in _stage_cells(stage, specs, keys):
            if cid not in seen:
                seen.add(cid)
                p["stage"] = stage["name"]
                cells.append((cid, p))
    if a.spread:
        cells = spread_order(cells, keys)
    if a.prefill_first:
        cells.sort(key=lambda t: t[1]["regime"] != "prefill")  # stable: priority kept within each regime
    max_new = a.max_new_tokens
    grid = {"plan": plan, "keys": keys, "max_new_tokens": max_new, "prefill_step_decode_regime": a.chunk,
            "n_cells": len(cells),
            "stage_counts": {st["name"]: sum(1 for _, p in cells if p["stage"] == st["name"]) for st in plan},
            "needles": {"grass": "The pass key is N. Remember it. N is the pass key.",
                                               "text": MAGIC_NEEDLE.format(key="N").strip()}}
    store = ResultStore(f"{control.out_dir}/{a.out_name}", "passkey", write=writes(control))
    store.update_meta(meta={"model": desc, "machine": machine_info(), "quick": quick}, grid=grid)
    prompts = {}
    eos = tuple(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None)
    def _record(p, toks, pos, budget, step, spec, tokens_out, prefill_s, decode_s, kv_end, shared, needle=None):
        text = tokenizer.decode(tokens_out)
        answer = extract_digits(text)
        return {**(needle or {}), **p, "prompt_tokens": len(toks), "needle_pos": pos, "budget": budget, "prefill_step": step,
                "prefill_only_method": spec.prefill_only, "output": text, "answer": answer,
                "correct": answer == p["key"], "prefill_s": round(prefill_s, 3), "decode_s": round(decode_s, 3),
                "kv_bytes_end": kv_end, "shared_prefill": shared}

    def run_group(p, toks, pos, quant):
        """Prefill-only regime: every unfinished prefill cell of this prompt that stores its rows as
        ``quant`` ((kv_bits, kv_group_size); bits None = float rows) in one shared pass."""
        prompt = (p["haystack"], p["context"], p["depth"], p["key"])
        done = store.done()
        group = [(cid, q) for cid, q in cells if q["regime"] == "prefill" and cid not in done
                 and specs[q["method"]].quant == quant and specs[q["method"]].mlx_cache is None
                 and (q["haystack"], q["context"], q["depth"], q["key"]) == prompt]
        group = [(cid, q) for cid, q in group if store.claim(cid)]  # skip cells another worker holds
        named, budgets, errs = {}, {}, {}
        for cid, q in group:
            spec = specs[q["method"]]
            if spec.method is None:
                continue
            budgets[cid] = budget_for(q["density"], len(toks))
            try:
                named[cid] = make_caches(model, spec, budgets[cid], seed=q["seed"])
            except Exception as e:
                errs[cid] = f"{type(e).__name__}: {e}"
        spans = key_token_spans(tokenizer, toks, pos, p["key"])
        out = shared_prefill_generate(model, toks, named, max_new, eos_ids=eos, needle_spans=spans,
                                      kv_bits=quant[0], kv_group_size=quant[1],
                                      dequantized_prefill=a.dequantized_prefill)
        pre = out["__prefill_s__"]
        recs = {}
        for cid, q in group:
            spec = specs[q["method"]]
            r = out["__full__"] if spec.method is None else out.get(cid, {"error": errs.get(cid, "not run")})
            if cid in errs:
                r = {"error": errs[cid]}
            if "error" in r:
                recs[cid] = {**q, "error": r["error"], "prefill_only_method": spec.prefill_only}
            else:
                recs[cid] = _record(q, toks, pos, budgets.get(cid, len(toks)), 2048, spec, r["tokens"],
                                    pre, r["decode_s"], r["kv_bytes_end"], True, r.get("needle"))
            recs[cid]["group_size"] = len(group)
            if quant[0] is not None:
                recs[cid]["quant_prefill"] = "dequantized" if a.dequantized_prefill else "exact"
        return recs

    def run_one(p):
        k = (p["haystack"], p["context"], p["depth"], p["key"])
        if k not in prompts:
            prompts[k] = make_prompt(tokenizer, *k)
        toks, pos = prompts[k]
        spec = specs[p["method"]]
        my = cell_id(exp="passkey", **{f: p[f] for f in ("haystack", "context", "depth", "key", "density",
                                                          "regime", "method", "seed")})
        # One shared pass per prompt and row storage: quantized caches attend over their quantized
        # rows from the first chunk on (what mlx_lm.generate does), so they share a quantized pass.
        if p["regime"] == "prefill" and a.shared_prefill and spec.mlx_cache is None:  # rotating: its own pass
            return run_shared_cells(store, my, lambda: run_group(p, toks, pos, spec.quant))
        budget = len(toks) if spec.is_full else budget_for(p["density"], len(toks))
        caches = make_caches(model, spec, budget, seed=p["seed"], prompt_eviction=REGIME_POLICY[p["regime"]])
        step = 2048 if p["regime"] == "prefill" else a.chunk
        r = greedy_generate(model, toks, caches, max_new, step, eos_ids=eos)
        needle = needle_cut_stats(caches, key_token_spans(tokenizer, toks, pos, p["key"]))
        return _record(p, toks, pos, budget, step, spec, r["tokens"], r["prefill_s"], r["decode_s"],
                       r["kv_bytes_end"], False, needle)

    return run_experiment(store, cells, run_one, control)
