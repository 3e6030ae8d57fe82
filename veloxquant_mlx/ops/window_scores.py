"""Observation-window attention scores, shared by the window-scored methods (SnapKV, PyramidKV, MorphKV).

All three score every stored key by the softmax attention it receives from the last ``W`` queries
(the observation window), summed over the query heads that read its KV head (GQA group). SnapKV and
PyramidKV sum over the window and then 1-D max-pool the scores (clustering neighbours); MorphKV sums
(or max-reduces) over the window without pooling.
"""

from __future__ import annotations

import mlx.core as mx

from .attention import window_attention_probs


def window_scores(queries: mx.array, keys: mx.array, q_pos: mx.array, k_pos: mx.array, scale: float,
                  reduce: str = "sum") -> mx.array:
    """(B, Hkv, N) float32: attention each key gets from the window's queries.

    queries (B, Hq, W, D) post-RoPE at absolute positions q_pos (W,); keys (B, Hkv, N, D) at k_pos
    (B, Hkv, N) (padding rows carry a huge position and get zero). Probabilities are summed over the
    GQA group, then reduced over the W window queries by ``"sum"`` or ``"max"``.
    """
    probs = window_attention_probs(queries, keys, q_pos, k_pos, scale).sum(axis=2)  # (B, Hkv, W, N)
    if reduce == "sum":
        return probs.sum(axis=2)
    if reduce == "max":
        return probs.max(axis=2)
    raise ValueError(f"reduce must be 'sum' or 'max', got {reduce!r}")


def max_pool_1d(x: mx.array, kernel: int) -> mx.array:
    """Same-size max pooling along the last axis (stride 1, padding kernel // 2 with -inf)."""
    if kernel <= 1:
        return x
    left = kernel // 2
    right = kernel - 1 - left
    n = x.shape[-1]
    pad = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(left, right)], constant_values=-mx.inf)
    out = pad[..., 0:n]
    for i in range(1, kernel):  # a static loop over the kernel taps, not over tokens
        out = mx.maximum(out, pad[..., i:i + n])
    return out


def pooled_window_scores(queries: mx.array, q_pos: mx.array, scale: float, keys: mx.array, k_pos: mx.array,
                         kernel: int) -> mx.array:
    """The pooled window score (SnapKV's and PyramidKV's; ``queries, q_pos, scale``: the observation window):
    window attention summed over window and group, max-pooled over the keys before the window; keys inside the
    observation window get +inf (SnapKV always keeps them); padding rows get -inf."""
    s = window_scores(queries, keys, q_pos, k_pos, scale, "sum")
    in_window = k_pos >= q_pos[0]  # window rows (and padding, which carries a huge position)
    s = max_pool_1d(mx.where(in_window, -mx.inf, s), kernel)
    real_window = in_window & (k_pos <= q_pos[-1])
    return mx.where(real_window, mx.inf, s)
