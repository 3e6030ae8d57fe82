"""A complete eviction method in one file: keep the keys with the smallest L2 norm.

The rule is Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(EMNLP 2024). Importing this file registers it; tests/conftest.py does, so the whole test suite
(contract, batching, save/load, memory, distributed) runs it like a built-in method. See
docs/add_a_method.md.
"""

import dataclasses

import mlx.core as mx

from veloxquant_mlx import EvictionCache, register
from veloxquant_mlx.options import option


@dataclasses.dataclass
class KeyNormOptions:
    evict_every: int = option(32, low=1, small=4, doc="rows allowed above the budget before one eviction step")


@register("keynorm")
class KeyNormKVCache(EvictionCache):
    """KeyNorm: keep sinks, the recent window and the keys with the smallest L2 norm."""

    Options = KeyNormOptions
    needs_queries = False  # the score reads the keys only

    def scores(self):
        # Devoto et al.: a low key norm goes with high attention, so the smallest norms score highest.
        keys = self.stored("keys").astype(mx.float32)
        return -mx.sqrt((keys * keys).sum(axis=-1))
