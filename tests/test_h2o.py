"""H2O: cumulative attention scores, heavy hitters + recent window + sinks, bounded through decode."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.methods.h2o import attention_mass

from conftest import greedy, make_cache, make_tiny_model, random_prompt

# The hand-fed tests mix single- and multi-token chunks on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:.*earlier generation")


def _cache(budget, n_sink=2, recent=None, evict_every=4, query_block=256):
    return make_cache("h2o", tap=None, budget=budget, n_sink=n_sink, recent=recent, prompt_eviction="stream",
                      options=dict(evict_every=evict_every, query_block=query_block))


def _feed(cache, k, q, chunks):
    start = 0
    for c in chunks:
        cache.update_and_fetch(k[:, :, start:start + c], k[:, :, start:start + c])
        cache.observe_queries(q[:, :, start:start + c])
        start += c


def _np_cumulative(q, k, scale):
    """Brute force: cumulative causal attention mass per key, summed over the GQA group."""
    q, k = np.array(q, np.float64), np.array(k, np.float64)
    B, Hq, S, D = q.shape
    H = k.shape[1]
    out = np.zeros((B, H, S))
    for b in range(B):
        for h in range(Hq):
            lg = q[b, h] @ k[b, h // (Hq // H)].T * scale
            lg[np.triu_indices(S, 1)] = -np.inf
            p = np.exp(lg - lg.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            out[b, h // (Hq // H)] += p.sum(0)
    return out


def test_options_and_defaults():
    cfg = KVCacheConfig(method="h2o", budget=128)
    assert cfg.recent == 64 and cfg.h2o.evict_every == 32 and cfg.h2o.query_block == 256
    with pytest.raises(ValueError):
        KVCacheConfig(method="h2o", budget=64, h2o_query_block=0)


@settings(max_examples=12, deadline=None)
@given(budget=st.integers(8, 40), n_sink=st.integers(0, 3), every=st.integers(1, 8),
       chunks=st.lists(st.integers(1, 30), min_size=1, max_size=6), seed=st.integers(0, 9))
def test_budget_invariants(budget, n_sink, every, chunks, seed):
    mx.random.seed(seed)
    c = _cache(budget, n_sink=n_sink, evict_every=every, query_block=7)
    n = sum(chunks) + 5
    k = mx.random.normal((1, 2, n, 8))
    q = mx.random.normal((1, 4, n, 8))
    seen = 0
    for ch in chunks + [1] * 5:
        c.update_and_fetch(k[:, :, seen:seen + ch], k[:, :, seen:seen + ch])
        c.observe_queries(q[:, :, seen:seen + ch])
        seen += ch
        assert c.offset == seen == c.tokens_seen
        assert c.size() <= max(budget + every, ch)  # bounded after every observed step
        pos = np.array(c.kept_positions())
        assert (np.diff(pos, axis=-1) > 0).all()
        if c.evictions:
            rows = c.size()
            assert rows <= budget + every
            for p in range(min(n_sink, seen)):
                assert (pos == p).any(-1).all()  # sinks always kept
            for p in range(seen - c.recent - (rows - budget), seen):
                assert (pos == p).any(-1).all()  # the recent window (plus rows since) is kept
    assert np.isfinite(np.array(c.stored("score"))).all()


def test_hand_built_pattern_keeps_top_cumulative_plus_recent():
    """Queries aim at chosen 'heavy' keys (different per KV head); one eviction keeps exactly the
    sinks, the recent window and the top cumulative-score keys."""
    rng = np.random.default_rng(0)
    N, D, budget, n_sink, recent = 64, 8, 16, 2, 6
    k = rng.normal(0, 0.1, (1, 2, N, D)).astype(np.float32)
    q = rng.normal(0, 0.1, (1, 4, N, D)).astype(np.float32)
    heavy = {0: [5, 9, 17, 30, 41, 50, 52, 55], 1: [3, 12, 13, 28, 33, 40, 47, 51]}
    for h, ps in heavy.items():
        for j, p in enumerate(ps):
            k[0, h, p, j % D] = 12.0
        q[0, 2 * h:2 * h + 2, :, :] += 1.5  # every query of the group looks for all directions
    c = _cache(budget, n_sink=n_sink, recent=recent, evict_every=8)
    c.update_and_fetch(mx.array(k), mx.array(k))
    c.observe_queries(mx.array(q))
    assert c.evictions == 1 and c.size() == budget
    ref = _np_cumulative(q, k, D ** -0.5)
    for h in (0, 1):
        middle = np.arange(n_sink, N - recent)
        top = middle[np.argsort(-ref[0, h, middle], kind="stable")[:budget - n_sink - recent]]
        want = sorted(set(range(n_sink)) | set(range(N - recent, N)) | set(top.tolist()))
        got = np.array(c.kept_positions())[0, h].tolist()
        assert got == want
        # the planted heavy hitters are what won (outside the recent window)
        assert set(p for p in heavy[h] if p < N - recent) <= set(got)


def test_scores_match_brute_force_and_chunking():
    rng = np.random.default_rng(1)
    N, D = 90, 16
    k = mx.array(rng.normal(size=(1, 2, N, D)).astype(np.float32))
    q = mx.array(rng.normal(size=(1, 4, N, D)).astype(np.float32))
    one = _cache(512, query_block=256)
    _feed(one, k, q, [N])
    chunked = _cache(512, query_block=5)
    _feed(chunked, k, q, [7, 31, 1, 1, 50])
    ref = _np_cumulative(np.array(q), np.array(k), D ** -0.5)
    np.testing.assert_allclose(np.array(one.stored("score")), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(chunked.stored("score")), np.array(one.stored("score")),
                               rtol=1e-5, atol=1e-5)
    assert one.evictions == chunked.evictions == 0


def test_attention_mass_sub_blocks_equal_one_block():
    rng = np.random.default_rng(2)
    k = mx.array(rng.normal(size=(2, 2, 70, 8)).astype(np.float32))
    q = mx.array(rng.normal(size=(2, 6, 30, 8)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(70, dtype=mx.int32), (2, 2, 70))
    a = attention_mass(q, k, pos, 40, 0.3, query_block=1000)
    b = attention_mass(q, k, pos, 40, 0.3, query_block=4)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    # every query distributes exactly one unit of mass per query head
    np.testing.assert_allclose(np.array(a.sum(-1)), 3 * 30, rtol=1e-5)


def _run(model, prompt, step, budget=32):
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=budget, n_sink=2,
                                                           h2o_evict_every=8, h2o_query_block=16,
                                                           prompt_eviction="stream"))
    t, lp = greedy(model, prompt, max_tokens=12, prompt_cache=caches, prefill_step_size=step)
    return caches, t, lp


def test_stream_generate_chunked_prefill_evicts_and_stays_bounded():
    model = make_tiny_model("qwen3")
    prompt = random_prompt(150, seed=4)
    caches, t, lp = _run(model, prompt, step=32)
    assert len(t) == 12 and np.isfinite(lp).all()
    for c in caches:
        assert c.tap_active and not c.queries_from_keys
        assert c.evictions >= 5  # during chunked prefill and during decode
        assert c.offset == 150 + len(t)  # mlx-lm runs one token ahead
        assert c.size() <= 32 + 8
        assert c.kept_bytes < c.full_seq_bytes
        pos = np.array(c.kept_positions())
        assert (pos[..., :2] == [0, 1]).all()


def test_deterministic():
    model = make_tiny_model("llama")
    prompt = random_prompt(120, seed=5)
    c1, t1, lp1 = _run(model, prompt, step=32)
    c2, t2, lp2 = _run(model, prompt, step=32)
    assert t1 == t2 and np.array_equal(lp1, lp2)
    for a, b in zip(c1, c2):
        assert np.array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))


