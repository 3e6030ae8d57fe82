"""NestedKV's cross-head budget competition (pure MLX, vectorized); its row score is the shared
multi-scale key-anomaly score (``ops.anomaly``)."""

from __future__ import annotations

import mlx.core as mx


def _mark_top(scores, k):
    """Bool mask of the top ``k`` entries along the last axis (k static, 1 <= k <= size)."""
    top = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.put_along_axis(mx.zeros(scores.shape, mx.bool_), top, mx.array(True), axis=-1)


def max_head_rows(n: int, n_heads: int, budget: int, floor: int, cap: int | None = None) -> int:
    """Static bound on the rows one head can keep: min(N, H*B - (H-1)*floor[, cap])."""
    f = min(floor, n)
    k = min(n, n_heads * budget - (n_heads - 1) * f)
    return min(k, cap) if cap is not None else k


def cross_head_keep(scores: mx.array, budget: int, floor: int, cap: int | None = None) -> mx.array:
    """Spec step 5, per batch row: every head keeps its top ``floor`` rows; the remaining
    H*budget - H*floor slots go to the best remaining (head, row) pairs of the whole layer
    (optionally only among each head's top ``cap`` rows). -inf rows are never kept. (B, H, N) bool."""
    B, H, N = scores.shape
    f = min(floor, N)
    guaranteed = _mark_top(scores, f) if f > 0 else mx.zeros(scores.shape, mx.bool_)
    cand = mx.where(guaranteed, -mx.inf, scores)
    if cap is not None and cap < N:
        cand = mx.where(_mark_top(scores, cap), cand, -mx.inf)
    P = min(H * (budget - f), H * N)
    keep = guaranteed
    if P > 0:
        flat = cand.reshape(B, H * N)
        pool = _mark_top(flat, P) & (flat > -mx.inf)
        keep = keep | pool.reshape(B, H, N)
    return keep & (scores > -mx.inf)


def rows_from_mask(keep: mx.array, k_max: int):
    """(idx (B, H, k_max) int32 with each head's kept rows first, ascending; real (B, H, k_max))."""
    N = keep.shape[-1]
    r = mx.arange(N, dtype=mx.int32)
    idx = mx.argsort(mx.where(keep, r, N + r), axis=-1)[..., :k_max].astype(mx.int32)
    real = mx.arange(k_max) < keep.sum(axis=-1, keepdims=True)
    return idx, real
