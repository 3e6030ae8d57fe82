"""MorphKV (Ghadia et al., ICML 2025): a constant-size cache refined during decode.

The cache always keeps the ``window`` most recent tokens; every older token is scored by the attention
it receives from the window's queries (summed over the GQA group, reduced over the window by ``sum``,
or ``max``), and each KV head keeps its top ``budget - window - n_sink`` of them (plus sinks). Scoring
and eviction run through prefill and decode, lazily once ``evict_every`` rows past the budget have
accumulated, so memory stays constant however long the response.
"""

from __future__ import annotations

import dataclasses

from ..caches.method import Method, Needs
from ..ops.window_scores import window_reduce
from ..options import evict_every, option
from ..registry import register


@dataclasses.dataclass
class MorphKVOptions:
    # Recent window 32 as in the MorphKV paper; sum fusion over the window by default ("max" is its
    # other fusion); evict_every amortizes the per-step re-ranking (exact MorphKV is 1).
    window: int = option(32, low=1, small=8, doc="recent tokens kept and whose queries score the older tokens")
    reduce: str = option("sum", choices=("sum", "max"), doc="fusion of the window's attention")
    evict_every: int = evict_every()


@register("morphkv")
class MorphKV(Method):
    """MorphKV: recent window + top older tokens by the window's attention, prefill and decode."""

    Options = MorphKVOptions
    needs = Needs(window="window")

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # the window's rows are kept

    def scores(self, view):
        return view.window_attention(window_reduce(self.options.reduce))
