"""Observation-window attention scores, shared by the window-scored methods (SnapKV, PyramidKV, MorphKV).

All three score every stored key by the softmax attention it receives from the last ``W`` queries
(the observation window), summed over the query heads that read its KV head (GQA group). SnapKV and
PyramidKV sum over the window and then 1-D max-pool the scores (clustering neighbours); MorphKV sums
(or max-reduces) over the window without pooling.
"""

from __future__ import annotations

import mlx.core as mx



def _group_sum_then_window_sum(p):
    return p.sum(axis=2).sum(axis=2)


def _group_sum_then_window_max(p):
    return p.sum(axis=2).max(axis=2)


def window_reduce(reduce: str = "sum"):
    """The reduction of window attention probabilities (B, Hkv, G, W, N) to one score per key (B, Hkv, N):
    summed over the GQA group, then over the W window queries by ``"sum"`` or ``"max"`` (what a method
    hands ``View.window_attention``)."""
    if reduce == "sum":
        return _group_sum_then_window_sum
    if reduce == "max":
        return _group_sum_then_window_max
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


def pooled_window_scores(scores: mx.array, k_pos: mx.array, q_pos: mx.array, kernel: int) -> mx.array:
    """The pooled window score (SnapKV's and PyramidKV's) from the window attention summed over window and
    group (``window_reduce("sum")``): max-pooled over the keys before the window (``q_pos``: the window's
    positions); keys inside the observation window get +inf (SnapKV always keeps them); padding rows -inf."""
    in_window = k_pos >= q_pos[0]  # window rows (and padding, which carries a huge position)
    s = max_pool_1d(mx.where(in_window, -mx.inf, scores), kernel)
    real_window = in_window & (k_pos <= q_pos[-1])
    return mx.where(real_window, mx.inf, s)
