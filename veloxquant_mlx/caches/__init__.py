"""The cache every eviction method runs in: the adapter to mlx-lm, row storage (ragged, quantized,
batched), head shards, the cold tier, byte accounting; and the protocol a method implements (``Method``
over a read-only ``View``, with ``caches.allocation``'s strategies). The methods live in
``veloxquant_mlx.methods``."""

from .cache import EvictionCache, continue_on_purpose
from .rows import PAD_POSITION
from .method import Method, Needs
from .view import View

__all__ = ["EvictionCache", "continue_on_purpose", "Method", "Needs", "View", "PAD_POSITION"]
