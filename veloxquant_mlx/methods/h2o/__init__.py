"""H2OKVCache: Heavy-Hitter Oracle (its cache and its attention-mass op)."""

from .cache import H2OKVCache, H2OOptions

__all__ = ["H2OKVCache", "H2OOptions"]
