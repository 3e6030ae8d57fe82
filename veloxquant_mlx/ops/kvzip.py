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

from .attention import group_queries, window_attention_probs


def _block_max(q, ctx, own, col_limit):
    # Not mx.compile'd: every chunk length is a new shape, and recompiling cost more than it saved.
    # q (B, H, G, s, D) scaled; ctx (B, H, C, D); own (B, H, S, D); col_limit (s,): the last own-key
    # column each query may see (causal inside the reconstruction input) -> (B, H, C) float32
    k = mx.concatenate([ctx, own], axis=2).astype(mx.float32)
    logits = q @ mx.expand_dims(k, 2).swapaxes(-1, -2)  # (B, H, G, s, C + S)
    C = ctx.shape[2]
    cols = mx.arange(k.shape[2])
    visible = (cols[None, :] < C) | (cols[None, :] - C <= col_limit[:, None])
    p = mx.softmax(mx.where(visible, logits, -mx.inf), axis=-1, precise=True)
    return p[..., :C].max(axis=(2, 3))


def reconstruction_scores(queries: mx.array, ctx_keys: mx.array, own_keys: mx.array, scale: float,
                          n_lead: int = 0, q_block: int = 512) -> mx.array:
    """Max attention each context row receives from one reconstruction chunk.

    queries (B, Hq, S, D): post-RoPE queries of the reconstruction input (repeat prompt + chunk);
    ctx_keys (B, H, n_lead + m, D): ``n_lead`` sink rows then the chunk's m stored context rows;
    own_keys (B, H, S, D): the input's own keys (never stored). Softmax over sinks + chunk + own keys
    (causal among own keys); returns float32 (B, H, m): max over the group and the S queries.
    """
    B, Hq, S, D = queries.shape
    H = ctx_keys.shape[1]
    if Hq % H or own_keys.shape[2] != S:
        raise ValueError(f"queries {queries.shape} do not fit keys {ctx_keys.shape} / own keys {own_keys.shape}")
    q = group_queries(queries.astype(mx.float32) * scale, H)
    ctx = ctx_keys.astype(mx.float32)
    out = None
    step = max(int(q_block), 1)
    for start in range(0, S, step):  # a few query sub-blocks, not tokens
        end = min(start + step, S)
        s = _block_max(q[:, :, :, start:end], ctx, own_keys[:, :, :end], mx.arange(start, end))
        out = s if out is None else mx.maximum(out, s)
    return out[..., n_lead:]


def window_max_scores(queries: mx.array, keys: mx.array, q_pos: mx.array, k_pos: mx.array,
                      scale: float) -> mx.array:
    """(B, H, N) max attention over the group and the window queries (the fallback without a model
    pass: the prompt's own last queries stand in for the reconstruction's)."""
    return window_attention_probs(queries, keys, q_pos, k_pos, scale).max(axis=(2, 3))


def layer_winner_counts(scores: list, candidates: list, n_total: int) -> mx.array:
    """(L,) int32: how many of the ``n_total`` best candidate rows over ALL layers each layer holds
    (the paper's non-uniform budget across layers: one ranking of every layer's and head's rows).

    scores / candidates: one (1, H_l, R_l) array per layer (candidates: rows that may be evicted)."""
    flat = mx.concatenate([mx.where(c, s.astype(mx.float32), -mx.inf).reshape(-1)
                           for s, c in zip(scores, candidates)])
    rank = mx.argsort(mx.argsort(-flat))
    win = (rank < n_total) & (flat > -mx.inf)
    out, start = [], 0
    for s in scores:  # one slice per layer (layers, not tokens)
        out.append(win[start:start + s.size].sum())
        start += s.size
    return mx.stack(out).astype(mx.int32)
