"""Shared plumbing of the real-model evaluation: method specs, model loading and the resumable JSON
cell store (the report generated from the JSON files is ``report.py``).

Every experiment (passkey, perplexity, speed) is a list of *cells*; a cell has a string id built
from its grid coordinates. Finished cells are written to ``<out_dir>/<experiment>.json`` one at a
time (file lock + atomic replace), so a run can be killed at any moment and resumed, and several
worker processes (``--shard i/n``) can fill the same file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import time
import warnings
from typing import Any
from pathlib import Path

from ..builder import KVCacheBuilder
from ..caches.quant import model_caches
from ..config import METHOD_DEFAULT, KVCacheConfig
from ..registry import FULL, get_method, methods
from .eval_model import ByteTokenizer, load_eval_model, machine_info, tiny_model  # noqa: F401 (re-exported)


# Nexus ablations run next to every registry method: top-K instead of the reservoir, and no walk.
ABLATIONS = {
    "nexus-topk": ("nexus", {"n_samples": None}),
    "nexus-nowalk": ("nexus", {"lam": 0.0, "prompt_top_k": False}),  # the walk's ablation as measured: on the reservoir
}


# Opt-in Nexus options (only when named with --methods): remedies for the needle's block-boundary cut.
# The Nexus ablations pin prompt_top_k=False: they were measured against the reservoir default (until
# 2026-12-01), so a label keeps meaning what its published cells ran.
OPT_IN_ABLATIONS = {
    "nexus-smooth": ("nexus", {"smooth_blocks": 1, "prompt_top_k": False}),
    "nexus-prior": ("nexus", {"key_prior": 0.5, "prompt_top_k": False}),
    "nexus-prior1": ("nexus", {"key_prior": 1.0, "prompt_top_k": False}),  # the anomaly prior alone (no attention)
    "nexus-b16": ("nexus", {"block_size": 16, "prompt_top_k": False}),
    "nexus-prompt-topk": ("nexus", {"prompt_top_k": True}),  # = nexus's default since 2026-12-01; kept for old runs
    "nexus-reservoir": ("nexus", {"prompt_top_k": False}),  # the paper: the reservoir at the one-shot step too
    "kvzip-global": ("kvzip", {"layers": "global"}),  # = kvzip's default since the head-budget change; kept for old runs
}


DEFAULT_OUT_DIR = "figures/eval"  # the published grid: written only with --publish


USER_OUT_DIR = "veloxquant_eval"  # a user's run goes here unless --out-dir says otherwise


DEFAULT_RESULTS_MD = "docs/results.md"


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One column of the comparison: a label, the registry method (None = full cache), options."""

    name: str
    method: str | None
    options: tuple = ()  # sorted (key, value) pairs, hashable
    # "ada": Ada-KV budget allocation across heads (label "<method>-ada"); unset: the method's default
    allocation: Any = METHOD_DEFAULT
    # Further KVCacheConfig fields, sorted (key, value) pairs: kv_bits (label suffix "-4bit" / "-8bit";
    # for the full cache, mlx-lm's QuantizedKVCache), kv_group_size (suffix "-g32" / "-g128", after the
    # bits), max_head_factor (label suffix "-nocap": None), floor_alpha (Ada-KV's per-head floor).
    extra: tuple = ()
    # mlx-lm's own eviction a user would pick instead ("rotating": RotatingKVCache(max_size=budget)); method None
    mlx_cache: str | None = None

    @property
    def is_full(self) -> bool:
        """The full cache (mlx-lm's KVCache, or its QuantizedKVCache for ``full-4bit``): no budget."""
        return self.method is None and self.mlx_cache is None

    @property
    def kv_bits(self):
        return dict(self.extra).get("kv_bits")

    @property
    def quant(self) -> tuple:
        """(kv_bits, kv_group_size): how the rows are stored (bits None = float rows)."""
        e = dict(self.extra)
        return (e.get("kv_bits"), e.get("kv_group_size", 64) if e.get("kv_bits") else 64)

    @property
    def opts(self) -> dict:
        return dict(self.options)

    @property
    def prefill_only(self) -> bool:
        """True when the method compresses only once at the end of the prompt (or is the full cache):
        then the prefill + decode regime is identical to the prefill-only one."""
        if self.method is None:
            return True
        return bool(getattr(get_method(self.method), "prefill_only", False))


