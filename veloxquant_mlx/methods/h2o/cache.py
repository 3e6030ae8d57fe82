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

from ...options import option
import mlx.core as mx

from ...ops.attention import fused_scoring_default
from .ops import all_visible_mass, all_visible_mass_out, attention_mass
from ...registry import register
from ...caches.base import EvictionCache


@dataclasses.dataclass
class H2OOptions:
    # Rows allowed above the budget before one eviction step runs (the paper evicts every step: 1).
    evict_every: int = option(32, low=1, small=4, doc="amortization slack: evict once this many extra rows exist")
    # Queries scored per sub-block of a prefill chunk (bounds the probability tensor in memory).
    query_block: int = option(256, low=1, doc="prefill queries per scoring sub-block")
    # One attention pass: the layer's output from the scoring pass's own weights ("auto": on the CPU,
    # where it is faster; docs/performance.md), or the scoring pass plus mlx-lm's fused kernel.
    attention_pass: str = option("auto", choices=("auto", "fused", "separate"),
                                 doc="layer output from the scoring weights (fused) or a second attention pass")


@register("h2o")
class H2OKVCache(EvictionCache):
    """H2O: keep sinks, the recent window and the keys with the largest cumulative attention."""

    Options = H2OOptions
    needs_queries = True
    attention_mass_field = "score"  # what on_queries accumulates (the paged prompt computes it over its file too)

    @classmethod
    def default_recent(cls, budget, options):
        return budget // 2  # H2O's default split: half heavy hitters, half recent tokens

    def extra_row_fields(self):
        return {"score": 0.0}

    def on_queries(self, queries):
        S = queries.shape[2]
        args = (queries, self.stored("keys"), self.stored("positions"), self.offset - S, self.scale,
                self.options.query_block)
        # One query over storage without padding: every stored row is in its past, no mask needed.
        kw = {"all_visible": S == 1 and not self.is_ragged}
        if self.one_pass(self.options.attention_pass):  # the rows stored now are the rows update_and_fetch returned
            mass, self.attend.out = attention_mass(*args, values=self.stored("values"), **kw)
        else:
            mass = attention_mass(*args, **kw)
        r = self._rows
        self.row_extras["score"][:, :, :r] = self.stored("score") + mass

    def refresh_light(self):
        super().refresh_light()
        mode = self.options.attention_pass
        self._fused = mode == "fused" or (mode == "auto" and fused_scoring_default())
        self._scale = None if self.scale is None else mx.array(self.scale, mx.float32)

    def on_light_queries(self, queries, attend):
        """on_queries of the light step: one query over fp storage; uniform storage scores without a mask."""
        if self._light_ragged:
            a = self.attend
            a.active = attend
            self.on_queries(queries)
            a.active, out, a.out = False, a.out, None
            return out
        r = self._rows
        k, score = self.keys[:, :, :r], self.row_extras["score"]
        B, Hq, S, D = queries.shape
        q = queries.reshape(B, k.shape[1], Hq // k.shape[1], S, D)
        out = None
        if attend and self._fused:
            mass, out = all_visible_mass_out(q, k, self.values[:, :, :r], self._scale)
            out = out.reshape(B, Hq, S, out.shape[-1])
        else:
            mass = all_visible_mass(q, k, self._scale)
        score[:, :, :r] = score[:, :, :r] + mass
        return out

    def scores(self):
        return self.stored("score")
