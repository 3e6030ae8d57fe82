"""Softmax attention of a few observed queries over the stored keys, GQA-grouped, causal by position."""

from __future__ import annotations

import mlx.core as mx


def group_queries(queries: mx.array, n_kv_heads: int) -> mx.array:
    """(B, Hq, S, D) -> (B, Hkv, G, S, D): query heads grouped onto the KV head they read."""
    B, Hq, S, D = queries.shape
    return queries.reshape(B, n_kv_heads, Hq // n_kv_heads, S, D)


@mx.compile
def _probs(q, k, q_pos, k_pos, scale):
    # q (B, Hkv, G, S, D); k (B, Hkv, N, D); q_pos (S,); k_pos (B, Hkv, N)
    logits = (q.astype(mx.float32) * scale) @ mx.expand_dims(k.astype(mx.float32), 2).swapaxes(-1, -2)
    visible = mx.expand_dims(k_pos, (2, 3)) <= q_pos[:, None]  # (B, Hkv, 1, S, N)
    logits = mx.where(visible, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True)


def window_attention_probs(queries: mx.array, keys: mx.array, q_pos: mx.array, k_pos: mx.array,
                           scale: float) -> mx.array:
    """softmax(q kᵀ · scale) over stored keys, hiding keys at positions after each query.

    queries (B, Hq, S, D) post-RoPE; keys (B, Hkv, N, D); q_pos (S,) absolute query positions;
    k_pos (B, Hkv, N) absolute key positions (padding rows must carry a large position).
    Returns float32 probabilities (B, Hkv, G, S, N), G = Hq // Hkv.
    """
    q = group_queries(queries, keys.shape[1])
    return _probs(q, keys, q_pos.astype(mx.int32), k_pos.astype(mx.int32), mx.array(scale, mx.float32))


def fused_scoring_default() -> bool:
    """Should a method whose scoring pass computes the attention weights also compute the layer's
    output from them (one pass), rather than leave it to mlx-lm's fused kernel (two passes)?

    On the CPU yes: MLX's CPU ``scaled_dot_product_attention`` is itself matmul + softmax + matmul,
    so the second pass is pure repetition (measured: docs/performance.md). Elsewhere (Metal, CUDA)
    the fused kernel is unmeasured here, so the two-pass path stays."""
    return mx.default_device().type == mx.DeviceType.cpu
