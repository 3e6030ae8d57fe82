"""The mlx-lm contract: exact equivalence, invariants, fresh caches, query tap, host syncs, errors."""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm import generate
from mlx_lm.models import base as mlx_base
from mlx_lm.models import llama as llama_module
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, Needs, install_query_tap, remove_query_tap
from veloxquant_mlx.methods.streaming import StreamingLLM
from veloxquant_mlx.tap import query_tap_installed

from conftest import forbid_host_sync, greedy, make_tiny_model, random_prompt, tiny_tokenizer


# -- install: fresh caches per generate() ----------------------------------------------------------
def test_generate_text_equivalence_after_install():
    model = make_tiny_model("llama")
    prompt = " ".join(f"t{i}" for i in random_prompt(40, seed=2))
    ref = generate(model, tiny_tokenizer(), prompt, max_tokens=10, prefill_step_size=8)
    KVCacheBuilder.install(model, KVCacheConfig(method="streaming", budget=1024))
    try:
        out1 = generate(model, tiny_tokenizer(), prompt, max_tokens=10, prefill_step_size=8)
        out2 = generate(model, tiny_tokenizer(), prompt, max_tokens=10, prefill_step_size=8)
    finally:
        KVCacheBuilder.uninstall(model)
    assert out1 == ref and out2 == ref  # fresh caches on every call


def test_install_builds_fresh_caches_each_call_and_uninstall_restores():
    model = make_tiny_model("llama")
    cfg = KVCacheConfig(method="streaming", budget=64)
    KVCacheBuilder.install(model, cfg)
    a, b = model.make_cache(), model.make_cache()
    assert all(isinstance(c.method, StreamingLLM) for c in a)
    assert all(x is not y for x, y in zip(a, b))
    assert [c.config.seed + c.layer_idx for c in a] == [0, 1]
    assert [c.layer_idx for c in a] == [0, 1]
    KVCacheBuilder.install(model, cfg)  # idempotent
    KVCacheBuilder.uninstall(model)
    assert all(type(c) is KVCache for c in model.make_cache())
    assert not query_tap_installed(model)


def test_per_layer_seeds():
    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=64, seed=10))
    keys = [np.array(c._rng).tolist() for c in caches]
    assert keys[0] == np.array(mx.random.key(10)).tolist()
    assert keys[1] == np.array(mx.random.key(11)).tolist()


def test_non_full_attention_layers_keep_model_cache():
    model = make_tiny_model("llama")
    # A model whose make_cache says layer 1 is sliding-window keeps RotatingKVCache there.
    model.make_cache = lambda: [KVCache(), RotatingKVCache(max_size=16)]
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=64))
    assert isinstance(caches[0], EvictionCache) and type(caches[1]) is RotatingKVCache


def test_shared_list_pattern_is_warned():
    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=64))
    model.make_cache = lambda *a, **k: caches  # the pattern from older docs
    prompt = random_prompt(20)
    greedy(model, prompt, max_tokens=4)
    with pytest.warns(UserWarning, match="KVCacheBuilder.install"):
        greedy(model, prompt, max_tokens=4)


# -- eviction invariants -----------------------------------------------------------------------
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(budget=st.integers(12, 80), n_sink=st.integers(0, 4), recent=st.integers(0, 6),
       evict_every=st.integers(1, 24), batch=st.integers(1, 2), heads=st.sampled_from([1, 2]),
       dtype=st.sampled_from([mx.float32, mx.float16, mx.bfloat16]),
       chunks=st.lists(st.integers(1, 40), min_size=1, max_size=10), tap=st.booleans())
