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


def one_pass(mode: str, on: str = "fused") -> bool:
    """A method's attention option (``mode``: ``on``, ``"auto"`` or another) says it computes the layer's output
    from its own scoring weights: always for ``on``, on the CPU for ``"auto"`` (:func:`fused_scoring_default`)."""
    return mode == on or (mode == "auto" and fused_scoring_default())


# -- attention in blocks of keys (the paged prompt: rows read back from a file a block at a time) ---------
# MLX's fused attention does not return the softmax's log-sum-exp, so attention over keys that are never
# all in memory at once runs block by block with the running (max, sum, output) of an online softmax.
def _block_logits(q, k, scale):
    # q (B, Hkv, G, S, D) float32; k (B, Hkv, n, D) -> (B, Hkv, G, S, n) float32
    return (q * scale) @ mx.expand_dims(k.astype(mx.float32), 2).swapaxes(-1, -2)


def _merge(m, l, acc, logits, v):
    m_new = mx.maximum(m, logits.max(axis=-1, keepdims=True))
    p = mx.exp(logits - m_new)
    corr = mx.exp(m - m_new)
    acc = acc * corr + p @ mx.expand_dims(v.astype(mx.float32), 2)
    return m_new, l * corr + p.sum(axis=-1, keepdims=True), acc


@mx.compile
def _online_visible(q, k, v, m, l, acc, scale):
    """One block of keys every query sees (rows older than the queries)."""
    return _merge(m, l, acc, _block_logits(q, k, scale), v)


@mx.compile
def _online_masked(q, k, v, m, l, acc, scale, visible):
    """One block of keys with a (.., S, n) visibility mask (the chunk's own rows: causal; padding)."""
    return _merge(m, l, acc, mx.where(visible, _block_logits(q, k, scale), -mx.inf), v)


@mx.compile
def _mass_visible(q, k, lse, scale):
    return mx.exp(_block_logits(q, k, scale) - lse).sum(axis=(2, 3))


@mx.compile
def _mass_masked(q, k, lse, scale, visible):
    p = mx.exp(mx.where(visible, _block_logits(q, k, scale), -mx.inf) - lse)
    return p.sum(axis=(2, 3))


class BlockAttention:
    """Causal attention of a chunk of queries over keys fed in blocks, exact to the softmax's rounding.

    ``queries`` (B, Hq, S, D), with mlx-lm's optional attention ``sinks`` (Hq,); every block fed with :meth:`add`
    is (B, Hkv, n, D) keys and (B, Hkv, n, Dv) values with an optional (B, Hkv, S, n) or broadcastable visibility
    mask (None: every query sees every row); :meth:`add_own` feeds the rows whose last ``S`` are the queries' own
    positions (causal). :meth:`output` gives (B, Hq, S, Dv) in the queries' dtype; :meth:`mass` a block's
    attention mass per row (summed over the queries and the GQA group) from each query's final log-sum-exp:
    H2O's accumulated attention, computed in a second pass over the blocks.

    The queries run in spans of ``query_block`` (None: one span), each with its own running (max, sum, output):
    a block's scratch is ``query_block`` x Hq x n floats whatever the chunk's length, and a span reads only the
    own rows in its causal past. Spans do not interact, so the result is the same for any span length."""

    def __init__(self, queries: mx.array, n_kv_heads: int, scale: float, sinks: mx.array | None = None,
                 query_block: int | None = None):
        self.dtype = queries.dtype
        q = group_queries(queries, n_kv_heads).astype(mx.float32)
        self.scale = mx.array(scale, mx.float32)
        B, H, G, S, _ = q.shape
        step = S if query_block is None else max(int(query_block), 1)
        self.spans = [(a, min(a + step, S)) for a in range(0, S, step)]
        self.q = [q] if len(self.spans) == 1 else [q[:, :, :, a:b] for a, b in self.spans]
        self.m, self.l = [], []
        for a, b in self.spans:
            if sinks is None:
                # a finite floor: a query none of whose rows were visible yet adds exp(-inf) = 0, never NaN
                self.m.append(mx.full((B, H, G, b - a, 1), -1e30, mx.float32))
                self.l.append(mx.zeros((B, H, G, b - a, 1), mx.float32))
            else:  # attention sinks (one logit per query head, value 0): a row every query sees, first
                self.m.append(mx.broadcast_to(sinks.astype(mx.float32).reshape(1, H, G, 1, 1), (B, H, G, b - a, 1)))
                self.l.append(mx.ones((B, H, G, b - a, 1), mx.float32))
        self.acc = [None] * len(self.spans)

    def _span_mask(self, visible, i):
        # a mask with a query axis gives each span its own rows of it; (.., 1, n) broadcasts as it is
        if visible is None or len(self.spans) == 1 or visible.shape[-2] == 1:
            return visible
        a, b = self.spans[i]
        return visible[..., a:b, :]

    def _add_span(self, i, keys, values, visible):
        q, m, l, acc = self.q[i], self.m[i], self.l[i], self.acc[i]
        if acc is None:
            acc = mx.zeros(q.shape[:-1] + (values.shape[-1],), mx.float32)
        if visible is None:
            self.m[i], self.l[i], self.acc[i] = _online_visible(q, keys, values, m, l, acc, self.scale)
        else:
            self.m[i], self.l[i], self.acc[i] = _online_masked(q, keys, values, m, l, acc, self.scale,
                                                               _per_group(visible))

    def add(self, keys: mx.array, values: mx.array, visible: mx.array | None = None) -> None:
        for i in range(len(self.spans)):
            self._add_span(i, keys, values, self._span_mask(visible, i))

    def add_own(self, keys: mx.array, values: mx.array) -> None:
        """Rows whose last ``S`` are the queries' own positions (query i sees rows ``<= n - S + i``); a span
        reads only the rows up to its last query."""
        n, S = keys.shape[2], self.spans[-1][1]
        for i, (a, b) in enumerate(self.spans):
            stop = n - S + b
            k, v = (keys, values) if stop == n else (keys[:, :, :stop], values[:, :, :stop])
            self._add_span(i, k, v, chunk_visibility(stop, b - a))

    def state(self) -> list:
        """The running arrays, one list per span (what to evaluate after each block, so its rows can be freed)."""
        return [[m, l, acc] for m, l, acc in zip(self.m, self.l, self.acc)]

    def output(self) -> mx.array:
        outs = [acc / l for acc, l in zip(self.acc, self.l)]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=3)
        B, H, G, S, Dv = out.shape
        return out.astype(self.dtype).reshape(B, H * G, S, Dv)

    def mass(self, keys: mx.array, visible: mx.array | None = None) -> mx.array:
        """(B, Hkv, n) attention mass the block's rows receive from every query (after all blocks)."""
        total = None
        for i, (q, m, l) in enumerate(zip(self.q, self.m, self.l)):
            lse, vis = m + mx.log(l), self._span_mask(visible, i)
            part = (_mass_visible(q, keys, lse, self.scale) if vis is None
                    else _mass_masked(q, keys, lse, self.scale, _per_group(vis)))
            total = part if total is None else total + part
        return total

    def mass_own(self, keys: mx.array) -> mx.array:
        """:meth:`mass` of the rows :meth:`add_own` took (the last ``S`` are the queries' own, causal)."""
        return self.mass(keys, chunk_visibility(keys.shape[2], self.spans[-1][1]))


