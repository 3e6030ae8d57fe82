"""H2O: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Every kept key carries its cumulative attention probability: the softmax mass it has received from
every real query so far (prefill and decode), summed over the query heads that read its KV head.
The cache keeps ``n_sink`` attention sinks, the ``recent`` newest tokens (default: half the budget,
as in the paper's 50/50 heavy-hitter/recent split) and the heavy hitters, i.e. the highest
cumulative scores among the rest. Eviction is lazy: once ``evict_every`` rows beyond the budget have
accumulated, one batched top-k brings every head back to ``budget`` rows, so memory stays bounded
through decode (peak = budget + evict_every + prefill chunk).
"""

from __future__ import annotations

import dataclasses

from ..options import option
from ..ops.h2o import attention_mass
from ..registry import register
from .base import EvictionCache


@dataclasses.dataclass
class H2OOptions:
    # Rows allowed above the budget before one eviction step runs (the paper evicts every step: 1).
    evict_every: int = option(32, low=1, small=4, doc="amortization slack: evict once this many extra rows exist")
    # Queries scored per sub-block of a prefill chunk (bounds the probability tensor in memory).
    query_block: int = option(256, low=1, doc="prefill queries per scoring sub-block")


@register("h2o")
class H2OKVCache(EvictionCache):
    """H2O: keep sinks, the recent window and the keys with the largest cumulative attention."""

    Options = H2OOptions
    needs_queries = True

    @classmethod
    def default_recent(cls, budget, options):
        return budget // 2  # H2O's default split: half heavy hitters, half recent tokens

    def extra_row_fields(self):
        return {"score": 0.0}

    def on_queries(self, queries):
        S = queries.shape[2]
        mass = attention_mass(queries, self.stored("keys"), self.stored("positions"), self.offset - S,
                              self.scale, self.options.query_block)
        r = self._rows
        self.row_extras["score"][:, :, :r] = self.stored("score") + mass

    def scores(self):
        return self.stored("score")