def test_streaming_invariants(budget, n_sink, recent, evict_every, batch, heads, dtype, chunks, tap):
    if budget <= n_sink + recent:
        recent = 0
    cfg = KVCacheConfig(method="streaming", budget=budget, n_sink=n_sink, recent=recent,
                        streaming_evict_every=evict_every, prompt_eviction="stream")
    cache = EvictionCache(cfg)
    cache.queries_from_keys = not tap
    seen = 0
    for i, s in enumerate(chunks):
        k = mx.random.normal((batch, heads, s, 8), key=mx.random.key(i)).astype(dtype)
        keys, values = cache.update_and_fetch(k, k)
        seen += s
        assert keys.shape[2] == values.shape[2] <= budget + evict_every + s  # peak: budget + slack + chunk
        assert mx.array_equal(keys[:, :, -s:], k)  # new rows are the last S positions
        if tap:
            cache.observe_queries(mx.repeat(k, 2, axis=1))
        assert cache.offset == seen == cache.tokens_seen
        assert cache.size() <= budget + evict_every
        if cache.evictions and cache.size() == budget:  # just evicted: allocation follows the budget
            assert cache.keys.shape[2] == budget + evict_every + 1
        pos = np.array(cache.kept_positions())
        assert (np.diff(pos, axis=-1) > 0).all()  # unique, ascending
        must = set(range(min(n_sink, seen))) | set(range(max(seen - recent, 0), seen))
        kept = set(pos[0, 0].tolist())
        assert must <= kept
        if cache.evictions:
            # StreamingLLM keeps exactly the sinks and the newest rows.
            newest = cache.size() - min(n_sink, seen)
            assert kept == set(range(n_sink)) | set(range(seen - newest, seen))
    assert cache.kept_bytes == batch * heads * cache.size() * 2 * 8 * k.dtype.size
    assert cache.full_seq_bytes == batch * heads * seen * 2 * 8 * k.dtype.size


def test_byte_accounting_and_ratio():
    cache = EvictionCache(KVCacheConfig(method="streaming", budget=40, streaming_evict_every=8))
    k = mx.zeros((1, 2, 200, 16), mx.float16)
    cache.update_and_fetch(k, k)
    cache.update_and_fetch(k[:, :, :1], k[:, :, :1])  # the prompt's last token ...
    cache.observe_queries(k[:, :, :1])  # ... compressed right after its step
    assert cache.size() == 40 and cache.offset == 201 and cache.evictions == 1
    assert cache.kept_bytes == 2 * 40 * 16 * 2 * 2
    assert cache.compression_ratio == pytest.approx(201 / 40)
    report = cache.byte_report()
    assert report["tokens_kept"] == 40 and report["evictions"] == 1


# -- masks, host syncs, bad input ------------------------------------------------------------------
def test_masks():
    cache = EvictionCache(KVCacheConfig(method="streaming", budget=40))
    assert cache.make_mask(1) is None and cache.make_mask(5) == "causal"
    k = mx.zeros((1, 1, 10, 4))
    cache.update_and_fetch(k, k)
    m = cache.make_mask(3, return_array=True)
    assert m.shape == (3, 13) and bool(m[0, 10]) and not bool(m[0, 11])
    with pytest.raises(NotImplementedError, match="sliding-window"):
        cache.make_mask(3, window_size=4)


def test_forbid_host_sync_can_fail():
    with forbid_host_sync():
        with pytest.raises(AssertionError, match="host sync"):
            mx.array([1]).item()


@pytest.mark.parametrize("keys,values,msg", [
    (mx.zeros((2, 8)), mx.zeros((2, 8)), "4-D"),
    (mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 4, 8)), "disagree"),
    (mx.zeros((1, 2, 3, 8), mx.int32), mx.zeros((1, 2, 3, 8), mx.int32), "floating"),
    (mx.zeros((1, 2, 0, 8)), mx.zeros((1, 2, 0, 8)), "at least one"),
])
def test_bad_kv_inputs(keys, values, msg):
    cache = EvictionCache(KVCacheConfig(method="streaming", budget=40))
    with pytest.raises((ValueError, TypeError), match=msg):
        cache.update_and_fetch(keys, values)


def test_changing_shapes_or_dtype_is_refused():
    cache = EvictionCache(KVCacheConfig(method="streaming", budget=40))
    cache.update_and_fetch(mx.zeros((1, 2, 3, 8)), mx.zeros((1, 2, 3, 8)))
    with pytest.raises(ValueError, match="do not match"):
        cache.update_and_fetch(mx.zeros((1, 3, 1, 8)), mx.zeros((1, 3, 1, 8)))
    with pytest.raises(TypeError, match="dtype changed"):
        cache.update_and_fetch(mx.zeros((1, 2, 1, 8), mx.float16), mx.zeros((1, 2, 1, 8), mx.float16))
    with pytest.raises(ValueError, match="do not fit"):
        cache.observe_queries(mx.zeros((1, 3, 1, 8)))


def test_batch_merge_is_ours_not_kvcache_merge():
    """KVCache.merge would drop eviction state; ours batches one single-row cache per sequence
    (tests/test_batching.py checks it row by row)."""
    from veloxquant_mlx.caches.batch import BatchEvictionCache

    batch = EvictionCache.merge([])
    assert type(batch) is BatchEvictionCache and batch.rows == []


