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


def causal_attention(queries: mx.array, keys: mx.array, values: mx.array, k_pos: mx.array, q_start: int,
                     scale: float, query_block: int = 256) -> mx.array:
    """The layer's attention output for a prompt chunk, in query sub-blocks that skip their causal future.

    queries (B, Hq, S, D) at positions ``q_start .. q_start+S-1``; keys / values (B, Hkv, N, D) whose
    last S rows are those positions (the rows just appended); k_pos (B, Hkv, N) absolute key positions
    (padding rows carry a large position, so they are hidden). Sub-block j reads only key rows
    ``[0, N - S + end_j)``: about S²/2 fewer scores than the full (S x N) pass MLX's CPU kernel computes
    before masking (half of a first chunk's, an eighth of a chunk behind 3 S rows). Same weights as
    :func:`window_attention_probs`; returns (B, Hq, S, Dv) in the queries' dtype."""
    B, Hq, S, _ = queries.shape
    N = keys.shape[2]
    q = group_queries(queries, keys.shape[1])
    q_pos = mx.arange(q_start, q_start + S, dtype=mx.int32)
    k_pos, sc = k_pos.astype(mx.int32), mx.array(scale, mx.float32)
    step, outs = max(int(query_block), 1), []
    for start in range(0, S, step):  # a few sub-blocks of a long chunk, not tokens
        end = min(start + step, S)
        n = N - S + end
        p = _probs(q[:, :, :, start:end], keys[:, :, :n], q_pos[start:end], k_pos[:, :, :n], sc)
        outs.append(p @ mx.expand_dims(values[:, :, :n].astype(mx.float32), 2))
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.astype(queries.dtype).reshape(B, Hq, S, values.shape[-1])


def fused_scoring_default() -> bool:
    """Should a method whose scoring pass computes the attention weights also compute the layer's
    output from them (one pass), rather than leave it to mlx-lm's fused kernel (two passes)?

    On the CPU yes: MLX's CPU ``scaled_dot_product_attention`` is itself matmul + softmax + matmul,
    so the second pass is pure repetition (measured: docs/performance.md). Elsewhere (Metal, CUDA)
    the fused kernel is unmeasured here, so the two-pass path stays."""
    return mx.default_device().type == mx.DeviceType.cpu
