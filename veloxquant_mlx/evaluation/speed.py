"""Speed & memory: prefill / decode tokens per second, peak memory and KV bytes for mlx-lm's
``KVCache``, ``RotatingKVCache(max_size=budget, keep=4)`` and every eviction method at one density.

Runs are paired and interleaved: round r runs every cache once (in a rotated order) for each
context, so slow drifts of a shared CPU hit all caches alike; the report takes medians over rounds.
:func:`greedy_generate` is one timed prefill + greedy decode through :mod:`veloxquant_mlx.decode`.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from ..caches.accounting import kv_report
from ..config import budget_for
from ..decode import decode_steps, feed_prompt, greedy, last_prompt_step, prefill  # noqa: F401 (re-exported)
from .fanout import shared_pass
from .passkey import prose_text
from .outputs import check_lengths, writes
from .results import (FULL, ResultStore, cell_id, machine_info, make_caches, method_specs,
                      quiet_cache_warnings, run_experiment)
from .task_eval import needs_own_prefill


def greedy_generate(model, tokens, caches, max_new_tokens: int, prefill_step: int, eos_ids=()) -> dict:
    """Feed ``tokens`` as mlx_lm.generate does (all but the last in chunks of ``prefill_step``, then the
    last one alone), then decode greedily: the same tokens as ``mlx_lm.generate`` with these caches. Prefill time ends when the first new token is computed; decode time covers the
    remaining ``max_new_tokens - 1`` single-token steps (no early stop, so timings are comparable
    unless ``eos_ids`` is given)."""
    import mlx.core as mx

    n = len(tokens)
    t0 = time.perf_counter()
    y = prefill(model, mx.array(tokens), caches, prefill_step)
    t1 = time.perf_counter()
    kv_prefill = kv_report(caches)
    out = greedy(model, caches, y, max_new_tokens, eos_ids)
    t2 = time.perf_counter()
    kv_end = kv_report(caches)
    nd = len(out) - 1
    return {"tokens": out, "prefill_s": t1 - t0, "decode_s": t2 - t1, "prefill_tps": n / (t1 - t0),
            "decode_tps": nd / (t2 - t1) if nd else None, "decode_tokens": nd,
            "kv_bytes_after_prefill": kv_prefill["allocated_bytes"], "kv_bytes_end": kv_end["allocated_bytes"],
            "kv_kept_bytes_end": kv_end["kept_bytes"], "kv_full_bytes_end": kv_end["full_bytes"]}


def _prompt(tokenizer, n_tokens: int) -> list:

    text = prose_text(seed=7)
    ids = tokenizer.encode(text)
    while len(ids) < n_tokens:
        ids = ids + ids
    return ids[:n_tokens]


def _make(model, name, specs, budget):
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    if name == "kvcache":
        return make_prompt_cache(model)
    if name == "rotating":
        return [RotatingKVCache(max_size=budget, keep=4) for _ in model.layers]
    if name not in specs:
        raise ValueError(f"unknown cache {name!r}")
    return make_caches(model, specs[name], budget)


def measure_group(model, tokens, names, specs, budget, decode_tokens, repeats, prefill_step, rotate=0,
                  shared: bool = False) -> dict:
    """Paired, interleaved measurement of several caches on one prompt.

    Each cache is prefilled once (its prefill tok/s and prefill peak memory over the baseline), and
    all caches are kept alive; then ``repeats`` rounds each decode ``decode_tokens`` more tokens on
    every cache in a rotated order, so the decode tok/s of the caches are measured side by side and
    the KV bytes are seen growing (or not) with the decode length. With ``shared`` the caches that
    compress once at the prompt's end share one prompt pass (:func:`_shared_prefill`); the others
    (rotating, quantized, own-prefill methods) prefill alone."""
    import mlx.core as mx

    order = names[rotate % len(names):] + names[:rotate % len(names)]
    live, out = {}, {}
    n = len(tokens)
    x = mx.array(tokens)
    alone = order
    if shared:
        sharers = [m for m in order if m == "kvcache" or (m in specs and not needs_own_prefill(specs[m]))]
        alone = [m for m in order if m not in sharers]
        _shared_prefill(model, x, sharers, specs, budget, prefill_step, live, out)
    for name in alone:
        rec = out[name] = {}
        try:
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            caches = _make(model, name, specs, budget)
            t0, c0 = time.perf_counter(), time.process_time()
            y = prefill(model, x, caches, prefill_step)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            kv = kv_report(caches)
            peak = mx.get_peak_memory()
            rec.update(prefill_s=dt, prefill_tps=n / dt, prefill_cpu_s=dc, peak_memory_bytes=peak - base,
                       process_peak_bytes=peak, active_before_bytes=base,
                       kv_bytes_after_prefill=kv["allocated_bytes"], kv_kept_bytes_after_prefill=kv["kept_bytes"],
                       segments=[])
            live[name] = [caches, y]
        except Exception as e:  # a method that raises is an error for its cache, not a crash
            rec["error"] = f"{type(e).__name__}: {e}"
    for r in range(repeats):
        for name in order[r % len(order):] + order[:r % len(order)]:
            if name not in live:
                continue
            caches, y = live[name]
            try:
                before = mx.get_active_memory()
                mx.reset_peak_memory()
                t0, c0 = time.perf_counter(), time.process_time()
                y = decode_steps(model, caches, y, decode_tokens)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                live[name][1] = y
                kv = kv_report(caches)
                # CPU time as well as wall time: on a shared machine the wall clock mostly measures the
                # share of the cores this process got; CPU seconds per token are what the cache costs.
                out[name]["segments"].append({"decode_tps": decode_tokens / dt, "kv_bytes": kv["allocated_bytes"],
                                              "decode_cpu_tps": decode_tokens / dc if dc > 0 else None,
                                              "decode_peak_bytes": mx.get_peak_memory() - before,
                                              "kv_kept_bytes": kv["kept_bytes"], "kv_full_bytes": kv["full_bytes"]})
            except Exception as e:
                out[name]["error"] = f"{type(e).__name__}: {e}"
                live.pop(name)
    for name, rec in out.items():
        segs = rec.get("segments") or []
        if segs:
            rec["decode_tps"] = statistics.median(s["decode_tps"] for s in segs)
            if all(s.get("decode_cpu_tps") for s in segs):
                rec["decode_cpu_tps"] = statistics.median(s["decode_cpu_tps"] for s in segs)
            rec["kv_bytes_end"] = segs[-1]["kv_bytes"]
            rec["kv_full_bytes_end"] = segs[-1]["kv_full_bytes"]
            rec["kv_kept_bytes_end"] = segs[-1]["kv_kept_bytes"]
            rec["decode_tokens_total"] = decode_tokens * len(segs)
            rec["decode_peak_memory_bytes"] = max(s["decode_peak_bytes"] for s in segs)
    for name, (_, y) in live.items():  # after timing: the last decoded token, to compare runs
        out[name]["last_token"] = int(y.item())
    live.clear()
    return out


def _shared_prefill(model, x, names, specs, budget, prefill_step, live, out):
    """One prompt pass (:func:`.fanout.shared_pass`) into every cache of ``names``, ``kvcache``'s being
    the one attention reads; then each cache takes the last prompt id alone (it compresses there).
    Prefill time, CPU time and peak memory are the shared pass's, the same in every record."""
    import mlx.core as mx

    from mlx_lm.models.cache import make_prompt_cache

    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    made = {}
    for name in names:
        try:
            made[name] = _make(model, name, specs, budget)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    primary = made.pop("kvcache", None) or make_prompt_cache(model)
    t0, c0 = time.perf_counter(), time.process_time()
    _, errors = shared_pass(model, x, primary, made, prefill_step)
    if "kvcache" in names and "kvcache" not in out:
        made = {"kvcache": primary, **made}
    firsts = {}
    for name, caches in made.items():
        if name in errors:
            out[name] = {"error": errors[name]}
            continue
        try:
            firsts[name] = last_prompt_step(model, x, caches)
        except Exception as e:
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    peak = mx.get_peak_memory()
    for name, y in firsts.items():
        kv = kv_report(made[name])
        out[name] = dict(prefill_s=dt, prefill_tps=x.shape[0] / dt, prefill_cpu_s=dc, prefill_shared=True,
                         peak_memory_bytes=peak - base, process_peak_bytes=peak, active_before_bytes=base,
                         kv_bytes_after_prefill=kv["allocated_bytes"], kv_kept_bytes_after_prefill=kv["kept_bytes"],
                         segments=[])
        live[name] = [made[name], y]