def method_specs(names=None, ablations: bool = True) -> list:
    """Full cache + every registry method (read at run time) + the Nexus ablations.

    ``names`` restricts / orders the list (labels such as ``"nexus-topk"`` allowed; ``"<method>-ada"``
    is the method with Ada-KV allocation, for methods that support it; opt-in only)."""
    specs = {FULL: MethodSpec(FULL, None)}
    for m in methods():
        specs[m] = MethodSpec(m, m)
    if ablations and "nexus" in specs:
        for label, (m, opts) in ABLATIONS.items():
            specs[label] = MethodSpec(label, m, tuple(sorted(opts.items())))
    if names is None:
        return list(specs.values())
    for m in methods():
        if get_method(m).supports_allocation("ada"):
            specs.setdefault(m + _ADA, MethodSpec(m + _ADA, m, allocation="ada"))
    if ablations and "nexus" in specs:
        for label, (m, opts) in OPT_IN_ABLATIONS.items():
            specs.setdefault(label, MethodSpec(label, m, tuple(sorted(opts.items()))))
    if "kvzip" in specs:
        # kvzip's default is the paper's head budgets with our per-head cap; "kvzip-paper" drops the cap
        # (exactly the paper), "kvzip-each" is the library's per-layer uniform contract (the old default).
        specs.setdefault("kvzip-paper", MethodSpec("kvzip-paper", "kvzip", extra=(("max_head_factor", None),)))
        specs.setdefault("kvzip-each", MethodSpec("kvzip-each", "kvzip", (("layers", "each"),), allocation="uniform"))
        specs.setdefault("kvzip-plus", MethodSpec("kvzip-plus", "kvzip", (("normalize", "plus"),)))  # KVzip+
    specs.setdefault(ROTATING, MethodSpec(ROTATING, None, mlx_cache=ROTATING))
    out = []
    for n in names:
        base, extra = n, {}
        while base not in specs and base.endswith(tuple(_CONFIG_SUFFIXES)):
            suffix = next(x for x in _CONFIG_SUFFIXES if base.endswith(x))
            base, extra = base[:-len(suffix)], {**_CONFIG_SUFFIXES[suffix], **extra}
        if base not in specs or (specs[base].method is None and set(extra) - {"kv_bits", "kv_group_size"}) or (
                specs[base].mlx_cache and extra):
            raise ValueError(f"unknown method {n!r}; known: {', '.join(specs)} (each may end in "
                             f"{', '.join(_CONFIG_SUFFIXES)})")
        spec = specs[base]
        out.append(dataclasses.replace(spec, name=n, extra=tuple(sorted({**dict(spec.extra), **extra}.items())))
                   if extra else spec)
    return out


def pinned_options(label: str) -> dict | None:
    """The method options a figure label pins (``nexus-reservoir`` -> {"prompt_top_k": False}), for its
    fingerprint key; None for a plain method or a label this code does not know."""
    try:
        spec = method_specs([label])[0]
    except ValueError:
        return None
    return dict(spec.options) or None


# Label suffixes that set KVCacheConfig fields: quantized kept rows, and the specs' own per-head bound.
# "-4bit" pins the groups of 64 its published cells ran with (the library's 4-bit default is now 32).
_CONFIG_SUFFIXES = {"-4bit": {"kv_bits": 4, "kv_group_size": 64}, "-8bit": {"kv_bits": 8}, "-nocap": {"max_head_factor": None},
                    "-g32": {"kv_group_size": 32}, "-g128": {"kv_group_size": 128}}


