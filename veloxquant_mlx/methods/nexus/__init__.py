"""NexusKVCache: Nexus Sampling (its cache and its scoring ops)."""

from .cache import NexusKVCache, NexusOptions

__all__ = ["NexusKVCache", "NexusOptions"]
