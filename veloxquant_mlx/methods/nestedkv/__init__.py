"""NestedKV adapted to a KV cache (its score is the shared key-anomaly score, ops.anomaly)."""

from .method import NestedKV, NestedKVOptions

__all__ = ["NestedKV", "NestedKVOptions"]
