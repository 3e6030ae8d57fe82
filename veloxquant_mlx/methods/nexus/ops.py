"""Nexus Sampling kernels (Duong et al., "Nexus Sampling", §2.1-2.3, App. A).

Pure, ``mx.compile``d functions, batched over every leading axis (batch rows, selection groups
= 1 for layer-shared selection or H_kv for per-head selection, or seeds in tests). No state, no
Python loops over blocks or heads; the only Python loop is the H-step walk recurrence (Eq. 4),
which is sequential by definition (H = 3 by default).

Shapes: ``q`` (..., W, D) observation-window queries; ``k`` (..., N, D) stored keys; ``k_pos``
(..., N) absolute key positions; ``q_pos`` (W,) or (..., W) absolute query positions. Blocks are
formed over stored rows from row 0: block j holds rows [j b, (j+1) b), the last block may be
partial, N_k = ceil(N / b) (§2.1 "Block granularity").
"""

from __future__ import annotations

import math

import mlx.core as mx


_MASKED = -1e30  # finite "minus infinity": a fully masked row becomes uniform, never NaN


def n_blocks(n_rows: int, block_size: int) -> int:
    """N_k = ceil(T_k / b) (§2.1)."""
    return -(-n_rows // block_size)


_LOG2E = math.log2(math.e)


@mx.compile
def _block_distribution(q, k, q_pos, k_pos, scale, block_size: int):
    q = q.astype(mx.float32)
    k = k.astype(mx.float32)
    # Logits in base 2: (Q Kᵀ / sqrt(D)) · log2(e), so exp(x) = 2^(x log2 e); MLX's CPU power()
    # is ~3x faster than its exp() at the same fp32 accuracy, and the log2(e) folds into the scale.
    logits = (q * (scale * _LOG2E)) @ k.swapaxes(-1, -2)  # (..., W, N): Q Kᵀ / sqrt(D)  (Eq. 1)
    visible = mx.expand_dims(k_pos, -2) <= mx.expand_dims(q_pos, -1)  # causal by absolute position
    logits = mx.where(visible, logits, _MASKED)
    e = mx.power(2.0, logits - logits.max(axis=-1, keepdims=True))  # unnormalized softmax  (Eq. 1)
    m = block_sums(e, block_size)  # BlockSum_b  (Eq. 1; App. A.1 M)
    # rownorm (Eq. 1); it also supplies the softmax denominator, which cancels: S_hat is unchanged.
    return m / m.sum(axis=-1, keepdims=True)


def block_distribution(q: mx.array, k: mx.array, q_pos: mx.array, k_pos: mx.array, scale: float,
                       block_size: int) -> mx.array:
    """S_hat = rownorm(BlockSum_b(softmax(q Kᵀ · scale))) (Eq. 1), causal by position.

    q (..., W, D), k (..., N, D), q_pos (W,) or (..., W), k_pos (..., N). Returns float32
    (..., W, N_k); each row a^(q) sums to 1 (the per-query block distribution of §2.2).
    """
    return _block_distribution(q, k, q_pos.astype(mx.int32), k_pos.astype(mx.int32),
                               mx.array(scale, mx.float32), int(block_size))


@mx.compile
def walk(rows: mx.array) -> mx.array:
    """The Nexus walk over the given rows in order (Eq. 4): rows (..., H, N_k) -> C^(H) (..., N_k).

    C^(0) = 0; for q = 1..H: C <- C + (1 + <a^(q), C>) a^(q)  (Eq. 4).
    The cache passes the most recent H window rows, oldest first (see NexusKVCache).
    """
    C = mx.zeros_like(rows[..., 0, :])
    for i in range(rows.shape[-2]):
        a_q = rows[..., i, :]
        gamma = 1.0 + (a_q * C).sum(axis=-1, keepdims=True)  # γ_q = 1 + <a^(q), C>  (Eq. 4)
        C = C + gamma * a_q  # C <- C + γ_q a^(q)  (Eq. 4)
    return C


@mx.compile
def _weights(s_hat, walk_depth: int, lam: float, eps_tie: float):
    # direct score a (Eq. 3); the walk runs over the most recent H rows, oldest first (Eq. 4)
    return _weights_from_parts(s_hat.mean(axis=-2), s_hat[..., -walk_depth:, :], lam, eps_tie)


def _weights_from_parts(a, walk_rows, lam: float, eps_tie: float):
    if lam != 0.0:
        C = walk(walk_rows)
        c_tilde = C / mx.maximum(mx.abs(C).sum(axis=-1, keepdims=True), 1e-30)  # c~ = C / ||C||_1 (§2.2)
        s = a + lam * c_tilde  # s = a + λ c~  (Eq. 2)
    else:
        s = a  # λ = 0 ablation: no walk
    nk = s.shape[-1]
    r = mx.arange(nk, dtype=mx.float32) / max(nk - 1, 1)  # r_j = j / (N_k - 1)  (Eq. 5)
    return s + eps_tie * r  # w = s + ε_tie r  (Eq. 5)


def block_sums(x: mx.array, block_size: int) -> mx.array:
    """(..., N) -> (..., N_k): the sum over each block of ``block_size`` rows (a partial last block padded
    with zero mass)."""
    N = x.shape[-1]
    nk = -(-N // block_size)
    if nk * block_size != N:
        x = mx.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nk * block_size - N)])
    return x.reshape(*x.shape[:-1], nk, block_size).sum(axis=-1)


