"""H2O: Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023).

Every kept key carries its cumulative attention probability: the softmax mass it has received from
every real query so far (prefill and decode), summed over the query heads that read its KV head.
The cache keeps ``n_sink`` attention sinks, the ``recent`` newest tokens (default: half the budget,
as in the paper's 50/50 heavy-hitter/recent split) and the heavy hitters, i.e. the highest
cumulative scores among the rest. Eviction is lazy: once ``evict_every`` rows beyond the budget have
accumulated, one batched top-k brings every head back to ``budget`` rows, so memory stays bounded
through decode (peak = budget + evict_every + prefill chunk).

The mass is computed by the compiled kernels below; the only Python loop is over a few query sub-blocks
of a long prefill chunk, so no (heads x chunk x keys) probability tensor larger than
(heads x ``query_block`` x keys) exists. Where the query tap allows it, the same weights give the layer's
attention output (one attention pass per layer instead of the scoring pass plus the model's own).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..caches.method import Method
from ..ops.attention import group_queries, one_pass
from ..options import evict_every, option
from ..registry import register


@dataclasses.dataclass
class H2OOptions:
    evict_every: int = evict_every()  # the paper evicts every step (1)
    # Queries scored per sub-block of a prefill chunk (bounds the probability tensor in memory).
    query_block: int = option(256, low=1, doc="prefill queries per scoring sub-block")
    # One attention pass: the layer's output from the scoring pass's own weights ("auto": on the CPU,
    # where it is faster; docs/performance.md), or the scoring pass plus mlx-lm's fused kernel.
    attention_pass: str = option("auto", choices=("auto", "fused", "separate"),
                                 doc="layer output from the scoring weights (fused) or a second attention pass")


@register("h2o")
class H2O(Method):
    """H2O: keep sinks, the recent window and the keys with the largest cumulative attention."""

    Options = H2OOptions
    row_fields = {"score": 0.0}  # the attention mass a row has received
    attention_mass_field = "score"  # the paged prompt adds its file's rows' mass to it too

    @classmethod
    def default_recent(cls, budget, options):
        return budget // 2  # H2O's default split: half heavy hitters, half recent tokens

    def __init__(self, config, layer=0, n_layers=1):
        super().__init__(config, layer, n_layers)
        self.fused = one_pass(self.options.attention_pass)

    def on_rows(self, view, step):
        q = step.queries
        if q is None:
            return {}
        keys, score = step.keys, view.field("score")
        values = step.values if step.attend and self.fused else None
        B, Hq, S, D = q.shape
        scale = mx.array(step.scale, mx.float32)
        if step.all_visible:  # one query over storage without padding: every row is in its past
            g = q.reshape(B, keys.shape[1], Hq // keys.shape[1], 1, D)
            if values is None:
                return {"score": score + _all_visible_mass(g, keys, scale)}
            mass, out = _all_visible_mass_out(g, keys, values, scale)
            return {"score": score + mass}, out.reshape(B, Hq, 1, values.shape[-1])
        got = attention_mass(q, keys, view.positions, view.offset - S, scale, self.options.query_block, values)
        mass, out = got if values is not None else (got, None)
        return {"score": score + mass}, out

    def scores(self, view):
        return view.field("score")


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
_all_visible_mass = mx.compile(lambda q, k, scale: _mass(q, k, None, None, scale))
_all_visible_mass_out = mx.compile(lambda q, k, v, scale: _mass_out(q, k, v, None, None, scale))


def attention_mass(queries: mx.array, keys: mx.array, k_pos: mx.array, q_start: int, scale: mx.array,
                   query_block: int = 256, values: mx.array | None = None):
    """Sum over queries and grouped query heads of softmax(q kᵀ·scale), per stored key (Sec. 3).

    queries (B, Hq, S, D) at absolute positions ``q_start .. q_start+S-1``; keys (B, Hkv, N, D) whose
    last S rows are those same S positions (the rows just appended); k_pos (B, Hkv, N) absolute key
    positions (padding carries a large position). Returns float32 (B, Hkv, N); with ``values``
    (B, Hkv, N, Dv), ``(mass, output)``: output (B, Hq, S, Dv) in the queries' dtype is the causal
    attention of the queries over these keys/values computed from the same weights.

    Query sub-block j only needs key rows ``[0, N - S + end_j)`` (everything later is in its causal
    future), so the keys are sliced statically per sub-block: about half the work of a full square.
    """
    B, Hq, S, D = queries.shape
    N = keys.shape[2]
    q = group_queries(queries, keys.shape[1])
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
