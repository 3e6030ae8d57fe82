"""Multi-scale key-anomaly scoring (pure MLX, vectorized): how far each key lies from the keys around it.

Needs no query, so the score is the same whatever question follows. The NestedKV method ranks rows
by it, and Nexus's optional key prior mixes it into its block weights; both read it from here.

All functions take keys (B, H, N, D) and a ``valid`` mask (B, H, N) whose True rows form a prefix
of every (b, h) row list (the cache compacts ragged storage before calling), and work over batch,
heads, blocks and tokens at once; sizes are Python ints from shapes.

Scales: anomaly a_x(i) = 1 - cos(k_i, mu_x(i)) against
  stable    mu_s      mean of all valid keys of the head,
  episodic  mu_e(i)   mean of the fixed block [j*b, (j+1)*b) holding i, b = clip(N // 32, 128, 256),
  current   mu_c(i)   mean of the trailing window i-W+1 .. i (W = 64).
The three min-max normalized anomalies are blended per head (log-prior + beta * top/bottom gap,
softmax) and routed per token toward the strongest scale by a surprise gate.
"""

from __future__ import annotations

import dataclasses
import functools

import mlx.core as mx

_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class AnomalyParams:
    """The scoring constants (the defaults of every method that scores by key anomaly)."""

    window: int = 64  # W: trailing window of the current-memory anchor
    prior: tuple = (0.4, 0.4, 0.2)  # blend log-prior (stable, episodic, current)
    beta: float = 3.0  # head-adaptive blend temperature
    tau: float = 0.60  # surprise gate threshold
    kappa: float = 10.0  # surprise gate sharpness
    gap_frac: float = 0.10  # top/bottom fraction of the discriminative gap


ANOMALY_DEFAULTS = AnomalyParams()



