"""Random eviction: keep the sinks, the recent window and a uniformly random subset of the rest.

The floor every scoring method must beat. The draw comes from the cache's PRNG key (``config.seed`` +
layer, split at every eviction step), so the same seed keeps the same rows.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..caches.allocation import Uniform
from ..caches.method import Method, Needs
from ..options import evict_every
from ..registry import register


@dataclasses.dataclass
class RandomOptions:
    evict_every: int = evict_every()


@register("random")
class Random(Method):
    """Random: sinks + recent window + a seeded uniform sample of the other rows (ablation floor)."""

    Options = RandomOptions
    needs = Needs(queries=False)
    allocations = {"uniform": Uniform}  # random scores carry no per-head importance to allocate by

    def scores(self, view):
        shape = view.positions.shape
        if view.shard is not None:  # tensor parallel: the draws of the global head layout, this rank's slice
            return view.shard.uniform(view.key(), shape)
        return mx.random.uniform(shape=shape, key=view.key())
