"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a sliding recent window."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..options import option
from ..registry import register
from ..caches.base import EvictionCache


@dataclasses.dataclass
class StreamingOptions:
    # Evict once this many rows past the budget have accumulated (amortized; exact StreamingLLM is 1).
    evict_every: int = option(32, low=1, small=4, doc="rows allowed above the budget before one eviction step")


@register("streaming")
class StreamingKVCache(EvictionCache):
    """StreamingLLM: keep the first n_sink tokens and the most recent ones (no scoring)."""

    Options = StreamingOptions
    needs_queries = False
    supports_ada = False  # every head has the same (position) scores: Ada would only add padding

    @classmethod
    def default_recent(cls, budget, options):
        return 0  # recency is the score itself: the newest budget - n_sink rows win

    def scores(self):
        # §3 of the StreamingLLM paper: sinks + rolling window == keep the newest positions.
        return self.stored("positions").astype(mx.float32)
