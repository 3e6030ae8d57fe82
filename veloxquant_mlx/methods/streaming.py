"""StreamingLLM (Xiao et al., ICLR 2024): attention sinks plus a sliding recent window."""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..caches.allocation import Uniform
from ..caches.method import Method, Needs
from ..options import evict_every
from ..registry import register


@dataclasses.dataclass
class StreamingOptions:
    evict_every: int = evict_every()  # exact StreamingLLM evicts every step (1)


@register("streaming")
class StreamingLLM(Method):
    """StreamingLLM: keep the first n_sink tokens and the most recent ones (no scoring)."""

    Options = StreamingOptions
    needs = Needs(queries=False)
    allocations = {"uniform": Uniform}  # every head has the same (position) scores: Ada would only add padding

    @classmethod
    def default_recent(cls, budget, options):
        return 0  # recency is the score itself: the newest budget - n_sink rows win

    def scores(self, view):
        # §3 of the StreamingLLM paper: sinks + rolling window == keep the newest positions.
        return view.positions.astype(mx.float32)
