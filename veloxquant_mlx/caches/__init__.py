"""The machinery every eviction method shares: the base cache, storage (ragged, quantized, batched),
head shards, the cold tier, byte accounting. The methods themselves live in ``veloxquant_mlx.methods``."""

from .base import PAD_POSITION, EvictionCache

__all__ = ["EvictionCache", "PAD_POSITION"]
