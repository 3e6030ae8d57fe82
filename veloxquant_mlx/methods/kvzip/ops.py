"""KVzip's importance score (Kim et al., NeurIPS 2025, arXiv 2505.23416, Sec. 3).

While the model reconstructs its context ("Repeat the previous context" + the context tokens, fed
with the prompt's cache as the past), every stored KV row gets the MAXIMUM softmax attention it
receives, over the reconstruction queries and over the query heads of its GQA group (Sec. 3,
importance scoring). Chunked scoring (Sec. 3): a chunk's queries are scored against the chunk's
own context rows, the leading sink rows and the reconstruction input's own keys (causal), so the
probability tensor is (heads x queries x (chunk + input)) whatever the context length.

Pure MLX; the only Python loop is over a few query sub-blocks of a chunk (bounds the tensor to
``q_block`` queries at a time; the max over blocks is the same max).
"""

from __future__ import annotations

import mlx.core as mx

from ...ops.attention import group_queries, window_attention_probs


def _block_logits(q, ctx, own, col_limit):
    # Not mx.compile'd: every chunk length is a new shape, and recompiling cost more than it saved.
    # q (B, H, G, s, D) scaled; ctx (B, H, C, D); own (B, H, S, D); col_limit (s,): the last own-key
    # column each query may see (causal inside the reconstruction input). Returns the context logits
    # (B, H, G, s, C), the own-key logits with the causal future at -inf, and each query's logsumexp
    # over both (B, H, G, s, 1). No mask over the context part: every context row precedes every query.
    l_ctx = q @ mx.expand_dims(ctx, 2).swapaxes(-1, -2)
    l_own = q @ mx.expand_dims(own.astype(mx.float32), 2).swapaxes(-1, -2)
    visible = mx.arange(own.shape[2])[None, :] <= col_limit[:, None]
    l_own = mx.where(visible, l_own, -mx.inf)
    lse = mx.logaddexp(mx.logsumexp(l_ctx, axis=-1), mx.logsumexp(l_own, axis=-1))
    return l_ctx, l_own, mx.expand_dims(lse, -1)


def _weighted_max(p, plus, start, end):
    # KVzip+ (KVzap, arXiv 2601.07891): each probability over its query's hidden-state norm, times its
    # row's ||W_o v|| for that query head, then the max over queries and group.
    inv_h, wov = plus  # (B, S) 1 / ||h_t||, (B, H, G, C) ||W_o^g v_i||
    p = p * inv_h[:, None, None, start:end, None]
    return (p.max(axis=3) * wov).max(axis=2)


def _block_max(q, ctx, own, col_limit, plus=None, start=0):
    # -> (B, H, C) float32. max_q softmax = exp(max_q (logit - logsumexp_q)): one exp per context row
    # instead of one per (query, row).
    l_ctx, _, lse = _block_logits(q, ctx, own, col_limit)
    if plus is not None:
        return _weighted_max(mx.exp(l_ctx - lse), plus, start, start + q.shape[3])
    return mx.exp((l_ctx - lse).max(axis=(2, 3)))


def _block_attend(q, ctx, own, col_limit, ctx_values, own_values, plus=None, start=0):
    # The same softmax, also applied to the values: the layer's attention output over (context rows
    # + own keys, causal) and the rows' max probability, from one query-key product.
    l_ctx, l_own, lse = _block_logits(q, ctx, own, col_limit)
    p_ctx, p_own = mx.exp(l_ctx - lse), mx.exp(l_own - lse)
    out = (p_ctx @ mx.expand_dims(ctx_values.astype(mx.float32), 2)
           + p_own @ mx.expand_dims(own_values.astype(mx.float32), 2))  # (B, H, G, s, D)
    if plus is not None:
        return out, _weighted_max(p_ctx, plus, start, start + q.shape[3])
    return out, p_ctx.max(axis=(2, 3))


