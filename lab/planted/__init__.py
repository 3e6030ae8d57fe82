"""Offline synthetic planted-anomaly benchmarks for every registered eviction method.

Each scenario is a deterministic (from a seed) stream of post-RoPE-like keys, values and queries
for one "layer" of B=1, H_kv=2 KV heads, H_q=4 query heads (GQA groups of 2), head dim D=32, with a
few *planted* token positions whose fate we track. The runner drives the real cache classes exactly
as an mlx-lm model with the query tap would, per layer:

    for each step (prefill chunks of ``chunk`` tokens, then decode steps of one token):
        keys, values = cache.update_and_fetch(k, v)
        cache.observe_queries(q, scale=D ** -0.5)      # also for needs_queries=False methods
        mx.eval(cache.state)                           # what mlx-lm does after every step

and reads ``cache.kept_positions()`` at the end (and at checkpoints for survival curves). Every
scenario ends its prompt with at least one single-token step, so prefill-only methods (which
compress at the first single-token call) have compressed before anything is measured.

Scenarios (see ``docs/benchmarks.md`` for the full write-up):

* ``nested_global`` / ``nested_episodic`` / ``nested_recency``: the three NestedKV geometries
  (one planted token, anomalous against the global mean / its episodic block with the global mean
  cancelled across alternating blocks / its recent window). Queries are drawn from the same local
  distribution as the background keys, so they do *not* point at the planted token: this measures
  key-geometry anomaly detection, which attention-based scorers are not expected to have.
* ``bridge``: Nexus Thm 4.2. The last W=16 prompt queries each peak on their own distractor block
  and all give a moderate, varying mass to one hub block (never a peak).
* ``erosion``: Nexus Lemma 4.1. A long decode stream (hundreds of eviction steps) in which three
  "subtle" blocks get attention that fluctuates around the eviction cutoff (independent AR(1)
  processes), then a final query that needs them.
* ``heavy_hitters``: eight tokens every query attends to strongly (sanity floor).

Everything here is numpy (data) plus the caches' own MLX code; no model is loaded.
"""

from .report import TABLE_BEGIN, TABLE_END, markdown_tables, update_markdown
from .runner import (FAMILIES, SuiteConfig, Variant, blas_preloaded, mean_ci, method_variants, n_cells,
                     round_floats, run_once, run_suite, strip_ms, to_json)
from .scenarios import (NESTED_KINDS, Scenario, attention_probs, block_distribution, cumulative_attention,
                        make_bridge, make_erosion, make_heavy, make_nested)

__all__ = [
    "FAMILIES", "NESTED_KINDS", "TABLE_BEGIN", "TABLE_END", "Scenario", "SuiteConfig", "Variant",
    "attention_probs", "block_distribution", "blas_preloaded", "cumulative_attention", "make_bridge",
    "make_erosion", "make_heavy", "make_nested", "markdown_tables", "mean_ci", "method_variants", "n_cells",
    "round_floats", "run_once", "run_suite", "strip_ms", "to_json", "update_markdown",
]