CORE = ["kvcache", "rotating", "nexus"]


@dataclasses.dataclass(frozen=True)
class SpeedSettings:
    """Which caches and contexts ``eval speed`` measures (None: the default)."""

    quick: bool = False
    methods: tuple | None = None  # default CORE (+ a group of every other method at the first context)
    contexts: tuple | None = None  # prompt lengths (default 1024 2048 4096; quick 640)
    density: float = 0.2
    decode_tokens: int | None = None  # per round (default 32; quick 8)
    repeats: int = 3
    prefill_step: int = 256
    shared_prefill: bool = False  # one prompt pass per context for the caches that compress at its end


def run(model, tokenizer, settings: SpeedSettings, control, desc: str = "") -> int:
    quiet_cache_warnings()
    quick = settings.quick
    store = ResultStore(f"{control.out_dir}/speed.json", "speed", write=writes(control))
    density = settings.density
    decode_tokens = settings.decode_tokens if settings.decode_tokens is not None else (8 if quick else 32)
    repeats = settings.repeats
    prefill_step = settings.prefill_step
    contexts = list(settings.contexts or ([640] if quick else [1024, 2048, 4096]))
    core = list(settings.methods or CORE)
    specs = {s.name: s for s in method_specs()}
    specs.update({s.name: s for s in method_specs([n for n in core if n not in specs and n not in ("kvcache", "rotating")])})
    check_lengths(model, contexts, "--contexts", headroom=decode_tokens * repeats + 1)
    groups = [("core", n, core) for n in contexts]
    if not settings.methods and not settings.contexts:
        others = [m for m in specs if m not in (FULL, "nexus")]
        groups.append(("others", contexts[0], ["kvcache", "rotating"] + others))  # rotating: the limit
    cells = []
    for k, (g, n, names) in enumerate(groups):
        p = {"group": g, "context": n, "caches": names, "rotate": k}
        cells.append((cell_id(exp="speed", group=g, context=n, caches=",".join(names), density=density,
                              decode=decode_tokens, repeats=repeats, step=prefill_step), p))
    grid = {"groups": [{"group": g, "context": n, "caches": names} for g, n, names in groups],
            "density": density, "decode_tokens_per_segment": decode_tokens, "repeats": repeats,
            "prefill_step": prefill_step, "timing": "decode_tps / prefill_tps: wall clock; decode_cpu_tps / "
            "prefill_cpu_s: this process's CPU time (time.process_time), robust to a shared machine", "prompt_text": "pydoc_data.topics prose",
            "design": "per context: every cache prefilled once, all kept alive, then `repeats` interleaved "
                      "rounds of `decode_tokens` decode steps per cache (rotated order); decode tok/s = "
                      "median over rounds, prefill tok/s = one sample", "n_cells": len(cells)}
    store.update_meta(meta={"model": desc, "machine": machine_info(), "quick": quick,
                            "shared_prefill": settings.shared_prefill}, grid=grid)
    prompts = {}

    def run_one(p):
        n = p["context"]
        if n not in prompts:
            prompts[n] = _prompt(tokenizer, n)
        budget = budget_for(density, n)
        res = measure_group(model, prompts[n], p["caches"], specs, budget, decode_tokens, repeats, prefill_step,
                            rotate=p["rotate"], shared=settings.shared_prefill)
        return {"budget": budget, "per_cache": res}

    return run_experiment(store, cells, run_one, control)