def block_max(row_scores: mx.array, block_size: int) -> mx.array:
    """(..., N) per-row scores -> (..., N_k) the largest score in each block of ``block_size`` rows
    (the last block may be partial; pad rows never win because scores are >= 0 there)."""
    N = row_scores.shape[-1]
    nk = -(-N // block_size)
    pad = nk * block_size - N
    if pad:
        row_scores = mx.concatenate([row_scores, mx.zeros((*row_scores.shape[:-1], pad), row_scores.dtype)], axis=-1)
    return row_scores.reshape(*row_scores.shape[:-1], nk, block_size).max(axis=-1)


def nexus_weights(s_hat: mx.array, walk_depth: int = 3, lam: float = 0.5, eps_tie: float = 1e-6) -> mx.array:
    """Per-block sampling weight w (Eq. 2-5) from S_hat (..., W, N_k); returns (..., N_k).

    The walk uses the last min(walk_depth, W) rows of S_hat (the most recent window queries) in
    time order; ``lam=0`` skips the walk.
    """
    h = min(int(walk_depth), s_hat.shape[-2])
    return _weights(s_hat, h, float(lam), float(eps_tie))


def nexus_weights_from_parts(a: mx.array, walk_rows: mx.array, lam: float = 0.5,
                             eps_tie: float = 1e-6) -> mx.array:
    """w (Eq. 2-5) from the two things it reads of S_hat: the direct score a = mean over the window
    rows (..., N_k) and the walk rows (..., h, N_k), oldest first (any array when ``lam=0``). Used
    where S_hat is averaged over heads held by different processes (veloxquant_mlx.caches.shard)."""
    return _compiled_parts(a, walk_rows, float(lam), float(eps_tie))


_compiled_parts = mx.compile(_weights_from_parts)


@mx.compile
def log_reservoir_priority(w: mx.array, u: mx.array) -> mx.array:
    """log π_j = logsumexp_i(log u_ij / w_j) − log n  (Eq. 6 in the log domain).

    w (..., N_k) weights, u (n, ..., N_k) uniforms in (0, 1). Plain u^(1/w) underflows to 0 in
    fp32 once w ~ 1/N_k (e.g. 0.5^(1/1e-3) = 0); the log form keeps the same order exactly.
    Zero weight gives -inf (never sampled), as it should (Lemma A.1).
    """
    n = u.shape[0]
    logu = mx.log(mx.clip(u, 1e-38, 1.0))
    x = logu / mx.maximum(w, 0.0)  # log(u^(1/w)) = log u / w  (Eq. 6)
    x = mx.where(mx.isnan(x), -mx.inf, x)
    return mx.logsumexp(x, axis=0) - math.log(n)  # log((1/n) Σ_i u_i^(1/w))  (Eq. 6)


def reservoir_uniforms(key: mx.array, n: int, shape) -> mx.array:
    """n independent U(0,1) draws per block (Eq. 6): (n, *shape) float32."""
    return mx.random.uniform(shape=(n, *shape), key=key)


@mx.compile
def _top_blocks(score, forced, n_keep: int):
    s = mx.where(mx.isnan(score), -mx.inf, score.astype(mx.float32))
    s = mx.where(forced, mx.inf, s)  # forced sink / recent blocks always win (§2.3)
    top = mx.argpartition(-s, kth=n_keep - 1, axis=-1)[..., :n_keep]
    return mx.sort(top, axis=-1).astype(mx.int32)


def top_blocks(score: mx.array, forced: mx.array, n_keep: int) -> mx.array:
    """Ascending indices (..., n_keep) of the forced blocks plus the highest-score others (§2.3)."""
    nk = score.shape[-1]
    if n_keep >= nk:
        return mx.broadcast_to(mx.arange(nk, dtype=mx.int32), score.shape)
    return _top_blocks(score, forced, int(n_keep))


def select_blocks(w: mx.array, forced: mx.array, n_keep: int, n_samples: int | None,
                  key: mx.array | None = None) -> mx.array:
    """Keep the forced blocks and the top K = n_keep - B_forced others (§2.3).

    By the reservoir priority π (Eq. 6) with ``n_samples`` draws, or by w itself when
    ``n_samples is None`` (the n -> ∞ deterministic limit, Lemma A.2). w (..., N_k); forced (N_k,)
    or broadcastable bool. Returns ascending int32 block indices (..., n_keep).
    """
    return top_blocks(block_priority(w, n_samples, key), forced, n_keep)


def block_priority(w: mx.array, n_samples: int | None, key: mx.array | None = None) -> mx.array:
    """The selection score of every block: log π (Eq. 6, ``n_samples`` draws) or w itself when
    ``n_samples is None`` (Lemma A.2's deterministic limit). (..., N_k) -> (..., N_k)."""
    if n_samples is None:
        return w
    return log_reservoir_priority(w, reservoir_uniforms(key, int(n_samples), w.shape))


@mx.compile
def _block_rows(blocks, block_size: int, n_keep_rows: int):
    rows = mx.expand_dims(blocks, -1) * block_size + mx.arange(block_size, dtype=mx.int32)
    return rows.reshape(*blocks.shape[:-1], -1)[..., :n_keep_rows]


def block_rows(blocks: mx.array, block_size: int, n_rows: int) -> mx.array:
    """Token row indices of ascending kept blocks whose last entry is the (possibly partial) final
    block N_k - 1 of an ``n_rows``-row store: (..., k) -> (..., (k-1) b + last block size)."""
    nk = n_blocks(n_rows, block_size)
    last = n_rows - (nk - 1) * block_size
    return _block_rows(blocks, int(block_size), blocks.shape[-1] * block_size - (block_size - last))


def forced_blocks(n_rows: int, block_size: int, n_sink: int, recent: int):
    """(forced block mask (N_k,) bool, number of forced blocks, number of forced rows).

    Forced: the blocks holding the first ``n_sink`` rows (the attention-sink block) and the blocks
    holding the last ``max(recent, 1)`` rows (the recent window; the newest, possibly partial,
    block is always among them) (§2.3 "B_forced"). Counts are closed-form Python ints.
    """
    nk = n_blocks(n_rows, block_size)
    sink_blocks = min(n_blocks(n_sink, block_size), nk)
    first_recent = max((n_rows - max(recent, 1)) // block_size, sink_blocks)
    j = mx.arange(nk)
    mask = (j < sink_blocks) | (j >= first_recent)
    n_forced = sink_blocks + (nk - first_recent)
    # Every forced block is full except the newest one, which holds the remainder.
    forced_rows = (n_forced - 1) * block_size + (n_rows - (nk - 1) * block_size)
    return mask, n_forced, forced_rows


def shared_block_weights(d, s_sum: mx.array, n_local: int, walk_depth: int, lam: float,
                         eps_tie: float) -> mx.array:
    """Nexus's layer-shared block weights w (B, 1, N_k) when the heads are split across ranks.

    ``s_sum`` (B, W, N_k) is this rank's S_hat summed over its ``n_local`` (KV head x GQA) heads. The
    weights read only two things of the head-averaged S_hat: its mean over the W window rows (the
    direct score) and its last ``walk_depth`` rows (the walk), so one all_sum of (B, 1 + h, N_k)
    float32 gives every rank the same w (h = 0 when ``lam = 0``)."""
    W = s_sum.shape[-2]
    h = min(int(walk_depth), W) if lam != 0.0 else 0
    part = s_sum.sum(axis=-2, keepdims=True)
    if h:
        part = mx.concatenate([part, s_sum[..., W - h:, :]], axis=-2)
    tot = d.all_sum(part) / float(n_local * d.size)  # (B, 1 + h, N_k): sums over every head -> means
    a = tot[:, None, 0] / float(W)
    return nexus_weights_from_parts(a, tot[:, None, 1:] if h else a, lam, eps_tie)


def head_means(d, k_sum: mx.array, q: mx.array, n_kv_local: int):
    """(k_mean (B, 1, N, D), q_mean (B, 1, W, D)) over every rank's heads, in one all_sum; ``k_sum``
    is this rank's keys summed over its KV heads, ``q`` its window queries (B, Hq_l, W, D)."""
    N = k_sum.shape[2]
    both = d.all_sum(mx.concatenate([k_sum, q.astype(k_sum.dtype).sum(axis=1, keepdims=True)], axis=2))
    return both[:, :, :N] / float(n_kv_local * d.size), both[:, :, N:] / float(q.shape[1] * d.size)
