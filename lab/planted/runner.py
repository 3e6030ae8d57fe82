"""Planted-anomaly runner: drive the real cache classes through each scenario stream exactly as an
mlx-lm model with the query tap would, over every method variant x budget x seed; deterministic JSON."""

from __future__ import annotations

import dataclasses
import json
import math
import time
import warnings
from typing import Callable

import mlx.core as mx
import numpy as np

from veloxquant_mlx.platform.blas import openblas_preloaded
from veloxquant_mlx.config import KVCacheConfig, budget_for
from veloxquant_mlx.caches import EvictionCache
from veloxquant_mlx.config_spec import parse_spec
from veloxquant_mlx.registry import get_method, methods as registered_methods
from .scenarios import (D, H_KV, H_Q, NESTED_KINDS, SCALE, Scenario, attention_probs, make_bridge,
                        make_erosion, make_heavy, make_nested)

ROUND = 4  # decimals kept in the JSON


# --------------------------------------------------------------------------------------------
# Methods under test
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    method: str
    options: tuple = ()  # sorted (name, value) pairs
    config: tuple = ()  # extra KVCacheConfig keyword arguments

    def make_config(self, budget: int, seed: int) -> KVCacheConfig:
        return KVCacheConfig(method=self.method, budget=budget, seed=seed, options=dict(self.options),
                             **dict(self.config))


# Ada-KV head-adaptive allocation is run on top of the scores the Nexus paper pairs it with.
ADA_METHODS = ("snapkv", "pyramidkv")
# The suite's own labels (its published JSON is keyed by them), as method specs (config_spec).
ABLATIONS = {"nexus_topk": "nexus:n_samples=none", "nexus_nowalk": "nexus:lam=0.0"}


def variant(label: str, spec: str) -> Variant:
    """The variant a method spec describes (``variant("nexus_topk", "nexus:n_samples=none")``)."""
    method, core, options = parse_spec(spec)
    return Variant(label, method, tuple(sorted(options.items())), tuple(sorted(core.items())))


def method_variants() -> list[Variant]:
    """Every registered method with its defaults, the Nexus ablations when "nexus" is registered,
    and Ada-SnapKV / Ada-PyramidKV ("<m>+ada") when the class supports ``"ada"``."""
    names = sorted(registered_methods())
    out = [variant(m, m) for m in names]
    if "nexus" in names:
        out += [variant(label, spec) for label, spec in ABLATIONS.items()]
    for m in ADA_METHODS:
        if m in names and get_method(m).supports_allocation("ada"):
            out.append(variant(f"{m}+ada", f"{m}:allocation=ada"))
    return out


# --------------------------------------------------------------------------------------------
# Runner
# --------------------------------------------------------------------------------------------


def _make_caches(config: KVCacheConfig, n_layers: int) -> list:
    caches = []
    for layer in range(n_layers):
        c = EvictionCache(config, layer_idx=layer, n_layers=n_layers)
        c.tap_active = True  # as KVCacheBuilder.for_model sets it for a model with the query tap
        c.queries_from_keys = False
        caches.append(c)
    return caches


def _retention(kept: list, positions: np.ndarray) -> float:
    """Mean over (layer, head) of the fraction of ``positions`` kept."""
    vals = []
    for arr in kept:
        for h in range(arr.shape[1]):
            vals.append(np.isin(positions, arr[0, h]).mean())
    return float(np.mean(vals))


def run_once(sc: Scenario, config: KVCacheConfig, n_layers: int = 2) -> dict:
    """Drive fresh caches (one per layer, same data in every layer) through the scenario stream."""
    caches = _make_caches(config, n_layers)
    K = mx.array(sc.keys[None])
    V = mx.array(sc.values[None])
    Q = mx.array(sc.queries[None])
    steps = [(s, min(s + sc.chunk, sc.prompt_len)) for s in range(0, sc.prompt_len, sc.chunk)]
    steps += [(t, t + 1) for t in range(sc.prompt_len, sc.total_len)]
    curve_steps, curve_vals = [], []
    target = sc.planted[sc.target]
    for i, (s, e) in enumerate(steps):
        for c in caches:
            c.update_and_fetch(K[:, :, s:e], V[:, :, s:e])
            c.observe_queries(Q[:, :, s:e], SCALE)
            mx.eval(c.state)
        dec = e - sc.prompt_len  # decode steps done (0 at the end of the prompt's prefill chunks)
        if sc.checkpoint_every and dec > 0 and (dec % sc.checkpoint_every == 0 or e == sc.total_len):
            kept = [np.array(c.kept_positions()) for c in caches]
            curve_steps.append(dec)
            curve_vals.append(_retention(kept, target))
    kept = [np.array(c.kept_positions()) for c in caches]
    out = {"retention": {label: _retention(kept, pos) for label, pos in sc.planted.items()},
           "kept_tokens": float(np.mean([(k >= 0).sum(-1).mean() for k in kept])),
           "evictions": float(np.mean([c.evictions for c in caches]))}
    if curve_steps:
        out["curve"] = (curve_steps, curve_vals)
    if sc.recall_query:
        probs = attention_probs(sc.keys, sc.queries, [sc.total_len - 1])[:, 0]  # (Hq, T)
        group = H_Q // H_KV
        rec = []
        for k in kept:
            for hq in range(H_Q):
                pos = k[0, hq // group]
                rec.append(probs[hq, pos[pos >= 0]].sum())
        out["recall"] = float(np.mean(rec))
    return out


_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
         10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 19: 2.093, 29: 2.045}


