"""Baselines (SnapKV, PyramidKV, MorphKV, Random) and the Ada-KV allocation: each keeps exactly the
set its rule defines."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.caches import PAD_POSITION
from veloxquant_mlx.methods.pyramidkv import pyramid_budgets
from veloxquant_mlx.registry import get_method
from veloxquant_mlx.ops.allocation import ada_keep
from veloxquant_mlx.ops.window_scores import max_pool_1d

from conftest import greedy, make_cache, make_tiny_model, random_prompt

D = 8


def make(method, tap=True, **kw):
    if not get_method(method).prefill_only:
        kw.setdefault("prompt_eviction", "stream")  # these unit tests evict through prompt chunks
    return make_cache(method, tap=tap, **kw)


def feed(cache, keys, queries, chunk=16, end=False):
    """Prefill keys (B, H, N, D) in chunks, handing the tap the matching queries (B, Hq, N, D).
    ``end``: the last token goes alone, as mlx_lm.generate feeds a prompt's last token (the prompt
    ends there: the one-shot compression runs after its attention)."""
    N = keys.shape[2] - (1 if end else 0)
    for i in range(0, N, chunk):
        k = keys[:, :, i:min(i + chunk, N)]
        cache.update_and_fetch(k, k)
        cache.observe_queries(queries[:, :, i:min(i + chunk, N)])
    if end:
        cache.update_and_fetch(keys[:, :, N:], keys[:, :, N:])
        cache.observe_queries(queries[:, :, N:])


def kept(cache, b=0, h=0):
    return {int(p) for p in np.array(cache.kept_positions())[b, h] if p >= 0}


def needle_inputs(N, needles, q_dir, window, rng_seed=0):
    """Noise keys; head h has needle keys 4*e_h at ``needles[h]``; the last ``window`` queries of the
    GQA group of head h point along e_h (2 query heads per KV head)."""
    rng = np.random.default_rng(rng_seed)
    H = len(needles)
    keys = rng.normal(0, 0.01, (1, H, N, D)).astype(np.float32)
    queries = rng.normal(0, 0.01, (1, 2 * H, N, D)).astype(np.float32)
    for h, pos in enumerate(needles):
        for p in pos:
            keys[0, h, p] = 0
            keys[0, h, p, q_dir[h]] = 4.0
        queries[0, 2 * h:2 * h + 2, N - window:, q_dir[h]] = 4.0
    return mx.array(keys), mx.array(queries)


# -- reference scoring in numpy --------------------------------------------------------------------
def np_window_probs(q, k, q_pos, k_pos):
    """(B, Hkv, W, N) softmax attention of the window queries, summed over the GQA group."""
    B, Hq, W, _ = q.shape
    H = k.shape[1]
    G = Hq // H
    logits = np.einsum("bhgwd,bhnd->bhgwn", q.reshape(B, H, G, W, -1), k) * q.shape[-1] ** -0.5
    vis = k_pos[:, :, None, None, :] <= q_pos[None, None, None, :, None]
    logits = np.where(vis, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = np.where(vis, p, 0)
    return (p / p.sum(-1, keepdims=True)).sum(2)


def np_topk_keep(scores, budget, n_sink, recent):
    n = scores.shape[-1]
    s = scores.copy()
    s[..., :n_sink] = np.inf
    s[..., n - recent:] = np.inf
    return {int(i) for i in np.argsort(-s, kind="stable")[:budget]}


# -- SnapKV ------------------------------------------------------------------------------------------
def test_snapkv_keeps_pooled_needles_window_and_sinks():
    N, W = 40, 4
    keys, q = needle_inputs(N, [[10, 25], [15, 30]], [0, 1], W)
    cache = make("snapkv", budget=11, n_sink=1, snapkv_window=W, snapkv_kernel=3)
    assert cache.recent == W and cache.prefill_only
    feed(cache, keys[:, :, :N - 1], q[:, :, :N - 1])
    assert cache.size() == N - 1 and cache.evictions == 0  # prefill-only: nothing evicted mid-prompt
    feed(cache, keys[:, :, N - 1:], q[:, :, N - 1:], end=True)  # the prompt's last token: compress once after it
    assert cache.evictions == 1 and cache.size() == 11 and cache.offset == N
    window = set(range(N - W, N))
    assert kept(cache, 0, 0) == {0} | {9, 10, 11, 24, 25, 26} | window
    assert kept(cache, 0, 1) == {0} | {14, 15, 16, 29, 30, 31} | window
    for _ in range(5):  # decode rows are appended, never evicted again
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])
    assert cache.size() == 16 and cache.evictions == 1


@pytest.mark.parametrize("seed", [0, 1])
def test_snapkv_matches_numpy_reference(seed):
    rng = np.random.default_rng(seed)
    N, W, kernel, budget, n_sink = 50, 6, 5, 20, 2
    k = rng.normal(size=(1, 2, N, D)).astype(np.float32)
    q = rng.normal(size=(1, 4, N, D)).astype(np.float32)
    cache = make("snapkv", budget=budget, n_sink=n_sink, snapkv_window=W, snapkv_kernel=kernel)
    feed(cache, mx.array(k), mx.array(q), chunk=13, end=True)
    k_pos = np.broadcast_to(np.arange(N), (1, 2, N))
    s = np_window_probs(q[:, :, N - W:], k, np.arange(N - W, N), k_pos).sum(2)
    s[..., N - W:] = -np.inf
    pooled = np.array(max_pool_1d(mx.array(s), kernel))
    # max-pool by hand too
    pad = np.pad(s, [(0, 0), (0, 0), (kernel // 2, kernel // 2)], constant_values=-np.inf)
    assert np.allclose(pooled[..., :N - W], np.max([pad[..., i:i + N] for i in range(kernel)], 0)[..., :N - W])
    for h in range(2):
        assert kept(cache, 0, h) - {N} == np_topk_keep(pooled[0, h], budget, n_sink, W)


# -- PyramidKV -------------------------------------------------------------------------------------
@pytest.mark.parametrize("C,w,L,beta", [(512, 32, 32, 20.0), (128, 8, 5, 20.0), (100, 8, 7, 2.0), (64, 4, 2, 3.0)])
def test_pyramid_budgets_linear_and_average_to_budget(C, w, L, beta):
    b = pyramid_budgets(C, w, L, beta)
    assert len(b) == L and sum(b) == C * L  # mean exactly C
    lo = (C - w) / beta
    hi = 2 * (C - w) - lo
    for i, x in enumerate(b):
        assert abs(x - (hi - i * (hi - lo) / (L - 1) + w)) <= 1.0
    assert all(x >= y for x, y in zip(b, b[1:]))


def test_pyramidkv_layers_compress_to_their_budgets():
    model = make_tiny_model("llama", layers=4)
    cfg = KVCacheConfig(method="pyramidkv", budget=40, n_sink=2, pyramidkv_window=8, pyramidkv_beta=4.0)
    caches = KVCacheBuilder.for_model(model, cfg)
    want = pyramid_budgets(40, 8, 4, 4.0)
    assert [c.budget for c in caches] == want and sum(want) == 160
    greedy(model, random_prompt(90), max_tokens=3, prompt_cache=caches, prefill_step_size=32)
    # compressed right after the last prompt token (position 89); every decode token appended
    assert [c.size() for c in caches] == [b + caches[0].offset - 90 for b in want]
    assert all(c.evictions == 1 for c in caches)


def test_pyramidkv_rejects_budgets_that_starve_the_top_layers():
    with pytest.raises(ValueError, match="deepest layers"):
        KVCacheConfig(method="pyramidkv", budget=40, n_sink=4)  # (40 - 32) / 20 < n_sink


# -- MorphKV ---------------------------------------------------------------------------------------
def test_morphkv_keeps_window_and_top_older_tokens_in_decode():
    N, W = 30, 4
    keys, q = needle_inputs(N, [[5, 12, 20], [3, 17, 22]], [0, 1], W)
    cache = make("morphkv", budget=8, n_sink=1, morphkv_window=W, morphkv_evict_every=2)
    feed(cache, keys, q, chunk=N)
    assert cache.evictions == 1 and cache.size() == 8
    assert kept(cache, 0, 0) == {0, 5, 12, 20} | set(range(N - W, N))
    assert kept(cache, 0, 1) == {0, 3, 17, 22} | set(range(N - W, N))
    # Decode: new needles for head 0 appear; once they leave the window they compete with old ones.
    rng = np.random.default_rng(3)
    for t in range(N, N + 12):
        k = rng.normal(0, 0.01, (1, 2, 1, D)).astype(np.float32)
        qq = rng.normal(0, 0.01, (1, 4, 1, D)).astype(np.float32)
        qq[0, :2, 0, 2] = 4.0  # head 0's queries now look along e2 ...
        if t in (31, 32):
            k[0, 0, 0, 2] = 4.0  # ... where two new tokens sit
        cache.update_and_fetch(mx.array(k), mx.array(k))
        cache.observe_queries(mx.array(qq))
        assert cache.size() <= 8 + 2 and cache.offset == t + 1
    assert cache.evictions > 1
    k0 = kept(cache, 0, 0)
    assert {0, 31, 32} <= k0 and set(range(N + 12 - W, N + 12)) <= k0


@pytest.mark.parametrize("reduce", ["sum", "max"])
def test_morphkv_matches_numpy_reference(reduce):
    rng = np.random.default_rng(5)
    N, W, budget, n_sink = 40, 5, 16, 1
    k = rng.normal(size=(1, 2, N, D)).astype(np.float32) * 2
    q = rng.normal(size=(1, 4, N, D)).astype(np.float32) * 2
    cache = make("morphkv", budget=budget, n_sink=n_sink, morphkv_window=W, morphkv_reduce=reduce,
                 morphkv_evict_every=4)
    feed(cache, mx.array(k), mx.array(q), chunk=N)
    assert cache.evictions == 1
    p = np_window_probs(q[:, :, N - W:], k, np.arange(N - W, N), np.broadcast_to(np.arange(N), (1, 2, N)))
    s = p.sum(2) if reduce == "sum" else p.max(2)
    for h in range(2):
        assert kept(cache, 0, h) == np_topk_keep(s[0, h], budget, n_sink, W)


def test_morphkv_sum_and_max_differ():
    # key A: moderate attention from every window query; key B: strong attention from one query.
    rng = np.random.default_rng(0)
    N, W = 20, 4
    k = rng.normal(0, 0.01, (1, 1, N, D)).astype(np.float32)
    q = rng.normal(0, 0.01, (1, 1, N, D)).astype(np.float32)
    k[0, 0, 5, 0] = 2.0  # A
    k[0, 0, 9, 1] = 4.0  # B
    q[0, 0, N - W:, 0] = 4.0  # every window query looks a bit at A ...
    q[0, 0, N - 1, 0] = 0.0
    q[0, 0, N - 1, 1] = 4.0   # ... the last one strongly at B only
    out = {}
    for reduce in ("sum", "max"):
        cache = make("morphkv", budget=W + 1, n_sink=0, morphkv_window=W, morphkv_reduce=reduce,
                     morphkv_evict_every=1)
        feed(cache, mx.array(k), mx.array(q), chunk=N)
        out[reduce] = kept(cache) - set(range(N - W, N))
    assert out == {"sum": {5}, "max": {9}}


# -- Random ----------------------------------------------------------------------------------------
def _random_kept(seed, chunks=(40, 30, 1, 1)):
    cache = make("random", budget=20, n_sink=2, recent=3, seed=seed, random_evict_every=4)
    rng = np.random.default_rng(0)
    for s in chunks:
        k = mx.array(rng.normal(size=(1, 2, s, D)).astype(np.float32))
        cache.update_and_fetch(k, k)
    return cache, np.array(cache.kept_positions())


def test_random_is_deterministic_per_seed_and_keeps_sinks_and_recent():
    a, pa = _random_kept(0)
    _, pb = _random_kept(0)
    _, pc = _random_kept(1)
    assert np.array_equal(pa, pb) and not np.array_equal(pa, pc)
    assert a.offset == 72 and a.size() <= 20 + 4 + 30
    for h in range(2):
        s = set(pa[0, h].tolist())
        assert {0, 1} <= s
    assert not np.array_equal(pa[0, 0], pa[0, 1])  # heads draw independently


def test_random_prefill_and_decode_bounded():
    cache = make("random", budget=16, n_sink=1, random_evict_every=2)
    for _ in range(3):
        k = mx.random.normal((1, 2, 10, D))
        cache.update_and_fetch(k, k)
    for _ in range(20):
        k = mx.random.normal((1, 2, 1, D))
        cache.update_and_fetch(k, k)
        assert cache.size() <= 16 + 2 + 1
    assert cache.offset == 50 and cache.evictions > 3


# -- Ada-KV allocation -----------------------------------------------------------------------------
def np_ada(scores, budget, n_sink, recent, alpha):
    """Reference: per-head budgets (winners, floor, largest-remainder rounding) and kept rows."""
    H, R = scores.shape
    F = n_sink + recent
    sel = budget - F
    cand = np.zeros((H, R), bool)
    cand[:, n_sink:R - recent] = True
    flat = np.where(cand, scores, -np.inf).ravel()
    win = np.zeros(H * R, bool)
    win[np.argsort(-flat, kind="stable")[:H * sel]] = True
    count = win.reshape(H, R).sum(1)
    raw = count * (1 - alpha) + alpha * sel
    base = np.floor(raw + 1e-4)
    short = int(H * sel - base.sum())
    base[np.argsort(-np.round((raw - base) * 1e4), kind="stable")[:short]] += 1  # ties: lower head first
    b = base.astype(int)
    keep = []
    for h in range(H):
        s = np.where(cand[h], scores[h], -np.inf)
        keep.append(set(range(n_sink)) | set(range(R - recent, R)) | set(np.argsort(-s)[:b[h]].tolist()))
    return count, b, keep


def _ada(scores, budget, n_sink, recent, alpha):
    H, R = scores.shape
    pos = mx.broadcast_to(mx.arange(R, dtype=mx.int32), (1, H, R))
    idx, real = ada_keep(mx.array(scores[None]), pos, R, budget, n_sink, recent, alpha, PAD_POSITION)
    idx, real = np.array(idx)[0], np.array(real)[0]
    return [set(idx[h][real[h]].tolist()) for h in range(H)], idx


def test_ada_moves_budget_to_the_concentrated_head():
    R, budget, n_sink, recent = 20, 8, 1, 2
    scores = np.stack([np.linspace(10, 11, R), np.linspace(0, 1, R)])  # head 0 wins every slot
    keep, idx = _ada(scores, budget, n_sink, recent, 0.2)
    # 10 winners all in head 0: budgets round(10 * .8 + .2 * 5) = 9 and round(0 + 1) = 1
    assert [len(k) for k in keep] == [3 + 9, 3 + 1]
    assert keep[1] == {0, 18, 19, 17}  # sink, recent, its single best candidate
    assert idx.shape[-1] == 3 + 9  # storage width = the largest possible head budget
    assert sum(len(k) for k in keep) == 2 * budget


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(H=st.integers(1, 4), R=st.integers(12, 40), budget=st.integers(6, 11), n_sink=st.integers(0, 2),
       recent=st.integers(0, 3), alpha=st.sampled_from([0.0, 0.2, 0.5, 1.0]), seed=st.integers(0, 10**6))
def test_ada_counts_floor_and_total(H, R, budget, n_sink, recent, alpha, seed):
    if budget >= R:
        budget = R - 1
    if budget <= n_sink + recent:
        return
    scores = np.random.default_rng(seed).normal(size=(H, R)) * np.linspace(0.2, 3, H)[:, None]
    count, b, ref_keep = np_ada(scores, budget, n_sink, recent, alpha)
    keep, _ = _ada(scores, budget, n_sink, recent, alpha)
    sel = budget - n_sink - recent
    assert sum(len(k) for k in keep) == H * budget  # total exactly H x B
    assert all(len(k) - n_sink - recent >= np.floor(alpha * sel) for k in keep)  # floor
    assert [len(k) - n_sink - recent for k in keep] == b.tolist()  # budgets follow the winners
    assert keep == ref_keep
    if alpha == 1.0:
        assert all(x == sel for x in b)  # alpha = 1 is uniform


def _ada_snapkv(tap=True):
    rng = np.random.default_rng(1)
    N, W = 48, 4
    # head 0 attends sharply (few needles), head 1 diffusely: Ada gives head 0 fewer rows than head 1
    keys, q = needle_inputs(N, [[10, 30], []], [0, 1], W)
    k = np.array(keys)
    k[0, 1] = rng.normal(0, 0.3, (N, D))
    keys = mx.array(k)
    cache = make("snapkv", tap=tap, budget=12, n_sink=1, snapkv_window=W, snapkv_kernel=1,
                 allocation="ada")
    feed(cache, keys, q)
    return cache, keys, q


def test_ada_snapkv_ragged_attention_equals_hand_computed():
    _, keys, q = _ada_snapkv(tap=True)
    vals = keys * 2 + 1  # values distinct from keys, to check the gather of values too
    cache2 = make("snapkv", budget=12, n_sink=1, snapkv_window=4, snapkv_kernel=1, allocation="ada")
    N = keys.shape[2]
    for i in range(0, N - 1, 16):
        j = min(i + 16, N - 1)
        cache2.update_and_fetch(keys[:, :, i:j], vals[:, :, i:j])
        cache2.observe_queries(q[:, :, i:j])
    cache2.update_and_fetch(keys[:, :, N - 1:], vals[:, :, N - 1:])  # the prompt's last token ...
    cache2.observe_queries(q[:, :, N - 1:])  # ... compress right after it
    new_k = mx.random.normal((1, 2, 1, D), key=mx.random.key(7))
    k_all, v_all = cache2.update_and_fetch(new_k, new_k * 2 + 1)  # a decode step appends
    assert cache2.is_ragged and cache2.evictions == 1
    per_head = np.array(cache2.kept_per_head())[0]
    assert per_head.sum() == 2 * (12 + 1) and per_head[0] != per_head[1]
    qd = mx.random.normal((1, 4, 1, D), key=mx.random.key(8))
    cache2.observe_queries(qd)
    mask = cache2.attention_mask(None, qd)
    assert isinstance(mask, mx.array) and mask.shape == (1, 4, 1, k_all.shape[2])
    out = np.array(mx.fast.scaled_dot_product_attention(qd, k_all, v_all, scale=D ** -0.5, mask=mask))
    full_k = np.concatenate([np.array(keys), np.array(new_k)], axis=2)
    full_v = np.concatenate([np.array(vals), np.array(new_k) * 2 + 1], axis=2)
    pos = np.array(cache2.kept_positions())[0]
    for hq in range(4):
        h = hq // 2
        p = sorted(x for x in pos[h] if x >= 0)
        logits = full_k[0, h, p] @ np.array(qd)[0, hq, 0] * D ** -0.5
        w = np.exp(logits - logits.max())
        w /= w.sum()
        assert np.allclose(out[0, hq, 0], w @ full_v[0, h, p], atol=1e-5)


def test_ada_without_tap_falls_back_to_uniform_with_warning():
    import veloxquant_mlx.caches.cache as cache_module
    cache_module._warned.discard("snapkv")
    with pytest.warns(UserWarning, match="uniform"):
        cache, keys, q = _ada_snapkv(tap=False)
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])  # the prompt's last token
        cache.observe_queries(q[:, :, :1])  # compressed right after it
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])  # a decode step appends
    assert not cache.is_ragged and cache.size() == 13
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache, keys, _ = _ada_snapkv(tap=False)
        cache.update_and_fetch(keys[:, :, :1], keys[:, :, :1])  # warned once


@pytest.mark.parametrize("method,kw", [("morphkv", dict(morphkv_window=4, morphkv_evict_every=3)),
                                       ("h2o", dict(h2o_evict_every=3))])
def test_ada_decode_bounded_methods_re_evict_with_exact_total(method, kw):
    cache = make(method, budget=12, n_sink=1, allocation="ada", **kw)
    rng = np.random.default_rng(2)
    scale = np.array([0.3, 3.0])[None, :, None, None]
    for t, s in enumerate([30] + [1] * 25):
        k = mx.array((rng.normal(size=(1, 2, s, D)) * scale).astype(np.float32))
        fk, _ = cache.update_and_fetch(k, k)
        fetched_pos = np.array(cache.kept_positions())  # before observe_queries may evict
        cache.observe_queries(mx.repeat(k, 2, axis=1))
        m = cache.attention_mask("causal" if s > 1 else None, mx.repeat(k, 2, axis=1))
        if isinstance(m, mx.array):  # ragged: the mask describes the rows this step attends to
            assert m.shape[-1] == fk.shape[2]
            last = np.array(m)[0, ::2, -1]  # last query row, one query head per KV head
            hidden = np.isneginf(last) if last.dtype.kind == "f" else ~last  # (a decode mask is additive)
            assert np.array_equal(hidden, fetched_pos[0] < 0)
        pos = np.array(cache.kept_positions())
        for h in range(2):
            real = pos[0, h][pos[0, h] >= 0]
            assert len(set(real.tolist())) == len(real) and real.max() == cache.offset - 1
        if cache.evictions and cache.size() == cache.schedule.floor:  # right after an eviction step
            assert np.array(cache.kept_per_head()).sum() == 2 * 12
    assert cache.evictions >= 3 and cache.is_ragged
    assert cache.size() <= 1 + cache.recent + 20 + 3  # static width: bounded through decode


def test_ada_end_to_end_generation_and_config_errors():
    model = make_tiny_model("qwen3")
    cfg = KVCacheConfig(method="snapkv", budget=24, snapkv_window=8, allocation="ada")
    assert cfg.allocation == "ada" and KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    caches = KVCacheBuilder.for_model(model, cfg)
    toks, lp = greedy(model, random_prompt(80), max_tokens=6, prompt_cache=caches, prefill_step_size=16)
    assert len(toks) == 6 and np.isfinite(lp).all()
    assert all(c.is_ragged and np.array(c.kept_per_head()).sum() == 2 * (24 + c.offset - 80)
               for c in caches)
    with pytest.raises(ValueError, match="allocation must be one of"):
        KVCacheConfig(method="snapkv", allocation="pyramid")
    with pytest.raises(ValueError, match="floor_alpha must be <= 1"):
        KVCacheConfig(method="snapkv", allocation="ada", floor_alpha=1.5)
    with pytest.raises(TypeError, match="floor_alpha must be a number"):
        KVCacheConfig(method="snapkv", floor_alpha="x")
    with pytest.raises(ValueError, match="not supported by method 'random'"):
        KVCacheConfig(method="random", allocation="ada")