def episodic_block_size(n: int) -> int:
    """clip(floor(N / 32), 128, 256) (spec step 1)."""
    return int(min(max(n // 32, 128), 256))


def _cos(dot, kn, mn):
    return dot / mx.maximum(kn * mn, _EPS)


def _valid_mean(keys, valid):
    vf = valid.astype(mx.float32)[..., None]
    n = mx.maximum(vf.sum(axis=2, keepdims=True), 1.0)
    return (keys * vf).sum(axis=2, keepdims=True) / n  # (B, H, 1, D)


def stable_anomaly(keys: mx.array, valid: mx.array | None = None) -> mx.array:
    """1 - cos(k_i, global mean of the head's valid keys). (B, H, N) float32."""
    k = keys.astype(mx.float32)
    valid = mx.ones(k.shape[:3], mx.bool_) if valid is None else valid
    mu = _valid_mean(k, valid)  # (B, H, 1, D)
    kn = mx.sqrt(mx.square(k).sum(-1))
    dot = (k @ mu.swapaxes(-1, -2))[..., 0]
    return 1.0 - _cos(dot, kn, mx.sqrt(mx.square(mu).sum(-1)))


def episodic_anomaly(keys: mx.array, block: int, valid: mx.array | None = None) -> mx.array:
    """1 - cos(k_i, mean of the fixed ``block``-row block containing i). (B, H, N) float32."""
    k = keys.astype(mx.float32)
    B, H, N, D = k.shape
    valid = mx.ones((B, H, N), mx.bool_) if valid is None else valid
    mu_s = _valid_mean(k, valid)
    nb = -(-N // block)
    pad = nb * block - N
    vf = valid.astype(mx.float32)
    kc = (k - mu_s) * vf[..., None]  # centred first: better-conditioned sums
    if pad:
        kc = mx.concatenate([kc, mx.zeros((B, H, pad, D), mx.float32)], axis=2)
        vf = mx.concatenate([vf, mx.zeros((B, H, pad), mx.float32)], axis=2)
        k = mx.concatenate([k, mx.zeros((B, H, pad, D), mx.float32)], axis=2)
    cnt = mx.maximum(vf.reshape(B, H, nb, block).sum(-1), 1.0)[..., None]  # (B, H, nb, 1)
    mu_e = mu_s + kc.reshape(B, H, nb, block, D).sum(3) / cnt  # (B, H, nb, D)
    kb = k.reshape(B, H, nb, block, D)
    dot = (kb @ mu_e[..., None])[..., 0]  # (B, H, nb, block)
    kn = mx.sqrt(mx.square(kb).sum(-1))
    mn = mx.sqrt(mx.square(mu_e).sum(-1))[..., None]
    return (1.0 - _cos(dot, kn, mn)).reshape(B, H, nb * block)[:, :, :N]


def current_anomaly(keys: mx.array, window: int, valid: mx.array | None = None) -> mx.array:
    """1 - cos(k_i, mean of the trailing ``window`` rows ending at i, i included). (B, H, N)."""
    k = keys.astype(mx.float32)
    B, H, N, D = k.shape
    valid = mx.ones((B, H, N), mx.bool_) if valid is None else valid
    mu_s = _valid_mean(k, valid)
    vf = valid.astype(mx.float32)
    kc = (k - mu_s) * vf[..., None]
    cs = mx.cumsum(kc, axis=2)
    cv = mx.cumsum(vf, axis=2)
    W = int(window)
    if W < N:
        zk = mx.zeros((B, H, W, D), mx.float32)
        zv = mx.zeros((B, H, W), mx.float32)
        cs = cs - mx.concatenate([zk, cs[:, :, :N - W]], axis=2)
        cv = cv - mx.concatenate([zv, cv[:, :, :N - W]], axis=2)
    mu_c = mu_s + cs / mx.maximum(cv, 1.0)[..., None]
    return 1.0 - _cos((k * mu_c).sum(-1), mx.sqrt(mx.square(k).sum(-1)), mx.sqrt(mx.square(mu_c).sum(-1)))


def _masked_minmax(x, stat):
    """Min-max normalize along the last axis over the ``stat`` rows (0 where the range is ~0)."""
    lo = mx.where(stat, x, mx.inf).min(axis=-1, keepdims=True)
    hi = mx.where(stat, x, -mx.inf).max(axis=-1, keepdims=True)
    rng = hi - lo
    ok = rng > _EPS
    return mx.where(ok, (x - lo) / mx.where(ok, rng, 1.0), 0.0)


def discriminative_gap(norm: mx.array, stat: mx.array, frac: float = 0.10) -> mx.array:
    """Mean of the top ``frac`` minus mean of the bottom ``frac`` of each head's stat rows.

    norm (..., N) in [0, 1]; stat (..., N) bool. Count per head = max(1, ceil(frac * n_stat))."""
    stat = mx.broadcast_to(stat, norm.shape)
    n = stat.sum(axis=-1, keepdims=True).astype(mx.int32)
    kf = mx.maximum(mx.ceil(n.astype(mx.float32) * frac).astype(mx.int32), 1)
    srt = mx.sort(mx.where(stat, norm, 2.0), axis=-1)  # stat values first, ascending
    srt = mx.where(srt > 1.5, 0.0, srt)
    cs = mx.concatenate([mx.zeros(srt.shape[:-1] + (1,), mx.float32), mx.cumsum(srt, axis=-1)], axis=-1)
    nn = mx.maximum(n, 1)
    kf = mx.minimum(kf, nn)
    bottom = mx.take_along_axis(cs, kf, axis=-1) / kf
    top = (mx.take_along_axis(cs, nn, axis=-1) - mx.take_along_axis(cs, nn - kf, axis=-1)) / kf
    return (top - bottom)[..., 0]


def anomaly_scores(keys: mx.array, valid: mx.array, forced: mx.array, *, window: int, block: int,
                   prior=ANOMALY_DEFAULTS.prior, beta: float = ANOMALY_DEFAULTS.beta,
                   tau: float = ANOMALY_DEFAULTS.tau, kappa: float = ANOMALY_DEFAULTS.kappa,
                   gap_frac: float = ANOMALY_DEFAULTS.gap_frac) -> mx.array:
    """Final multi-scale anomaly score per row (B, H, N): +inf for forced valid rows, -inf for invalid rows.

    Compiled once per (shape, constants): MLX fuses the elementwise passes over (B, H, N, D)."""
    fn = _compiled_scores(int(window), int(block), tuple(float(p) for p in prior), float(beta), float(tau),
                          float(kappa), float(gap_frac))
    return fn(keys, valid, forced)


@functools.lru_cache(maxsize=32)
def _compiled_scores(window, block, prior, beta, tau, kappa, gap_frac):
    return mx.compile(functools.partial(_scores, window=window, block=block, prior=prior, beta=beta, tau=tau,
                                        kappa=kappa, gap_frac=gap_frac))


def _rows(P, idx):
    """Rows ``idx`` (B, H, M) of the prefix-sum table P (B, H, N, D); index -1 reads the empty sum (0)."""
    got = mx.take_along_axis(P, mx.maximum(idx, 0)[..., None], axis=2)
    return mx.where((idx >= 0)[..., None], got, 0.0)


def fused_anomalies(keys: mx.array, valid: mx.array, window: int, block: int) -> mx.array:
    """The three anomalies (3, B, H, N) from one prefix sum of the centred keys (valid rows must be a prefix).

    Equal to ``stack([stable_anomaly, episodic_anomaly, current_anomaly])`` on valid rows (to fp32
    rounding); invalid rows get finite values that callers mask. With kc = k - mu_s and
    P = cumsum(kc), every anchor is mu_s plus a difference of two rows of P: block sums
    P[min(e, n)-1] - P[s-1], window sums P[i] - P[i-W] (a valid row's window is all valid because valid
    rows are a prefix). |k| is computed once, mu_s and k . mu_s are matrix-vector products, the episodic
    anchors are (B, H, n_blocks, D) and gathered per row once; the current anchor is never stored."""
    k = keys.astype(mx.float32)
    B, H, N, D = k.shape
    W = int(window)
    n = valid.astype(mx.int32).sum(-1, keepdims=True)  # (B, H, 1) valid rows per head
    vf = valid.astype(mx.float32)
    mu_s = (vf[:, :, None, :] @ k) / mx.maximum(n, 1).astype(mx.float32)[..., None]  # (B, H, 1, D)
    P = mx.cumsum(k - mu_s, axis=2)  # centred first: better-conditioned differences
    nb = -(-N // block)
    start = mx.arange(nb, dtype=mx.int32) * block
    end = mx.minimum(start + block, n)  # (B, H, nb)
    cnt = end - start
    blk_sum = _rows(P, end - 1) - _rows(P, mx.broadcast_to(start - 1, end.shape))
    mu_e = mu_s + mx.where((cnt > 0)[..., None], blk_sum / mx.maximum(cnt, 1).astype(mx.float32)[..., None], 0.0)
    blk = mx.arange(N, dtype=mx.int32) // block
    mn_e = mx.sqrt(mx.square(mu_e).sum(-1))[:, :, blk]  # (B, H, N)
    dot_e = (k * mu_e[:, :, blk]).sum(-1)
    kn = mx.sqrt(mx.square(k).sum(-1))  # (B, H, N), once for all three scales
    dot_s = (k @ mu_s.swapaxes(-1, -2))[..., 0]
    mn_s = mx.sqrt(mx.square(mu_s).sum(-1))
    cnt_c = mx.minimum(mx.arange(1, N + 1, dtype=mx.float32), float(W))[:, None]
    if W < N:  # window sums without a shifted copy: rows < W and rows >= W apart
        mu_h = mu_s + P[:, :, :W] / cnt_c[:W]
        mu_t = mu_s + (P[:, :, W:] - P[:, :, :N - W]) / float(W)
        dot_c = mx.concatenate([(k[:, :, :W] * mu_h).sum(-1), (k[:, :, W:] * mu_t).sum(-1)], axis=2)
        mn_c = mx.concatenate([mx.square(mu_h).sum(-1), mx.square(mu_t).sum(-1)], axis=2)
    else:
        mu_c = mu_s + P / cnt_c
        dot_c, mn_c = (k * mu_c).sum(-1), mx.square(mu_c).sum(-1)
    a_s = 1.0 - _cos(dot_s, kn, mn_s)
    a_e = 1.0 - _cos(dot_e, kn, mn_e)
    a_c = 1.0 - _cos(dot_c, kn, mx.sqrt(mn_c))
    return mx.stack([a_s, a_e, a_c])


def _scores(keys, valid, forced, *, window, block, prior, beta, tau, kappa, gap_frac):
    stat = valid & ~forced
    a = fused_anomalies(keys, valid, window, block)  # (3, B, H, N)
    a = _masked_minmax(a, stat)
    gap = discriminative_gap(a, stat, gap_frac)  # (3, B, H)
    logp = mx.log(mx.array(prior, mx.float32)).reshape(3, 1, 1)
    w = mx.softmax(logp + beta * gap, axis=0)[..., None]  # (3, B, H, 1)
    blend = (w * a).sum(axis=0)
    strongest = a.max(axis=0)
    surprise = _masked_minmax(mx.sqrt(mx.var(a, axis=0)), stat)  # cross-scale std, min-max normalized
    nst = mx.maximum(stat.sum(-1, keepdims=True), 1)
    surprise = surprise - mx.where(stat, surprise, 0.0).sum(-1, keepdims=True) / nst  # mean-centred
    g = mx.sigmoid(kappa * (surprise - tau))
    s = (1.0 - g) * blend + g * strongest
    return mx.where(valid, mx.where(forced, mx.inf, s), -mx.inf)