# -- query tap ------------------------------------------------------------------------------------
def _hand_queries(model, tokens):
    """q_proj + RoPE computed by hand for layer 0 of a llama model."""
    attn = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(mx.array([tokens])))
    B, L, _ = x.shape
    q = attn.q_proj(x).reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
    return attn.rope(q, offset=0)


def test_tap_delivers_real_queries_and_uninstall_restores():
    model = make_tiny_model("llama")
    seen = []

    cfg = KVCacheConfig(method="streaming", budget=512)
    caches = KVCacheBuilder.for_model(model, cfg)
    caches[0].method.on_rows = lambda view, step: seen.append(step.queries) or {}
    tokens = random_prompt(12)
    model(mx.array([tokens]), cache=caches)
    assert len(seen) == 1
    expected = _hand_queries(model, tokens)
    assert seen[0].shape == expected.shape == (1, 4, 12, 16)
    assert mx.allclose(seen[0], expected, atol=1e-5)
    assert query_tap_installed(model)
    assert llama_module.scaled_dot_product_attention is not mlx_base.scaled_dot_product_attention
    install_query_tap(model)  # idempotent
    remove_query_tap(model)
    assert llama_module.scaled_dot_product_attention is mlx_base.scaled_dot_product_attention
    assert not query_tap_installed(model)


def test_tap_is_noop_for_plain_caches():
    model = make_tiny_model("llama")
    install_query_tap(model)
    try:
        prompt = random_prompt(30)
        tapped = greedy(model, prompt, max_tokens=5)
    finally:
        remove_query_tap(model)
    plain = greedy(model, prompt, max_tokens=5)
    assert tapped[0] == plain[0] and np.abs(tapped[1] - plain[1]).max() == 0


def test_without_tap_falls_back_to_keys_with_one_warning(monkeypatch):
    import veloxquant_mlx.builder as builder

    model = make_tiny_model("llama")
    monkeypatch.setattr(builder, "install_query_tap", lambda m: [])

    monkeypatch.setattr(StreamingLLM, "needs", Needs(queries=True))
    cfg = KVCacheConfig(method="streaming", budget=64)
    with pytest.warns(UserWarning, match="stand-in queries"):
        caches = builder.KVCacheBuilder.for_model(model, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        builder.KVCacheBuilder.for_model(model, cfg)  # warned once per model
    assert all(c.queries_from_keys for c in caches)


@pytest.mark.parametrize("method", ["streaming", "h2o", "nexus", "random"])
def test_chunk_that_triggers_eviction_attends_to_every_fetched_row(method):
    """The eviction a chunk triggers (in observe_queries, before the attention runs) must not change
    what that chunk attends to: up to the first eviction the outputs equal mlx-lm's KVCache exactly.
    Regression: compacting the buffers in place made the slice update_and_fetch had returned read
    the compacted rows (logits off by up to 4.7 on the real model)."""
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig

    model = make_tiny_model("llama")
    tokens = random_prompt(384, seed=3)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=200, prompt_eviction="stream"))
    full = make_prompt_cache(model)
    for start in range(0, 384, 128):
        x = mx.array(tokens[start:start + 128])[None]
        ours, ref = model(x, cache=caches), model(x, cache=full)
        mx.eval(ours, ref)
        if caches[0].evictions:  # the first chunk that evicted: it still attended to every row
            break
    assert caches[0].evictions == 1 and start > 0
    assert mx.array_equal(ours, ref).item()


def test_what_a_method_needs_is_declared_on_the_protocol_and_never_probed():
    import dataclasses
    import inspect

    from veloxquant_mlx import builder, config, model_pass
    from veloxquant_mlx.caches.method import Method, Needs

    assert {f.name for f in dataclasses.fields(Needs)} == {"queries", "window", "hidden_states", "model_pass",
                                                          "token_ids"}
    declared = ("needs", "allocations", "prefill_only", "compresses_in_model_pass", "model_pass_note", "attach")
    assert [n for n in declared if n not in vars(Method)] == []
    for module in (builder, config, model_pass):
        src = inspect.getsource(module)
        assert [n for n in (*declared, "needs_queries", "supports_ada") if f'getattr(cls, "{n}"' in src
                or f'getattr(method, "{n}"' in src or f'hasattr(cls, "{n}"' in src] == []