def value_output_norms(values: mx.array, o_weight: mx.array, n_heads: int) -> mx.array:
    """(B, H, G, C) float32 ||W_o^g v|| of every row for each query head g of its KV head (KVzip+).

    values (B, H, C, D); o_weight (hidden, n_heads * D), the attention's output projection. Through the
    per-head Gram matrix W_g^T W_g (D x D): no (rows x hidden) product is formed."""
    B, H, C, D = values.shape
    if n_heads % H or o_weight.shape[-1] != n_heads * D:
        raise ValueError(f"output projection {o_weight.shape} does not fit {n_heads} heads of values {values.shape}")
    G = n_heads // H
    w = o_weight.astype(mx.float32).reshape(-1, H, G, D).transpose(1, 2, 3, 0)  # (H, G, D, hidden)
    gram = w @ w.swapaxes(-1, -2)  # (H, G, D, D)
    v = mx.expand_dims(values.astype(mx.float32), 2)  # (B, H, 1, C, D)
    return mx.sqrt(mx.maximum(((v @ gram) * v).sum(axis=-1), 0.0))


def _grouped(queries, ctx_keys, own_keys, scale):
    """(scaled float32 queries grouped per KV head, float32 context keys), shapes checked."""
    Hq, S, H = queries.shape[1], queries.shape[2], ctx_keys.shape[1]
    if Hq % H or own_keys.shape[2] != S:
        raise ValueError(f"queries {queries.shape} do not fit keys {ctx_keys.shape} / own keys {own_keys.shape}")
    return group_queries(queries.astype(mx.float32) * scale, H), ctx_keys.astype(mx.float32)


def reconstruction_attend(queries: mx.array, ctx_keys: mx.array, own_keys: mx.array, ctx_values: mx.array,
                          own_values: mx.array, scale: float, q_block: int = 128, plus=None):
    """:func:`reconstruction_scores` (with no lead rows) plus the attention output, for a chunk whose
    context rows are every row attention reads: one softmax serves both (the tap's one-pass path).
    ``plus``: KVzip+'s weights, as in :func:`reconstruction_scores`.

    Returns (output (B, Hq, S, D) in the queries' dtype, scores float32 (B, H, C))."""
    q, ctx = _grouped(queries, ctx_keys, own_keys, scale)
    S = queries.shape[2]
    outs, best = [], None
    step = max(int(q_block), 1)
    for start in range(0, S, step):  # a few query sub-blocks, not tokens
        end = min(start + step, S)
        o, s = _block_attend(q[:, :, :, start:end], ctx, own_keys[:, :, :end], mx.arange(start, end),
                             ctx_values, own_values[:, :, :end], plus, start)
        outs.append(o)
        best = s if best is None else mx.maximum(best, s)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return out.reshape(*queries.shape[:3], -1).astype(queries.dtype), best


def reconstruction_scores(queries: mx.array, ctx_keys: mx.array, own_keys: mx.array, scale: float,
                          n_lead: int = 0, q_block: int = 128, plus=None) -> mx.array:
    """Max attention each context row receives from one reconstruction chunk.

    queries (B, Hq, S, D): post-RoPE queries of the reconstruction input (repeat prompt + chunk);
    ctx_keys (B, H, n_lead + m, D): ``n_lead`` sink rows then the chunk's m stored context rows;
    own_keys (B, H, S, D): the input's own keys (never stored). Softmax over sinks + chunk + own keys
    (causal among own keys); returns float32 (B, H, m): max over the group and the S queries.
    ``plus`` = (1 / ||h|| (B, S), ||W_o v|| (B, H, G, n_lead + m)): KVzip+'s normalised score instead.
    """
    q, ctx = _grouped(queries, ctx_keys, own_keys, scale)
    S = queries.shape[2]
    out = None
    step = max(int(q_block), 1)
    for start in range(0, S, step):  # a few query sub-blocks, not tokens
        end = min(start + step, S)
        s = _block_max(q[:, :, :, start:end], ctx, own_keys[:, :, :end], mx.arange(start, end), plus, start)
        out = s if out is None else mx.maximum(out, s)
    return out[..., n_lead:]


def window_max_scores(queries: mx.array, keys: mx.array, q_pos: mx.array, k_pos: mx.array,
                      scale: float) -> mx.array:
    """(B, H, N) max attention over the group and the window queries (the fallback without a model
    pass: the prompt's own last queries stand in for the reconstruction's)."""
    return window_attention_probs(queries, keys, q_pos, k_pos, scale).max(axis=(2, 3))
