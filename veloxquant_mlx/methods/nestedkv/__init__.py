"""NestedKVKVCache: NestedKV adapted to a KV cache (its cache and its scoring ops)."""

from .cache import NestedKVKVCache, NestedKVOptions

__all__ = ["NestedKVKVCache", "NestedKVOptions"]