def _per_group(visible: mx.array) -> mx.array:
    # (B, Hkv, S, n) -> (B, Hkv, 1, S, n) over the GQA group; an (S, n) mask broadcasts as it is
    return mx.expand_dims(visible, 2) if visible.ndim == 4 else visible


def chunk_visibility(n_rows: int, n_queries: int) -> mx.array:
    """(S, n) bool: the last ``n_queries`` of ``n_rows`` rows are the queries' own positions, causal
    (bottom-right aligned: query i sees rows ``<= n_rows - n_queries + i``)."""
    return mx.arange(n_rows)[None, :] <= (n_rows - n_queries + mx.arange(n_queries))[:, None]


@mx.compile
def _lse_block(q, k, q_pos, k_pos, scale, m, l):
    logits = mx.where(mx.expand_dims(k_pos, (2, 3)) <= q_pos[:, None], _block_logits(q, k, scale), -mx.inf)
    m_new = mx.maximum(m, logits.max(axis=-1, keepdims=True))
    return m_new, l * mx.exp(m - m_new) + mx.exp(logits - m_new).sum(axis=-1, keepdims=True)


@mx.compile
def _probs_block(q, k, q_pos, k_pos, scale, lse):
    logits = mx.where(mx.expand_dims(k_pos, (2, 3)) <= q_pos[:, None], _block_logits(q, k, scale), -mx.inf)
    return mx.exp(logits - lse)


def blocked_window_probs(queries: mx.array, q_pos: mx.array, scale: float, blocks, reduce) -> mx.array:
    """:func:`window_attention_probs` over keys that come a block at a time, each block reduced as it comes.

    ``blocks()`` returns a fresh iterator of (keys (B, Hkv, n, D), k_pos (B, Hkv, n)) in row order (it is
    called twice: the first pass finds each query's log-sum-exp, the second gives the probabilities);
    ``reduce`` maps a block's probabilities (B, Hkv, G, W, n) float32 to what the caller keeps of it,
    with the rows along the last axis. Returns the reduced blocks joined along the last axis: the same
    numbers as reducing :func:`window_attention_probs` of all the keys, up to the softmax's rounding,
    with only one block's probabilities in memory at a time (each is evaluated before the next)."""
    q_pos = q_pos.astype(mx.int32)
    sc = mx.array(scale, mx.float32)
    q = m = l = None
    for k, pos in blocks():
        if q is None:
            q = group_queries(queries, k.shape[1]).astype(mx.float32)
            m = mx.full((*q.shape[:-1], 1), -1e30, mx.float32)
            l = mx.zeros_like(m)
        m, l = _lse_block(q, k, q_pos, pos.astype(mx.int32), sc, m, l)
        mx.eval(m, l)
    if q is None:
        raise ValueError("blocked_window_probs needs at least one block of keys")
    lse = m + mx.log(l)
    out = []
    for k, pos in blocks():
        out.append(reduce(_probs_block(q, k, q_pos, pos.astype(mx.int32), sc, lse)))
        mx.eval(out[-1])
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=-1)
