"""Pure, compile-friendly MLX functions used by the caches (no state, no Python loops over heads/tokens)."""

from .attention import group_queries, window_attention_probs
from .select import gather_rows, keep_top_rows

__all__ = ["group_queries", "window_attention_probs", "gather_rows", "keep_top_rows"]
