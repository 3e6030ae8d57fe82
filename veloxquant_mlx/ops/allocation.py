"""Budget allocation across the KV heads of one layer: Ada-KV (Feng et al., NeurIPS 2025).

Ada-KV splits a layer's total budget ``H x B`` across heads by where the layer's attention mass
concentrates: a layer-wide top-``H*B`` over every head's (non-forced) scores picks the winners, head
``h`` wins ``count_h`` of them, and keeps ``budget_h = round(count_h * (1 - alpha) + alpha * B)`` rows
(a floor of ``alpha * B`` per head, largest-remainder rounding so the total is exactly ``H * B``).
Each head then keeps its own top ``budget_h``. Heads keep different row counts, so storage is padded
to a static width ``K`` and the padding rows are reported through ``real`` (ragged storage).
"""

from __future__ import annotations

import math

import mlx.core as mx

_NEG = -3.0e38  # finite "very low" score: a real candidate with a -inf/NaN score still beats padding


def _rank_desc(x: mx.array, axis: int = -1) -> mx.array:
    """Rank of every element along ``axis`` (0 = largest)."""
    return mx.argsort(mx.argsort(-x, axis=axis), axis=axis)


def ada_width(rows: int, n_heads: int, budget: int, n_forced: int, alpha: float) -> int:
    """Static per-head storage width (forced rows included) after one Ada-KV step over ``rows``."""
    sel, cand = budget - n_forced, rows - n_forced
    top = math.ceil((1.0 - alpha) * min(cand, n_heads * sel) + alpha * sel - 1e-9)
    return n_forced + max(0, min(cand, top))


def ada_head_budgets(counts: mx.array, sel_budget: int, alpha: float) -> mx.array:
    """(B, H) int32 per-head selectable budgets from the (B, H) winner counts (sum = H * sel_budget)."""
    H = counts.shape[-1]
    raw = counts.astype(mx.float32) * (1.0 - alpha) + alpha * sel_budget
    base = mx.floor(raw + 1e-4)
    short = H * sel_budget - base.sum(axis=-1, keepdims=True)  # in [0, H): largest remainders get +1
    # Remainders equal in exact arithmetic can differ by an ulp in fp32: quantize them, then break
    # ties by head index (lower first) so the result is the same on every backend.
    rem = mx.round((raw - base) * 1e4) * (H + 1) - mx.arange(H, dtype=mx.float32)
    bump = _rank_desc(rem, axis=-1) < short
    return (base + bump.astype(mx.float32)).astype(mx.int32)


def ada_keep_mask(scores: mx.array, cand: mx.array, sel: int, alpha: float, width: int, layer=None) -> mx.array:
    """The Ada-KV allocation itself, written once for rows (``ada_keep``) and Nexus's blocks: (B, H, R)
    bool, the candidates ``cand`` kept when the layer's heads share ``H x sel`` selectable slots by their
    ``scores`` (higher kept; comparable across heads). The layer-wide top ``H x sel`` candidates win, head
    ``h`` keeps ``ada_head_budgets`` of its own best (at most ``width`` and its candidates), and slots a
    head cannot use go to the layer's best remaining candidates within ``width``. ``layer``: see ``ada_keep``."""
    B, H, R = scores.shape
    n_total = (H if layer is None else layer.total_heads(H)) * sel
    s = scores.astype(mx.float32)
    s = mx.where(mx.isnan(s) | (s == -mx.inf), _NEG, s)
    s = mx.where(cand, s, -mx.inf)

    # Layer-wide winners of the H * sel selectable slots, counted per head.
    if layer is None:
        win = (_rank_desc(s.reshape(B, H * R)) < n_total).reshape(B, H, R) & cand
        target = ada_head_budgets(win.sum(axis=-1), sel, alpha)
    else:
        counts = layer.gather_heads(layer.top_k_mask(s, cand, n_total).sum(axis=-1).astype(mx.int32))
        target = layer.local(ada_head_budgets(counts, sel, alpha), H)
    target = mx.minimum(mx.minimum(target, cand.sum(axis=-1).astype(mx.int32)), width)

    head_rank = _rank_desc(s)  # (B, H, R)
    primary = cand & (head_rank < mx.expand_dims(target, -1))
    # A head with fewer candidates than its target (re-evicting ragged storage, a capped head) hands its
    # leftover slots to the best remaining candidates of the layer that still fit.
    kept = target.sum(axis=-1)
    left = n_total - (kept if layer is None else layer.all_sum(kept))  # (B,)
    pool = cand & ~primary & (head_rank < width)
    if layer is None:
        extra_rank = _rank_desc(mx.where(pool, s, -mx.inf).reshape(B, H * R)).reshape(B, H, R)
        extra = pool & (extra_rank < left[:, None, None])
    else:
        extra = layer.top_k_mask(s, pool, left)
    return primary | extra


def ada_keep(scores: mx.array, positions: mx.array, offset: int, budget: int, n_sink: int, n_recent: int,
             alpha: float, pad_position: int, layer=None, cap: int | None = None):
    """Ada-KV selection over stored rows.

    scores (B, H, R) (higher = keep); positions (B, H, R) absolute positions, ``pad_position`` for
    padding rows; offset: tokens seen. Sinks (position < n_sink) and the recent window (position >=
    offset - n_recent) are forced in every head. Returns (idx (B, H, K) int32, real (B, H, K) bool):
    every head's kept rows in ascending row order, then padding rows (real False).

    ``layer``: None when these are all of the layer's heads; under tensor parallelism this rank's
    ``veloxquant_mlx.caches.shard.HeadShard``, whose layer-wide top-k / gather / sum stand in for the
    three layer-wide steps (winners, head budgets, leftover slots), so each rank gets exactly its
    heads' part of the one-process result.

    ``cap``: most rows one head keeps (forced included; None: Ada-KV's own bound). The layer total is
    unchanged: slots a capped head cannot take go to the best candidates of the other heads (the
    leftover step), so storage as wide as the widest head stays within ``cap`` rows.
    """
    B, H, R = scores.shape
    H_layer = H if layer is None else layer.total_heads(H)
    F = n_sink + n_recent
    sel = budget - F
    kc = ada_width(R, H_layer, budget, F, alpha) - F
    if cap is not None:
        kc = min(kc, max(cap, budget) - F)
    valid = positions != pad_position
    forced = valid & ((positions < n_sink) | (positions >= offset - n_recent))
    keep = forced | ada_keep_mask(scores, valid & ~forced, sel, alpha, kc, layer)

    K = F + kc
    rows = mx.arange(R, dtype=mx.int32)
    order = mx.argsort(mx.where(keep, rows, rows + R), axis=-1)[..., :K].astype(mx.int32)
    real = mx.take_along_axis(keep, order, axis=-1)
    return order, real


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