def mean_ci(xs) -> tuple:
    """Mean and 95% Student-t interval over seeds (clipped to [0, 1]); a point when n = 1."""
    xs = np.asarray(xs, float)
    m = float(xs.mean())
    if len(xs) < 2:
        return m, [m, m]
    dfree = len(xs) - 1
    t = _T975.get(dfree) or _T975[min(_T975, key=lambda k: abs(k - dfree))]
    half = t * xs.std(ddof=1) / math.sqrt(len(xs))
    return m, [max(0.0, m - half), min(1.0, m + half)]


@dataclasses.dataclass
class SuiteConfig:
    """What to run. ``quick()`` and ``full()`` are the CLI presets."""

    seeds: tuple = (0, 1, 2, 3, 4)
    n_layers: int = 2
    nested_small: tuple = (320, 512)
    nested_small_budgets: tuple = (16, 24, 128)
    nested_paper: tuple = (4096, 8192, 16384)
    nested_paper_density: float = 0.2
    nested_paper_fixed: tuple = ()  # extra fixed budgets at paper scale (default: 20% density only)
    bridge_budgets: tuple = (192, 320, 448, 640)
    erosion_decode: int = 6400
    erosion_budgets: tuple = (256,)
    heavy_n: int = 2048
    heavy_budgets: tuple = (256, 512)
    only: tuple = ()  # scenario families to run (empty: all)

    @classmethod
    def full(cls, **kw):
        return cls(**kw)

    @classmethod
    def quick(cls, **kw):
        base = dict(seeds=(0, 1), nested_small=(320,), nested_small_budgets=(16, 128), nested_paper=(4096,),
                    bridge_budgets=(320, 640), erosion_decode=640, heavy_n=1024, heavy_budgets=(256,))
        base.update(kw)
        return cls(**base)


FAMILIES = ("nested_small", "nested_paper", "bridge", "erosion", "heavy_hitters")


def _scenario_specs(cfg: SuiteConfig) -> list:
    """(family, scenario key, budgets, generator(seed)) in a fixed order."""
    specs = []
    for kind in NESTED_KINDS:
        for n in cfg.nested_small:
            specs.append(("nested_small", f"nested_{kind}_N{n}", list(cfg.nested_small_budgets),
                          lambda s, k=kind, n=n: make_nested(k, n, s)))
    for kind in NESTED_KINDS:
        for n in cfg.nested_paper:
            budgets = sorted({budget_for(cfg.nested_paper_density, n)} | set(cfg.nested_paper_fixed))
            specs.append(("nested_paper", f"nested_{kind}_N{n}", budgets,
                          lambda s, k=kind, n=n: make_nested(k, n, s, n_decode=8)))
    specs.append(("bridge", "bridge_N1024", list(cfg.bridge_budgets), lambda s: make_bridge(s)))
    specs.append(("erosion", f"erosion_T{cfg.erosion_decode}", list(cfg.erosion_budgets),
                  lambda s: make_erosion(s, n_decode=cfg.erosion_decode)))
    specs.append(("heavy_hitters", f"heavy_N{cfg.heavy_n}", list(cfg.heavy_budgets),
                  lambda s: make_heavy(s, n=cfg.heavy_n)))
    if cfg.only:
        unknown = set(cfg.only) - set(FAMILIES)
        if unknown:
            raise ValueError(f"unknown scenario family {sorted(unknown)}; known: {list(FAMILIES)}")
        specs = [s for s in specs if s[0] in cfg.only]
    return specs


