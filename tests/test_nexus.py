"""Nexus Sampling: the paper's formulas and guarantees (Eq. 1-6, Lemma A.1/A.2/A.4/4.1, Theorem 4.2),
budget invariants, determinism, exactness without eviction and the mlx-lm contract."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx import EvictionCache
from veloxquant_mlx.methods.nexus import Nexus
from veloxquant_mlx.methods.nexus.method import min_budget
from veloxquant_mlx.methods.nexus.ops import (block_distribution, log_reservoir_priority, nexus_weights,
                                      reservoir_uniforms, select_blocks, walk)

from conftest import greedy, make_cache, make_tiny_model, random_prompt


def _np(x):
    return np.array(x.astype(mx.float32) if x.dtype in (mx.float16, mx.bfloat16) else x)


def _inclusion(blocks, nk):
    """(T, k) kept block indices -> (T, nk) 0/1 inclusion."""
    b = _np(blocks)
    inc = np.zeros((b.shape[0], nk))
    np.put_along_axis(inc, b, 1.0, axis=1)
    return inc


# -- Eq. 1-5 ---------------------------------------------------------------------------------------
def test_block_distribution_matches_reference_with_partial_block_and_causal_mask():
    rng = np.random.default_rng(0)
    W, N, D, b = 5, 23, 8, 4  # 23 rows -> 6 blocks, the last one partial (3 rows)
    q, k = rng.normal(size=(2, W, D)).astype(np.float32), rng.normal(size=(2, N, D)).astype(np.float32)
    k_pos = np.arange(N) * 2  # stored rows need not be contiguous positions
    q_pos = k_pos[-W:] - 1  # each window query sees keys up to its own position only
    s_hat = _np(block_distribution(mx.array(q), mx.array(k), mx.array(q_pos), mx.array(k_pos), 0.3, b))
    logits = np.where(k_pos[None, :] <= q_pos[:, None], 0.3 * q @ k.swapaxes(-1, -2), -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ref = np.stack([p[..., j * b:(j + 1) * b].sum(-1) for j in range(6)], -1)
    assert s_hat.shape == (2, W, 6)
    np.testing.assert_allclose(s_hat, ref / ref.sum(-1, keepdims=True), atol=1e-6)
    assert np.all(s_hat[:, :3, -1] == 0) and np.all(s_hat[:, 3:, -1] > 0)  # causal by position


def test_weights_formula_and_ablations():
    rng = np.random.default_rng(1)
    rows = rng.dirichlet(np.ones(7), size=(3, 6)).astype(np.float32)  # (batch, W, N_k)
    a = rows.mean(1)
    C = np.zeros_like(a)
    for i in range(3, 6):  # the walk takes the most recent H = 3 rows, oldest first
        C = C + (1 + (rows[:, i] * C).sum(-1, keepdims=True)) * rows[:, i]
    ramp = np.arange(7) / 6
    w = _np(nexus_weights(mx.array(rows), walk_depth=3, lam=0.5, eps_tie=1e-3))
    np.testing.assert_allclose(w, a + 0.5 * C / C.sum(-1, keepdims=True) + 1e-3 * ramp, atol=1e-6)
    # lam = 0: no walk, w is the windowed-attention score a (+ the tie ramp).
    np.testing.assert_allclose(_np(nexus_weights(mx.array(rows), lam=0.0, eps_tie=0.0)), a, atol=1e-7)


# -- Lemma A.4 / Theorem 4.2 -----------------------------------------------------------------------
def test_lemma_a4_walk_decomposition_is_exact_and_hub_scores_sum_to_zero():
    rng = np.random.default_rng(2)
    H, nk = 6, 9
    rows = rng.dirichlet(np.full(nk, 0.7), size=(16, H)).astype(np.float32)
    C = [np.zeros((16, nk), np.float32)] + [_np(walk(mx.array(rows[:, :q]))) for q in range(1, H + 1)]
    rhs = rows.sum(1) + sum(np.einsum("bi,bj,bj->bi", rows[:, q - 1], rows[:, q - 1], C[q - 1])
                            for q in range(1, H + 1))  # Σ a^(q) + Σ M_q C^(q-1), M_q = a a^T
    np.testing.assert_allclose(C[H], rhs, rtol=1e-5, atol=1e-5)
    # Σ_j h_j = 0 for the empirical covariance of distribution rows (h = Σ a*).
    flat = rows.reshape(-1, nk).astype(np.float64)
    flat /= flat.sum(1, keepdims=True)  # exact distributions in float64
    a_star = flat.mean(0)
    h = np.cov(flat, rowvar=False, bias=True) @ a_star
    assert abs(h.sum()) < 1e-14 * np.abs(h).sum() * 1e3 and np.abs(h).max() > 1e-4


def test_theorem_42_hub_amplification():
    # Rows i.i.d. from a 3-pattern mixture: block 0 is the frequently, sharply attended one (a hub,
    # h_0 > 0); blocks 1/2 are attended by rarer queries (peripheral, h < 0); block 3 is background.
    patterns = np.array([[0.85, 0.05, 0.05, 0.05],
                         [0.05, 0.85, 0.05, 0.05],
                         [0.05, 0.05, 0.85, 0.05]], np.float64)
    probs = np.array([0.6, 0.2, 0.2])
    a_star = probs @ patterns
    sigma = (patterns * probs[:, None]).T @ patterns - np.outer(a_star, a_star)
    h = sigma @ a_star  # hub scores h_j = Σ_j^T a*  (Def. A.6)
    assert h[0] > 0.04 and (h[1:3] < -0.02).all() and abs(h.sum()) < 1e-12
    rng = np.random.default_rng(3)
    T, H = 400000, 3
    rows = patterns[rng.choice(3, size=(T, H), p=probs)].astype(np.float32)
    C = _np(walk(mx.array(rows)))
    c_tilde = (C / C.sum(-1, keepdims=True)).mean(0)
    plain = rows.mean(1).mean(0)  # the unwalked window average (lam = 0 / plain average)
    margin = 0.0025  # the predicted shift (D_H / B_H) h_j is 0.005-0.012 here; sampling SE ~ 6e-4
    assert c_tilde[0] > a_star[0] + margin, (c_tilde, a_star)
    assert (c_tilde[1:3] < a_star[1:3] - margin).all(), (c_tilde, a_star)
    assert (np.abs(plain - a_star) < margin).all(), (plain, a_star)  # the plain average shows no hub shift
    assert abs(c_tilde[3] - a_star[3]) < 1e-4  # h_3 = 0: no shift


# -- Lemma A.1 / A.2: reservoir selection ------------------------------------------------------------
W_TEST = np.array([0.02, 0.05, 0.08, 0.10, 0.12, 0.15, 0.18, 0.22, 0.26, 0.30], np.float32)


def _select_many(w, k, n, T, seed):
    wb = mx.broadcast_to(mx.array(w), (T, len(w)))  # seeds vectorized as the batch dimension
    forced = mx.zeros((len(w),), mx.bool_)
    return select_blocks(wb, forced, k, n, mx.random.key(seed))


def test_reservoir_inclusion_positive_and_monotone():
    k, T = 4, 6000
    for n in (1, 5):
        freq = _inclusion(_select_many(W_TEST, k, n, T, seed=n), len(W_TEST)).mean(0)
        assert (freq > 0).all(), freq
        assert (np.diff(freq) > -0.02).all(), freq  # monotone in w up to sampling noise
        assert abs(freq.sum() - k) < 1e-9


def test_reservoir_converges_to_top_k_by_w_as_n_grows():
    k, T = 4, 2000
    top = set(np.argsort(-W_TEST)[:k])

    def agreement(n):
        blocks = _np(_select_many(W_TEST, k, n, T, seed=7))
        return np.mean([set(r) == top for r in blocks.tolist()])

    ag = [agreement(n) for n in (1, 8, 64, 512)]
    assert all(b >= a - 0.03 for a, b in zip(ag, ag[1:])), ag
    assert ag[-1] > ag[0] + 0.3, ag
    assert agreement(None) == 1.0


def test_log_domain_priority_does_not_underflow():
    w = (1e-3 * np.arange(1, 9)).astype(np.float32)  # w ~ 1/N_k for N_k ~ 1000 blocks
    for n, zero_frac in ((1, 0.5), (5, 0.1)):
        u = reservoir_uniforms(mx.random.key(n), n, (4000, 8))
        naive = (_np(u) ** (1.0 / w)).mean(0)  # plain Eq. 6 in fp32
        assert (naive == 0).mean() > zero_frac  # underflow: those blocks tie at 0, ranking is arbitrary
        logp = _np(log_reservoir_priority(mx.array(w), u))
        assert np.isfinite(logp).all()
        ok = (naive > 1e-30).all(axis=1)  # rows where the naive form is still representable
        np.testing.assert_array_equal(np.argsort(logp[ok], 1), np.argsort(np.log(naive[ok]), 1))
    kept = _inclusion(select_blocks(mx.broadcast_to(mx.array(w), (4000, 8)), mx.zeros((8,), mx.bool_), 3, 5,
                                    mx.random.key(1)), 8).mean(0)
    assert (kept > 0).all() and (np.diff(kept) > -0.02).all() and kept[-1] > kept[0] + 0.2, kept


def test_lemma_41_marginal_block_survives_under_reservoir_not_top_k():
    # 3 strong blocks, 4 competitors at 0.2, and the target (index 3) oscillating around the cutoff.
    k, T, E = 4, 4000, 4
    base = np.array([0.3, 0.3, 0.3, 0.0, 0.2, 0.2, 0.2, 0.2], np.float32)
    forced = mx.zeros((8,), mx.bool_)
    alive_topk = np.ones(T, bool)
    alive_res = np.ones(T, bool)
    per_step = []
    for e in range(E):
        w = base.copy()
        w[3] = 0.21 if e % 2 == 0 else 0.19  # above the cutoff on even steps, just below on odd ones
        wb = mx.broadcast_to(mx.array(w), (T, 8))
        alive_topk &= _inclusion(select_blocks(wb, forced, k, None), 8)[:, 3] > 0
        inc = _inclusion(select_blocks(wb, forced, k, 5, mx.random.key(100 + e)), 8)[:, 3] > 0
        per_step.append(inc.mean())
        alive_res &= inc
        if e == 0:
            assert alive_topk.all()  # above the cutoff: top-K keeps it
    assert not alive_topk.any()  # gone after its first low step, forever
    assert alive_res.mean() > 0.01, alive_res.mean()
    assert abs(alive_res.mean() - np.prod(per_step)) < 0.02  # survival = product over steps


# -- the cache ---------------------------------------------------------------------------------------
def _drive(cache, chunks, B=1, Hkv=2, Hq=4, D=8, dtype=mx.float32, seed=0, check=None):
    mx.random.seed(seed)
    for S in chunks:
        k = mx.random.normal((B, Hkv, S, D)).astype(dtype)
        v = mx.random.normal((B, Hkv, S, D)).astype(dtype)
        q = mx.random.normal((B, Hq, S, D)).astype(dtype)
        cache.update_and_fetch(k, v)
        cache.observe_queries(q)
        mx.eval(cache.state)
        if check is not None:
            check(cache)
    return cache


def _config(**kw):
    kw.setdefault("prompt_eviction", "stream")  # these tests evict through prompt chunks
    return KVCacheConfig(method="nexus", **kw)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(b=st.sampled_from([4, 8]), n_sink=st.sampled_from([0, 2, 5]), recent=st.integers(1, 9),
       extra=st.integers(0, 20), B=st.integers(1, 2), dtype=st.sampled_from([mx.float32, mx.float16]),
       per_head=st.booleans(), n=st.sampled_from([None, 3]),
       chunks=st.lists(st.integers(2, 40), min_size=3, max_size=14), seed=st.integers(0, 3))
def test_budget_invariants(b, n_sink, recent, extra, B, dtype, per_head, n, chunks, seed):
    budget = min_budget(b, n_sink, recent) + extra
    cfg = _config(budget=budget, n_sink=n_sink, recent=recent, seed=seed, nexus_block_size=b,
                  nexus_window=4, nexus_walk_depth=2, nexus_per_head=per_head, nexus_n_samples=n)
    cache = EvictionCache(cfg)
    seen = [0]

    def check(c):
        seen[0] += 1
        total = sum(chunks[:seen[0]])
        assert c.offset == total
        assert c.size() <= budget + b
        pos = _np(c.kept_positions())
        assert pos.shape[:2] == (B, 2)
        for row in pos.reshape(-1, pos.shape[-1]):
            assert (np.diff(row) > 0).all()  # unique, ascending
            kept = set(row.tolist())
            assert set(range(min(n_sink, total))) <= kept  # sinks
            assert set(range(max(total - recent, 0), total)) <= kept  # recent window
        if not per_head:
            assert (pos == pos[:, :1]).all()  # one layer-shared selection

    chunks = chunks + [1] * 10  # prefill chunks, then decode steps: the same rule
    _drive(cache, chunks, B=B, dtype=dtype, seed=seed, check=check)


def test_rows_return_to_budget_after_eviction():
    cfg = _config(budget=128)
    cache = _drive(EvictionCache(cfg), [300])
    assert cache.evictions == 1 and cache.size() <= 128 and cache.size() > 128 - 32
    for _ in range(40):
        _drive(cache, [1])
        assert cache.size() <= 128 + 32


def test_eviction_moves_keys_values_and_positions_together():
    from veloxquant_mlx.ops import gather_rows

    buf = mx.random.normal((2, 3, 50, 4))
    idx = mx.sort(mx.random.randint(0, 40, (2, 3, 7)), axis=-1).astype(mx.int32)
    expected = np.take_along_axis(_np(buf), _np(idx)[..., None], axis=2)
    np.testing.assert_array_equal(_np(gather_rows(buf, idx)), expected)
    np.testing.assert_array_equal(_np(gather_rows(buf[:, :, :40], idx)), expected)
    for per_head in (False, True):
        cache = EvictionCache(_config(budget=64, n_sink=3, recent=5, nexus_block_size=8, nexus_window=4,
                                     nexus_per_head=per_head))
        for start, S in ((0, 90), (90, 30), (120, 1), (121, 1), (122, 1)):
            pos = mx.broadcast_to(mx.arange(start, start + S, dtype=mx.float32)[None, None, :, None], (2, 2, S, 8))
            cache.update_and_fetch(pos, -pos)  # every key/value row carries its own position
            cache.observe_queries(mx.random.normal((2, 4, S, 8)))
        assert cache.evictions >= 2
        kept = _np(cache.kept_positions()).astype(np.float32)
        np.testing.assert_array_equal(_np(cache.stored("keys"))[..., 0], kept)
        np.testing.assert_array_equal(_np(cache.stored("values"))[..., 0], -kept)


def test_option_validation():
    with pytest.raises(ValueError, match="selectable block"):
        _config(budget=100)  # default b=32, n_sink=4, recent=W=16 needs >= 111
    assert _config(budget=min_budget(32, 4, 16)).budget == 111
    with pytest.raises(ValueError, match="walk_depth"):
        _config(budget=512, nexus_walk_depth=20)
    with pytest.raises(ValueError, match="n_samples"):
        _config(budget=512, nexus_n_samples=0)
    with pytest.raises(ValueError, match="lam"):
        _config(budget=512, nexus_lam=-0.1)
    o = _config(budget=512, nexus_n_samples=None).options
    assert o.n_samples is None and (o.block_size, o.window, o.walk_depth, o.lam, o.eps_tie) == (32, 16, 3, 0.5, 1e-6)
    assert EvictionCache(_config(budget=512)).recent == 16


def _kept(seed, **kw):
    cfg = _config(budget=160, seed=seed, nexus_block_size=8, **kw)
    return _np(_drive(EvictionCache(cfg), [400, 1, 1, 1]).kept_positions())


def test_determinism_per_seed():
    a, b = _kept(0), _kept(0)
    np.testing.assert_array_equal(a, b)
    others = [_kept(s) for s in (1, 2, 3)]
    assert any(not np.array_equal(a, o) for o in others)
    # n = inf: deterministic top-K by w, no dependence on the seed.
    np.testing.assert_array_equal(_kept(0, nexus_n_samples=None), _kept(5, nexus_n_samples=None))


# -- through mlx-lm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_head", [False, True])
def test_stream_generate_chunked_prefill_evicts_with_tap(per_head):
    model = make_tiny_model("qwen3")
    prompt = random_prompt(300, seed=2)
    caches = KVCacheBuilder.for_model(model, _config(budget=128, nexus_per_head=per_head))
    t, lp = greedy(model, prompt, max_tokens=40, prompt_cache=caches, prefill_step_size=64)
    assert len(t) == 40 and np.isfinite(lp).all()
    for c in caches:
        assert c.tap_active and not c.queries_from_keys
        assert c.evictions > 0 and c.queries_observed > 0
        assert c.size() <= 128 + 32 and c.offset >= 300
        pos = _np(c.kept_positions())
        assert set(range(4)) <= set(pos[0, 0].tolist())


def _numpy_block_weights(q, k, q_pos, k_pos, scale, b, groups_to_average, walk_depth=3, lam=0.5, eps=1e-6):
    """Reference: per-query-head S_hat (Eq. 1) averaged over ``groups_to_average``, then Eq. 2-5."""
    B, Hq, W, D = q.shape
    H, N = k.shape[1], k.shape[2]
    G = Hq // H
    qg = q.reshape(B, H, G, W, D)
    logits = np.einsum("bhgwd,bhnd->bhgwn", qg, k) * scale
    visible = k_pos[:, :, None, None, :] <= q_pos[None, None, None, :, None]
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    nk = -(-N // b)
    p = np.pad(p, [(0, 0)] * 4 + [(0, nk * b - N)])
    m = p.reshape(B, H, G, W, nk, b).sum(-1)
    s_hat = m / m.sum(-1, keepdims=True)
    s_hat = s_hat.mean(axis=2) if groups_to_average == "group" else s_hat.mean(axis=(1, 2))[:, None]
    a = s_hat.mean(-2)
    C = np.zeros_like(a)
    for i in range(W - walk_depth, W):
        a_q = s_hat[..., i, :]
        C = C + (1 + (a_q * C).sum(-1, keepdims=True)) * a_q
    s = a + lam * C / np.abs(C).sum(-1, keepdims=True)
    return s + eps * np.arange(nk) / (nk - 1)


@pytest.mark.parametrize("per_head", [False, True])
def test_head_averaged_attention_matches_reference(per_head):
    cfg = _config(budget=4096, nexus_block_size=8, nexus_window=6, nexus_per_head=per_head)
    cache = _drive(EvictionCache(cfg), [50, 13], B=2, Hkv=2, Hq=6, D=8)
    q, q_pos = cache.window_queries()
    expected = _numpy_block_weights(_np(q), _np(cache.stored("keys")), _np(q_pos), _np(cache.stored("positions")),
                                    cache.scale, 8, "group" if per_head else "all")
    got = _np(cache.method.block_weights(cache.view))
    assert got.shape == expected.shape == ((2, 2, 8) if per_head else (2, 1, 8))
    np.testing.assert_allclose(got, expected, rtol=2e-4, atol=1e-6)
    # The literal reading (average the vectors first) gives a different weight vector.
    vec = EvictionCache(cfg.replace(options={"head_average": "vectors"}))
    vec = _drive(vec, [50, 13], B=2, Hkv=2, Hq=6, D=8)
    assert np.abs(_np(vec.method.block_weights(vec.view)) - got).max() > 1e-3


# -- Ada-Nexus (App. C): Ada-KV head-adaptive budgets on the Nexus score -----------------------------
def _np_ada_blocks(score, n_lead, n_trail, K, alpha):
    """Reference Ada-KV at block granularity (all blocks real): per head, the kept selectable blocks
    (bool (B, H, N_k)), the winner counts and the budgets K_h."""
    B, H, nk = score.shape
    j = np.arange(nk)
    cand = np.broadcast_to(~((j < n_lead) | (j >= nk - n_trail)), score.shape)
    s = np.where(cand, score, -np.inf).reshape(B, H * nk)
    win = np.zeros_like(s, bool)
    np.put_along_axis(win, np.argsort(-s, axis=-1, kind="stable")[:, :H * K], True, axis=-1)
    count = (win.reshape(B, H, nk) & cand).sum(-1)
    raw = count * (1 - alpha) + alpha * K
    k_h = np.floor(raw + 1e-6).astype(int)
    for bb in range(B):  # largest remainder, ties to the lower head index
        rem = np.round(raw[bb] - k_h[bb], 4)
        for h in sorted(range(H), key=lambda h: (-rem[h], h))[:H * K - k_h[bb].sum()]:
            k_h[bb, h] += 1
    keep = np.zeros(score.shape, bool)
    for bb in range(B):
        for h in range(H):
            top = np.argsort(-np.where(cand[bb, h], score[bb, h], -np.inf), kind="stable")[:k_h[bb, h]]
            keep[bb, h, top] = True
    return keep, count, k_h


def _ada_cfg(**kw):
    base = dict(budget=40, n_sink=2, recent=3, nexus_block_size=4, nexus_window=4, nexus_walk_depth=2,
                allocation="ada", max_head_factor=None)  # the spec's bound (the default cap is tested apart)
    return _config(**{**base, **kw})


def _ada_cache(**kw):
    base = dict(budget=40, n_sink=2, recent=3, nexus_block_size=4, nexus_window=4, nexus_walk_depth=2,
                allocation="ada", prompt_eviction="stream",
                max_head_factor=None)  # the spec's bound (the default cap is tested apart)
    return make_cache("nexus", **{**base, **kw})


def test_ada_nexus_config_and_fallback_without_tap():
    cfg = KVCacheConfig(method="nexus", allocation="ada")
    assert cfg.allocation == "ada" and Nexus.supports_allocation("ada")
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    # No tap: uniform (per-KV-head) budgets with a warning, never ragged storage.
    from veloxquant_mlx.caches import cache as cache_module
    cache_module._warned.discard("nexus")
    cache = EvictionCache(_ada_cfg())
    with pytest.warns(UserWarning, match="uniform"):
        _drive(cache, [60, 9, 1], Hkv=3, Hq=6)
    assert cache.evictions >= 1 and not cache.is_ragged and cache.size() <= 40


def test_ada_select_blocks_matches_reference_floor_and_total():
    from veloxquant_mlx.ops.allocation import ada_block_width, ada_select_blocks

    rng = np.random.default_rng(0)
    for B, H, nk, n_lead, n_trail, K, alpha in [(2, 3, 20, 1, 2, 6, 0.2), (1, 4, 17, 0, 1, 5, 0.5),
                                                 (2, 2, 12, 2, 3, 4, 0.0), (1, 3, 25, 1, 1, 7, 1.0)]:
        # Skewed per-head scales so the allocation is far from uniform.
        score = rng.normal(size=(B, H, nk)) * rng.uniform(0.2, 3.0, size=(B, H, 1)) + rng.normal(size=(B, H, 1))
        blocks, real = ada_select_blocks(mx.array(score.astype(np.float32)), mx.ones((B, H, nk), mx.bool_),
                                         n_lead, n_trail, K, alpha)
        blocks, real = _np(blocks), _np(real)
        ref_keep, count, k_h = _np_ada_blocks(score.astype(np.float32), n_lead, n_trail, K, alpha)
        assert blocks.shape[-1] == ada_block_width(nk, H, n_lead + n_trail, K, alpha)
        assert k_h.sum(-1).tolist() == [H * K] * B  # total = H K blocks exactly
        assert (k_h >= np.floor(alpha * K)).all()  # every head keeps at least the floor
        for bb in range(B):
            for h in range(H):
                kept = blocks[bb, h][real[bb, h]]
                want = sorted(set(range(n_lead)) | set(np.flatnonzero(ref_keep[bb, h]).tolist())
                              | set(range(nk - n_trail, nk)))
                assert kept.tolist() == want, (bb, h, count[bb], k_h[bb])
                # Layout: lead + selected, then whole padding blocks, then the trailing (newest) blocks.
                assert real[bb, h, blocks.shape[-1] - n_trail:].all()
                assert blocks[bb, h, -1] == nk - 1
                assert real[bb, h].sum() == n_lead + n_trail + k_h[bb, h]
        if alpha < 1.0:
            assert len(set(k_h.ravel().tolist())) > 1  # the allocation actually moved budget


def test_ada_nexus_per_head_block_counts_follow_the_winners():
    H, b, budget = 3, 4, 40
    mx.random.seed(3)
    k = mx.random.normal((1, H, 60, 8)) * mx.array([0.3, 1.0, 3.0])[None, :, None, None]
    q = mx.random.normal((1, 2 * H, 60, 8)) * 2.0
    # Twin caches (deterministic top-K): one gives w just before the step, the other evicts.
    probe, cache = _ada_cache(nexus_n_samples=None), _ada_cache(nexus_n_samples=None)
    probe.update_and_fetch(k, k)
    probe.scale = 8 ** -0.5
    probe.window.add(q)
    w = _np(probe.method.block_weights(probe.view))
    assert w.shape == (1, H, 15)  # per KV head although per_head=False: Ada needs per-head weights
    cache.update_and_fetch(k, k)
    cache.observe_queries(q)
    assert cache.evictions == 1 and cache.is_ragged
    # 60 rows, b=4: sink block 0, recent (3 rows) block 14 forced; K = (40 - 8) // 4 = 8.
    ref_keep, count, k_h = _np_ada_blocks(w, 1, 1, 8, 0.2)
    assert len(set(k_h[0].tolist())) > 1
    pos = _np(cache.kept_positions())[0]
    for h in range(H):
        real = pos[h][pos[h] >= 0]
        blocks = np.unique(real // b)
        assert (np.bincount(real // b)[blocks] == b).all()  # whole blocks
        assert blocks.tolist() == sorted({0, 14} | set(np.flatnonzero(ref_keep[0, h]).tolist()))
        assert len(blocks) - 2 == k_h[0, h] >= np.floor(0.2 * 8)
    assert _np(cache.kept_per_head()).sum() == H * (8 + 8 * b)  # H (forced rows + K b)
    from veloxquant_mlx.ops.allocation import ada_block_width

    assert cache.size() == ada_block_width(15, H, 2, 8, 0.2) * b  # static width: forced + K_max blocks
    assert cache.size() >= 8 + k_h.max() * b


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(n_sink=st.sampled_from([0, 2, 5]), recent=st.integers(1, 6), B=st.integers(1, 2),
       n=st.sampled_from([None, 3]), alpha=st.sampled_from([0.0, 0.2, 0.6]),
       chunks=st.lists(st.integers(2, 30), min_size=2, max_size=6), seed=st.integers(0, 3))
def test_ada_nexus_budget_invariants_under_chunked_updates(n_sink, recent, B, n, alpha, chunks, seed):
    b, H = 4, 3
    budget = min_budget(b, n_sink, recent) + 12
    cache = _ada_cache(budget=budget, n_sink=n_sink, recent=recent, seed=seed, nexus_n_samples=n,
                       floor_alpha=alpha)
    state = {"ev": 0, "seen": 0}
    chunks = [budget + 2 * b] + chunks + [1] * 8

    def check(c):
        total = sum(chunks[:state["seen"] + 1])
        state["seen"] += 1
        assert c.offset == total
        pos = _np(c.kept_positions())
        assert pos.shape[:2] == (B, H)
        N = pos.shape[-1]
        for row in pos.reshape(-1, N):
            real = row[row >= 0]
            assert (np.diff(real) > 0).all()  # unique, ascending
            assert set(range(min(n_sink, total))) <= set(real.tolist())  # sinks
            assert set(range(max(total - recent, 0), total)) <= set(real.tolist())  # recent window
            padded = np.pad(row, (0, -N % b), constant_values=-2).reshape(-1, b)
            assert ((padded[:-1] >= 0).all(1) | (padded[:-1] < 0).all(1)).all()  # padding = whole blocks
        if c.evictions > state["ev"]:  # just evicted: exactly H (forced rows + K b) real rows per batch row
            state["ev"] = c.evictions
            from veloxquant_mlx.methods.nexus.ops import forced_blocks

            _, _, forced_rows = forced_blocks(c.rows_before_evict, b, n_sink, recent)
            K = (budget - forced_rows) // b
            assert (_np(c.kept_per_head()).sum(-1) == H * (forced_rows + K * b)).all()
            assert (_np(c.kept_per_head()) >= forced_rows + np.floor(alpha * K) * b).all()
        assert _np(c.kept_per_head()).mean() <= budget + b + max(chunks)

    orig = cache.evict

    def spy(keep):
        cache.rows_before_evict = cache.size()
        orig(keep)

    cache.evict = spy
    _drive(cache, chunks, B=B, Hkv=H, Hq=2 * H, seed=seed, check=check)
    assert cache.evictions >= 1


def test_ada_nexus_ragged_attention_equals_per_head_hand_computed():
    H, Hq, D, b = 2, 4, 8, 4
    cache = _ada_cache()
    rng = np.random.default_rng(5)
    hist_k, hist_v = np.zeros((1, H, 0, D), np.float32), np.zeros((1, H, 0, D), np.float32)
    checked = 0
    for S in (60, 9, 6, 1, 1):
        k = rng.normal(size=(1, H, S, D)).astype(np.float32) * np.array([0.3, 3.0], np.float32)[None, :, None, None]
        v = rng.normal(size=(1, H, S, D)).astype(np.float32)
        q = rng.normal(size=(1, Hq, S, D)).astype(np.float32)
        hist_k, hist_v = np.concatenate([hist_k, k], 2), np.concatenate([hist_v, v], 2)
        ragged_before = cache.is_ragged
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(v))
        mask = cache.attention_mask(None, mx.array(q))
        out = _np(mx.fast.scaled_dot_product_attention(mx.array(q), keys, values, scale=D ** -0.5, mask=mask))
        pos = _np(cache.fetched.positions)[0]
        cache.observe_queries(mx.array(q))
        if not ragged_before:
            continue
        checked += 1
        assert isinstance(mask, mx.array) and (pos == 2**31 - 1).any()  # some head really is padded
        off = cache.offset
        for hq in range(Hq):
            h = hq // (Hq // H)
            real = pos[h][pos[h] < 2**31 - 1]
            for i in range(S):
                p = off - S + i
                vis = real[real <= p]  # this head's real rows the query may see
                logits = hist_k[0, h, vis] @ q[0, hq, i] * D ** -0.5
                a = np.exp(logits - logits.max())
                ref = (a / a.sum()) @ hist_v[0, h, vis]
                np.testing.assert_allclose(out[0, hq, i], ref, rtol=1e-4, atol=1e-5)
        # The rows each head attends to are exactly its kept positions (from the history).
        for h in range(H):
            sel = pos[h] < 2**31 - 1
            np.testing.assert_array_equal(_np(keys)[0, h, sel], hist_k[0, h, pos[h][sel]])
    assert checked >= 3 and cache.evictions >= 2


def test_neighbour_smoothing_option():
    from veloxquant_mlx.methods.nexus.method import neighbour_max

    w = mx.array([[[0.5, 0.1, 0.3, 0.02, 0.08]]])
    forced = mx.array([True, False, False, False, True])  # sink and recent blocks lend nothing
    out = _np(neighbour_max(w, 1, forced))[0, 0]
    expect = np.array([0.1, 0.3, 0.3, 0.3, 0.02])  # max over +-1 of [0, .1, .3, .02, 0]
    np.testing.assert_allclose(out, expect / expect.sum(), rtol=1e-6)
    np.testing.assert_allclose(_np(neighbour_max(w, 0)), _np(w) / 1.0, rtol=1e-6)
    # As a cache option: the budget holds, and top-K selection keeps the chosen blocks' neighbours.
    cfg = _config(budget=160, nexus_smooth_blocks=1, nexus_n_samples=None)
    cache = _drive(EvictionCache(cfg), [400])
    assert cache.evictions == 1 and cache.size() <= 160
    with pytest.raises(ValueError):
        _config(budget=160, nexus_smooth_blocks=-1)


def test_block_max_takes_the_largest_row_of_each_block_partial_last():
    from veloxquant_mlx.methods.nexus.ops import block_max

    rows = mx.array([[0.1, 0.7, 0.2, 0.0, 0.4, 0.3, 0.9]])
    np.testing.assert_allclose(_np(block_max(rows, 3))[0], [0.7, 0.4, 0.9], rtol=1e-6)


def _anomaly_prompt(N=400, D=16, b=32, anomalous_block=5, seed=0):
    """Keys along one direction plus noise, one block along another; queries look the other way
    from that block, so attention alone never favours it (a needle no question has asked for yet)."""
    rng = np.random.default_rng(seed)
    base, odd = np.zeros(D, np.float32), np.zeros(D, np.float32)
    base[0], odd[1] = 1.0, 1.0
    keys = base + 0.05 * rng.normal(size=(1, 2, N, D)).astype(np.float32)
    lo, hi = anomalous_block * b, (anomalous_block + 1) * b
    keys[:, :, lo:hi] = odd + 0.05 * rng.normal(size=(1, 2, hi - lo, D))
    q = np.broadcast_to(3.0 * base - 3.0 * odd, (1, 4, N, D)).astype(np.float32)
    return mx.array(keys), mx.array(q), (lo, hi)


@pytest.mark.parametrize("per_head", [False, True])
def test_key_prior_keeps_an_anomalous_block_attention_ignores(per_head):
    keys, q, (lo, hi) = _anomaly_prompt()
    kept = {}
    for gamma in (0.0, 0.5):
        cfg = _config(budget=160, nexus_n_samples=None, nexus_key_prior=gamma, nexus_per_head=per_head)
        cache = EvictionCache(cfg)
        cache.update_and_fetch(keys, keys)
        if gamma:
            p = _np(cache.method.key_prior_weights(cache.view, 1 if not per_head else 2))
            assert p.shape == (1, 1 if not per_head else 2, 13)
            np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-5)
            assert np.all(p.argmax(-1) == lo // 32)  # the odd block is the most anomalous
        cache.observe_queries(q)
        assert cache.evictions == 1 and cache.size() <= 160
        pos = _np(cache.kept_positions())
        kept[gamma] = bool(((pos >= lo) & (pos < hi)).any())
    assert kept == {0.0: False, 0.5: True}


def test_key_prior_validation():
    with pytest.raises(ValueError):
        _config(budget=160, nexus_key_prior=1.5)
    with pytest.raises(ValueError, match="ada"):
        _config(budget=160, nexus_key_prior=0.5, allocation="ada")


def test_prompt_top_k_selects_by_w_once_then_samples_in_decode():
    """prompt_top_k (the default): the one-shot compression keeps exactly the top-K cache's blocks (no draw), and
    decode evictions draw from the reservoir again (they consume PRNG keys)."""
    rng = np.random.default_rng(3)
    prompt = mx.array(rng.normal(size=(1, 2, 400, 8)).astype(np.float32))
    q = mx.array(rng.normal(size=(1, 4, 400, 8)).astype(np.float32))
    caches = {}
    for name, kw in (("topk", dict(nexus_n_samples=None)), ("prompt_top_k", {}),  # the default
                     ("reservoir", dict(nexus_prompt_top_k=False))):
        c = EvictionCache(KVCacheConfig(method="nexus", budget=128, seed=1, **kw))  # prompt_eviction="end"
        c.update_and_fetch(prompt[:, :, :399], prompt[:, :, :399])
        c.observe_queries(q[:, :, :399])
        c.update_and_fetch(prompt[:, :, 399:], prompt[:, :, 399:])  # the prompt's last token alone
        rng_before = np.array(c._rng)
        c.observe_queries(q[:, :, 399:])  # the one-shot compression runs here
        assert c.evictions == 1 and not c.schedule.compressing
        caches[name] = (c, rng_before)
    one_shot = _np(caches["prompt_top_k"][0].kept_positions())
    np.testing.assert_array_equal(one_shot, _np(caches["topk"][0].kept_positions()))
    c, rng_before = caches["prompt_top_k"]
    np.testing.assert_array_equal(np.array(c._rng), rng_before)  # no draw at the one-shot step
    r, r_before = caches["reservoir"]
    assert not np.array_equal(np.array(r._rng), r_before)  # the paper's reservoir draws there
    for _ in range(80):  # decode until an eviction step runs
        tok = mx.array(rng.normal(size=(1, 2, 1, 8)).astype(np.float32))
        c.update_and_fetch(tok, tok)
        c.observe_queries(mx.array(rng.normal(size=(1, 4, 1, 8)).astype(np.float32)))
    assert c.evictions >= 2 and c.size() <= 128 + 32
    assert not np.array_equal(np.array(c._rng), rng_before)  # decode evictions sample


def test_ada_nexus_allocates_with_the_one_ada_kv_allocation(monkeypatch):
    """Ada-Nexus's block allocation is ops.allocation.ada_keep_mask over blocks, not a copy of it."""
    from veloxquant_mlx.ops import allocation

    seen = []

    def spy(scores, cand, sel, alpha, width, layer=None):
        seen.append((scores.shape, sel, width))
        return keep_mask(scores, cand, sel, alpha, width, layer)

    keep_mask = allocation.ada_keep_mask
    monkeypatch.setattr(allocation, "ada_keep_mask", spy)
    score = mx.random.uniform(shape=(1, 4, 12), key=mx.random.key(0))
    blocks, real = allocation.ada_select_blocks(score, mx.ones((1, 4, 12), mx.bool_), 1, 1, 3, 0.2)
    assert seen and seen[0][0] == (1, 4, 12) and seen[0][1] == 3
    assert int(real[..., 1:-1].sum()) == 4 * 3  # the layer's H x K selectable blocks, shared across heads