def make_caches(model, spec: MethodSpec, budget: int, seed: int = 0, prompt_eviction: str = "end"):
    """Fresh per-layer caches: mlx-lm's KVCache for the full cache, else the eviction cache with
    ``prompt_eviction`` ("end": compress when the prompt ends; "stream": also at every chunk)."""
    if spec.mlx_cache == ROTATING:
        return rotating_caches(model, budget)
    if spec.method is None:  # "full-4bit": mlx-lm's own quantized cache, no eviction
        return model_caches(model, *spec.quant)
    config = KVCacheConfig(method=spec.method, budget=int(budget), seed=int(seed), options=spec.opts,
                           allocation=spec.allocation, prompt_eviction=prompt_eviction, **dict(spec.extra))
    return KVCacheBuilder.for_model(model, config)


ROTATING = "rotating"


def rotating_caches(model, budget: int) -> list:
    """What ``mlx_lm.generate --max-kv-size budget`` gives: ``RotatingKVCache(max_size=budget, keep=4)``
    per layer (a model's own sliding-window layers keep their caches; mlx-lm's make_prompt_cache
    ignores max_kv_size for a model with make_cache, so the plain KVCache layers are swapped here)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    return [RotatingKVCache(max_size=int(budget), keep=4) if type(c) is KVCache else c
            for c in make_prompt_cache(model)]


def quiet_cache_warnings():
    """Chunked feeding after a single-token step is intended here; silence that advisory."""
    warnings.filterwarnings("ignore", message=".*receives a new prompt.*")


def cell_id(**coords) -> str:
    return "|".join(f"{k}={coords[k]}" for k in coords)


class ResultStore:
    """``{experiment, meta, grid, cells: {id: record}}`` in one JSON file, safe for several writers."""

    def __init__(self, path, experiment: str, write: bool = True):
        self.path = Path(path)
        self.experiment = experiment
        self.write = write  # False: a dry run (--max-cells 0) reads the file and never touches the disk
        if write:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self):
        if not self.write:
            yield
            return
        lock = self.path.with_suffix(self.path.suffix + ".lock")
        with open(lock, "a+") as fh:
            try:
                import fcntl

                fcntl.flock(fh, fcntl.LOCK_EX)
            except ImportError:  # pragma: no cover - non-POSIX
                pass
            yield

    def load(self) -> dict:
        if self.path.exists():
            try:
                return json.loads(self.path.read_text())
            except json.JSONDecodeError:
                warnings.warn(f"{self.path} is corrupt; starting it afresh (old file kept as .bad)")
                os.replace(self.path, self.path.with_suffix(".json.bad"))
        return {"experiment": self.experiment, "meta": {}, "grid": {}, "cells": {}}

    def _write(self, data):
        if not self.write:
            return
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=_json_default))
        os.replace(tmp, self.path)

    def done(self) -> set:
        return set(self.load()["cells"])

    def put(self, cid: str, record: dict):
        with self._locked():
            data = self.load()
            data["cells"][cid] = record
            data.get("claims", {}).pop(cid, None)
            self._write(data)

    def claim(self, cid: str) -> bool:
        """Mark ``cid`` as being run by this process; False if finished or claimed by a live process
        (so several workers can walk the same priority list without duplicating cells)."""
        with self._locked():
            data = self.load()
            if cid in data["cells"]:
                return False
            c = data.setdefault("claims", {}).get(cid)
            if c and c.get("pid") != os.getpid() and c.get("host") == platform.node() and _alive(c.get("pid")):
                return False
            data["claims"][cid] = {"pid": os.getpid(), "host": platform.node(), "t": now()}
            self._write(data)
            return True

    def fingerprint_keys(self, data: dict) -> list:
        """The fingerprint keys the file's cells depend on: each cell's label (and the labels of a
        speed cell's caches) with the setting it ran and the method options the label pins."""
        from .provenance import key_of

        cells = [c for c in data["cells"].values() if isinstance(c, dict)]
        # passkey's "decode" regime and streaming perplexity run prompt_eviction="stream"
        stream = {"decode": True, None: self.experiment == "perplexity"}
        runs = {(c["method"], "stream" if stream.get(c.get("regime"), False) else "end") for c in cells if "method" in c}
        runs |= {(m, "end") for c in cells for m in c.get("caches", ())}
        options = {label: pinned_options(label) for label in {label for label, _ in runs}}  # once per label
        return sorted({key_of(label, regime, options[label]) for label, regime in runs})

    def stamp(self):
        """Provenance for the methods of every cell in the file (stale when it extends cells of other code)."""
        from .provenance import command_line, provenance, resumed

        with self._locked():
            data = self.load()
            new = provenance(command_line(), self.fingerprint_keys(data) or None)
            data["provenance"] = resumed(data["provenance"], new) if "provenance" in data else new
            self._write(data)

    def update_meta(self, meta: dict | None = None, grid: dict | None = None, run: dict | None = None):
        with self._locked():
            data = self.load()
            if meta:
                data["meta"].update(meta)
            if grid is not None:
                data["grid"] = grid
            if run is not None:
                data.setdefault("runs", []).append(run)
            self._write(data)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def run_cells(store: ResultStore, cells: list, run_one, *, shard=(0, 1), time_budget: float | None = None,
              max_cells: int | None = None, desc: str = "", progress: bool = True) -> dict:
    """Run every unfinished cell of this shard (in list order = priority order), storing each.

    ``cells`` is a list of (cell_id, params) pairs; ``run_one(params)`` returns the record; an
    exception becomes ``{"error": ...}`` for that cell. Stops starting new cells after
    ``time_budget`` seconds. Returns counts.
    """
    from tqdm import tqdm

    i, n = shard
    mine = [(cid, p) for k, (cid, p) in enumerate(cells) if k % n == i]
    done = store.done()
    todo = [(cid, p) for cid, p in mine if cid not in done]
    if max_cells is not None:
        todo = todo[:max_cells]
    t0 = time.perf_counter()
    ran = errors = 0
    stopped = False
    # cells done / total over the whole grid (a resumed run starts where the file is), ETA from this run's pace
    bar = tqdm(total=len(mine), initial=sum(1 for cid, _ in mine if cid in done), desc=desc or store.experiment,
               disable=not progress, dynamic_ncols=True, unit="cell")
    for cid, params in todo:
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            stopped = True
            break
        if not store.claim(cid):  # finished or being run by another worker meanwhile
            bar.update(1)
            continue
        c0 = time.perf_counter()
        try:
            rec = run_one(params)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a method that raises is an error for its cell, not a crash
            rec = {"error": f"{type(e).__name__}: {e}"}
            errors += 1
        rec = {**params, **rec, "cell_s": round(time.perf_counter() - c0, 3), "finished": now()}
        store.put(cid, rec)
        ran += 1
        bar.update(1)
        bar.set_postfix_str(cid[-60:])
    bar.close()
    return {"planned": len(mine), "skipped_done": len(mine) - len(todo) if max_cells is None else
            sum(1 for cid, _ in mine if cid in done), "ran": ran, "errors": errors,
            "stopped_by_time_budget": stopped, "wall_s": round(time.perf_counter() - t0, 1)}


def run_experiment(store: ResultStore, cells: list, run_one, control) -> int:
    """The end of every ``eval`` harness: run the unfinished cells with ``control``'s shard / time
    budget / max-cells / progress (:class:`.outputs.RunControl`), record the run in the JSON's meta,
    print the counts."""
    if not store.write:
        mine = [cid for k, (cid, _) in enumerate(cells) if k % control.shard[1] == control.shard[0]]
        done = store.done()
        print(f"{store.experiment}: {len(mine)} cells planned in {store.path}, {sum(c in done for c in mine)} "
              f"finished, {sum(c not in done for c in mine)} to run; --max-cells 0: nothing written")
        return 0
    res = run_cells(store, cells, run_one, shard=control.shard, time_budget=control.time_budget,
                    max_cells=control.max_cells, desc=store.experiment, progress=control.progress)
    store.update_meta(run={"finished": now(), "shard": list(control.shard), **res})
    store.stamp()
    print(f"{store.experiment}: {res}")
    return 0


_ADA = "-ada"  # label suffix of a method run with Ada-KV allocation


def _is_ada(name) -> bool:
    return name.endswith(_ADA)


def _ada_base(name) -> str:
    """The uniform-allocation method of an Ada label ("snapkv-ada" -> "snapkv"); other names unchanged."""
    return name[:-len(_ADA)] if _is_ada(name) else name
