"""Budget allocation across the KV heads of one layer, the pure ops behind ``caches.allocation``: Ada-KV
(Feng et al., NeurIPS 2025) over rows and over blocks, a cross-head pool with a floor (NestedKV), and one
ranking across layers.

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


def ada_block_width(n_blocks_total: int, n_heads: int, n_forced: int, n_sel: int, alpha: float) -> int:
    """Static per-head width in blocks (forced included) after one Ada-Nexus step (ops.allocation.ada_width
    counted in blocks)."""
    return ada_width(n_blocks_total, n_heads, n_forced + n_sel, n_forced, alpha)


def ada_select_blocks(score: mx.array, valid: mx.array, n_lead: int, n_trail: int, n_sel: int, alpha: float,
                      cap: int | None = None):
    """Ada-KV head-adaptive block allocation on Nexus priorities (Nexus App. C, "Ada-Nexus").

    score (B, H, N_k): per-KV-head block priority (log π or w), comparable across heads (each head's
    S_hat rows sum to 1); valid (B, H, N_k) bool: False for padding blocks of ragged storage. Forced:
    the first ``n_lead`` (sink) and last ``n_trail`` (recent window) blocks of every head.

    The selectable blocks of all heads compete layer-wide: the top H·K (K = ``n_sel``) win, head h wins
    count_h, keeps K_h = round(count_h (1 - α) + α K) (``ops.allocation.ada_head_budgets``: largest
    remainder, Σ K_h = H·K) of its own best blocks; a head with fewer candidates than K_h hands the
    leftover to the layer's best remaining candidates within the static width.

    Returns (blocks (B, H, Wb) int32, real (B, H, Wb) bool), Wb = n_lead + K_max + n_trail with K_max the
    static bound ``ada_block_width``. Per head: the lead blocks, its K_h (+ extra) selected blocks in
    ascending order, padding blocks (real False), then the trailing blocks, so padding is whole blocks
    and the last slot is the newest (possibly partial) block N_k - 1: the block grid survives.
    ``cap``: most selected blocks one head keeps (None: the static bound); the total is unchanged, the
    capped heads' leftover goes to the others.
    """
    B, H, nk = score.shape
    n_forced = n_lead + n_trail
    k_max = ada_block_width(nk, H, n_forced, n_sel, alpha) - n_forced
    if cap is not None:
        k_max = min(k_max, max(cap, n_sel))
    j = mx.arange(nk)
    lead, trail = j < n_lead, j >= nk - n_trail
    keep = ada_keep_mask(score, valid & ~(lead | trail), n_sel, alpha, k_max)
    # Layout: lead + kept blocks ascending, then the rest (padding sources), then the trailing blocks.
    order_key = mx.where(trail, 2 * nk + j, mx.where(lead | keep, j, nk + j))
    order = mx.argsort(order_key, axis=-1)
    wb = n_forced + k_max
    t = mx.arange(wb)
    slot = mx.where(t < n_lead + k_max, t, nk - wb + t)
    blocks = mx.take(order, slot, axis=-1).astype(mx.int32)
    n_kept = keep.sum(axis=-1, keepdims=True)
    real = (t < n_lead + n_kept) | (t >= n_lead + k_max)
    return blocks, real


# -- a cross-head pool with a floor (NestedKV) -----------------------------------------------------
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
