"""H2O's accumulated attention mass: how much softmax attention each stored key receives from a
chunk of queries, summed over the query heads of its GQA group, causal by absolute position.
Optionally also the attention output from the same weights (the fused scoring path: one attention
pass per layer instead of the scoring pass plus the model's own).

Pure MLX; the only Python loop is over a few query sub-blocks of a long prefill chunk, so no
(heads x chunk x keys) probability tensor larger than (heads x ``query_block`` x keys) exists.
"""

from __future__ import annotations

import mlx.core as mx

from ...ops.attention import group_queries


def _block_probs(q, k, q_pos, k_pos, scale):
    # q (B, Hkv, G, s, D); k (B, Hkv, n, D); q_pos (s,); k_pos (B, Hkv, n) -> (B, Hkv, G, s, n) float32.
    # k_pos None: every key is visible (a decode step over uniform storage), so no mask is built.
    logits = (q.astype(mx.float32) * scale) @ mx.expand_dims(k.astype(mx.float32), 2).swapaxes(-1, -2)
    if k_pos is not None:
        visible = mx.expand_dims(k_pos, (2, 3)) <= q_pos[:, None]
        logits = mx.where(visible, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True)


def _mass(q, k, q_pos, k_pos, scale):
    return _block_probs(q, k, q_pos, k_pos, scale).sum(axis=(2, 3))  # (B, Hkv, n)


def _mass_out(q, k, v, q_pos, k_pos, scale):
    p = _block_probs(q, k, q_pos, k_pos, scale)
    out = p @ mx.expand_dims(v.astype(mx.float32), 2)  # (B, Hkv, G, s, Dv): the layer's attention output
    return p.sum(axis=(2, 3)), out.astype(q.dtype)


_block_mass, _block_mass_out = mx.compile(_mass), mx.compile(_mass_out)
# One query over storage without padding (every key visible): grouped queries q (B, Hkv, G, 1, D).
all_visible_mass = mx.compile(lambda q, k, scale: _mass(q, k, None, None, scale))
all_visible_mass_out = mx.compile(lambda q, k, v, scale: _mass_out(q, k, v, None, None, scale))


def attention_mass(queries: mx.array, keys: mx.array, k_pos: mx.array, q_start: int, scale: float,
                   query_block: int = 256, values: mx.array | None = None, all_visible: bool = False):
    """Sum over queries and grouped query heads of softmax(q kᵀ·scale), per stored key.

    queries (B, Hq, S, D) at absolute positions ``q_start .. q_start+S-1``; keys (B, Hkv, N, D) whose
    last S rows are those same S positions (the rows just appended); k_pos (B, Hkv, N) absolute key
    positions (padding must carry a large position). Returns float32 (B, Hkv, N); with ``values``
    (B, Hkv, N, Dv), ``(mass, output)``: output (B, Hq, S, Dv) in the queries' dtype is the causal
    attention of the queries over these keys/values computed from the same weights.

    Query sub-block j only needs key rows ``[0, N - S + end_j)`` (everything later is in its causal
    future), so the keys are sliced statically per sub-block: about half the work of a full square.
    ``all_visible``: the caller knows every key is visible to the single query (a decode step over
    storage without padding), so the causal mask is skipped (same result, fewer ops).
    """
    B, Hq, S, D = queries.shape
    N = keys.shape[2]
    q = group_queries(queries, keys.shape[1])
    scale = mx.array(scale, mx.float32)
    if all_visible and S == 1:
        if values is None:
            return all_visible_mass(q, keys, scale)
        m, o = all_visible_mass_out(q, keys, values, scale)
        return m, o.reshape(B, Hq, S, values.shape[-1])
    q_pos_all = mx.arange(q_start, q_start + S, dtype=mx.int32)
    k_pos = k_pos.astype(mx.int32)
    step = max(int(query_block), 1)
    total, outs = None, []
    for start in range(0, S, step):
        end = min(start + step, S)
        n_vis = N - S + end
        args = (q[:, :, :, start:end], keys[:, :, :n_vis])
        rest = (q_pos_all[start:end], k_pos[:, :, :n_vis], scale)
        if values is None:
            m = _block_mass(*args, *rest)
        else:
            m, o = _block_mass_out(*args, values[:, :, :n_vis], *rest)
            outs.append(o)
        if n_vis < N:
            m = mx.concatenate([m, mx.zeros(m.shape[:2] + (N - n_vis,), mx.float32)], axis=-1)
        total = m if total is None else total + m
    if values is None:
        return total
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
    return total, out.reshape(B, Hq, S, values.shape[-1])
