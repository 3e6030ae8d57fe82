"""Streaming perplexity: real text fed chunk by chunk through each eviction cache.

Every chunk of ``chunk`` tokens is fed as ``chunk - 1`` tokens in one call followed by its last
token as a single-token call. Decode-evicting methods evict whenever they exceed budget + slack;
prefill-only methods compress at every single-token call (i.e. once per chunk), so every method is
bounded throughout the stream. The NLL of each token is taken from the logits computed with the
cache as it was at that moment. Budget = density x sequence length.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

from ..config import budget_for
from ..decode import token_nll
from .passkey import prose_text
from .outputs import writes
from .results import (FULL, ResultStore, cell_id, machine_info, make_caches, method_specs,
                      quiet_cache_warnings, run_experiment)


def text_tokens(tokenizer, n_tokens: int) -> list:
    # Digits allowed here (normal prose statistics); a different shuffle from the haystacks.
    ids = tokenizer.encode(prose_text(seed=11, min_chars=12 * n_tokens + 1000, allow_digits=True))
    if len(ids) < n_tokens + 1:
        raise ValueError(f"corpus too short: {len(ids)} tokens < {n_tokens + 1}")
    return ids[:n_tokens + 1]


def streaming_nll(model, tokens, caches, chunk: int) -> list:
    """Per-token NLL (nats) of tokens[1:], feeding tokens[:-1] through ``caches`` chunk by chunk."""
    import mlx.core as mx

    x = mx.array(tokens)
    n = len(tokens) - 1
    nll = []
    for i in range(0, n, chunk):
        j = min(i + chunk, n)
        for a, b in [(i, j - 1), (j - 1, j)] if j - i > 1 else [(i, j)]:
            nll.extend(token_nll(model, x[a:b], x[a + 1:b + 1], caches))
    return nll


@dataclasses.dataclass(frozen=True)
class PerplexitySettings:
    """Which cells ``eval perplexity`` runs (None: the default for the model size)."""

    quick: bool = False  # the tiny harness-check model: smaller defaults, every method at every density
    methods: tuple | None = None
    n_tokens: int | None = None  # tokens scored (default 2048; quick 640)
    chunk: int | None = None  # stream chunk (default 128; quick 64)
    densities: tuple | None = None  # default: 0.2 for every method, 0.1 and 0.5 for a few


def run(model, tokenizer, settings: PerplexitySettings, control, desc: str = "") -> int:
    quiet_cache_warnings()
    quick = settings.quick
    n_tokens = settings.n_tokens or (640 if quick else 2048)
    chunk = settings.chunk or (64 if quick else 128)
    specs = {s.name: s for s in method_specs(settings.methods)}
    if settings.densities:
        dens_all, dens_few = list(settings.densities), []
    else:
        dens_all, dens_few = [0.2], [0.1, 0.5]
    few = [m for m in ("nexus", "h2o", "snapkv", "streaming", "morphkv") if m in specs]
    cid = functools.partial(cell_id, exp="ppl", n_tokens=n_tokens, chunk=chunk)
    cells = [(cid(method=FULL, density=None), {"method": FULL, "density": None, "seed": 0})]
    for d in dens_all:
        for m in specs:
            if m != FULL:
                cells.append((cid(method=m, density=d), {"method": m, "density": d, "seed": 0}))
    for d in dens_few:
        for m in (list(specs) if quick else few):
            if m != FULL:
                cells.append((cid(method=m, density=d), {"method": m, "density": d, "seed": 0}))
    toks = text_tokens(tokenizer, n_tokens)
    grid = {"n_tokens": n_tokens, "chunk": chunk, "densities_all_methods": dens_all,
            "densities_few_methods": dens_few, "few_methods": few,
            "text": "stdlib pydoc_data.topics prose (code blocks removed)", "n_cells": len(cells)}
    store = ResultStore(f"{control.out_dir}/perplexity.json", "perplexity", write=writes(control))
    store.update_meta(meta={"model": desc, "machine": machine_info(), "quick": quick}, grid=grid)

    def run_one(p):
        spec = specs[p["method"]] if p["method"] in specs else method_specs([p["method"]])[0]
        budget = n_tokens if spec.method is None else budget_for(p["density"], n_tokens)
        # Streaming perplexity scores every chunk as it arrives: eviction runs through the text.
        caches = make_caches(model, spec, budget, seed=p["seed"], prompt_eviction="stream")
        t = time.perf_counter()
        nll = streaming_nll(model, toks, caches, chunk)
        half = len(nll) // 2
        mean = sum(nll) / len(nll)
        late = sum(nll[half:]) / len(nll[half:])
        return {"budget": budget, "n_tokens": n_tokens, "chunk": chunk, "nll": mean, "ppl": math.exp(mean), "nll_second_half": late,
                "ppl_second_half": math.exp(late), "tokens_scored": len(nll),
                "nll_by_chunk": [round(sum(nll[i:i + chunk]) / len(nll[i:i + chunk]), 4)
                                 for i in range(0, len(nll), chunk)],
                "seconds": round(time.perf_counter() - t, 2)}

    return run_experiment(store, cells, run_one, control)
