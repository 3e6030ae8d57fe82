"""Random eviction: keep the sinks, the recent window and a uniformly random subset of the rest.

The floor every scoring method must beat. The draw comes from the per-cache PRNG key (``config.seed``
+ layer, split at every eviction step via ``next_key``), so the same seed keeps the same rows.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..options import option
from ..registry import register
from ..caches.base import EvictionCache
from ..caches.shard import shard_of


@dataclasses.dataclass
class RandomOptions:
    evict_every: int = option(32, low=1, small=4, doc="rows allowed above the budget before one eviction step")


@register("random")
class RandomKVCache(EvictionCache):
    """Random: sinks + recent window + a seeded uniform sample of the other rows (ablation floor)."""

    Options = RandomOptions
    needs_queries = False
    supports_ada = False  # random scores carry no per-head importance to allocate by

    def scores(self):
        shape = self.stored("positions").shape
        d = shard_of(self)
        if d is not None:  # tensor parallel: the draws of the global head layout, this rank's slice
            return d.uniform(self.next_key(), shape)
        return mx.random.uniform(shape=shape, key=self.next_key())