def _json_info(x):
    if isinstance(x, dict):
        return {k: _json_info(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_info(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x


def run_suite(cfg: SuiteConfig, variants: list[Variant] | None = None,
              progress: Callable[[str], None] | None = None) -> dict:
    """Run every scenario x variant x budget x seed; return the JSON-able results dict.

    A variant that raises (bad config for that budget, or a runtime error) gets ``"error"`` in
    that cell and the run continues. ``progress(label)`` is called once per finished cell.
    """
    variants = method_variants() if variants is None else variants
    t_start = time.perf_counter()
    out = {"scenarios": {}, "errors": [], "variants": {v.label: {"method": v.method,
                                                                "options": {k: val for k, val in v.options},
                                                                "config": {k: val for k, val in v.config}}
                                                      for v in variants},
           "suite": {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()},
           "geometry": {"B": 1, "H_kv": H_KV, "H_q": H_Q, "head_dim": D, "n_layers": cfg.n_layers,
                        "scale": "1/sqrt(D)"}}
    for family, key, budgets, gen in _scenario_specs(cfg):
        t0 = time.perf_counter()
        scen = {s: gen(s) for s in cfg.seeds}
        first = scen[cfg.seeds[0]]
        entry = {"family": family, "target": first.target, "prompt_len": first.prompt_len,
                 "decode_steps": first.total_len - first.prompt_len, "chunk": first.chunk,
                 "budgets": budgets, "planted_counts": {k: int(len(v)) for k, v in first.planted.items()},
                 "info_by_seed": {str(s): _json_info(scen[s].info) for s in cfg.seeds},
                 "cells": {}, "generate_ms": 1000 * (time.perf_counter() - t0)}
        for v in variants:
            cells = {}
            for b in budgets:
                cell = {}
                tc = time.perf_counter()
                per_seed = []
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        for s in cfg.seeds:
                            per_seed.append(run_once(scen[s], v.make_config(b, s), cfg.n_layers))
                except Exception as e:  # noqa: BLE001 - record and continue
                    msg = f"{type(e).__name__}: {e}"
                    cell["error"] = msg
                    out["errors"].append({"scenario": key, "variant": v.label, "budget": b, "error": msg})
                if per_seed and "error" not in cell:
                    ret = [r["retention"][first.target] for r in per_seed]
                    m, ci = mean_ci(ret)
                    cell.update({"retention_mean": m, "retention_ci95": ci, "retention_per_seed": ret,
                                 "kept_tokens_mean": float(np.mean([r["kept_tokens"] for r in per_seed])),
                                 "evictions_mean": float(np.mean([r["evictions"] for r in per_seed]))})
                    for label in first.planted:
                        if label != first.target:
                            cell[f"retention_{label}_mean"] = float(np.mean([r["retention"][label] for r in per_seed]))
                    if "recall" in per_seed[0]:
                        rec = [r["recall"] for r in per_seed]
                        rm, rci = mean_ci(rec)
                        cell.update({"recall_mean": rm, "recall_ci95": rci})
                    if "curve" in per_seed[0]:
                        steps = per_seed[0]["curve"][0]
                        cell["survival"] = {"decode_step": steps,
                                            "retention_mean": np.mean([r["curve"][1] for r in per_seed], 0).tolist()}
                cell["wall_ms"] = 1000 * (time.perf_counter() - tc)
                cells[str(b)] = cell
                if progress:
                    progress(f"{key} {v.label} b={b}")
            entry["cells"][v.label] = cells
        out["scenarios"][key] = entry
    out["total_ms"] = 1000 * (time.perf_counter() - t_start)
    return out


def n_cells(cfg: SuiteConfig, variants: list[Variant] | None = None) -> int:
    variants = method_variants() if variants is None else variants
    return sum(len(b) for _, _, b, _ in _scenario_specs(cfg)) * len(variants)


# --------------------------------------------------------------------------------------------
# Deterministic JSON
# --------------------------------------------------------------------------------------------


def round_floats(x):
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return None
        r = round(x, ROUND)
        return 0.0 if r == 0 else r
    if isinstance(x, dict):
        return {str(k): round_floats(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [round_floats(v) for v in x]
    if isinstance(x, np.generic):
        return round_floats(x.item())
    return x


def to_json(results: dict) -> str:
    """Sorted keys, floats rounded to 4 decimals: byte-identical across runs except ``*_ms``."""
    return json.dumps(round_floats(results), sort_keys=True, indent=1) + "\n"


def strip_ms(x):
    """Drop every field whose name ends in ``_ms`` (for determinism comparisons)."""
    if isinstance(x, dict):
        return {k: strip_ms(v) for k, v in x.items() if not str(k).endswith("_ms")}
    if isinstance(x, list):
        return [strip_ms(v) for v in x]
    return x


def blas_preloaded() -> bool:
    """Whether an optimized OpenBLAS was preloaded into this process (LD_PRELOAD)."""
    return bool(openblas_preloaded())
