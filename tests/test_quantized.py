"""Quantized kept rows (config.kv_bits): mlx-lm's QuantizedKVCache layout, read by mlx-lm's own
quantized attention, with eviction gathering packed rows.

Tiny random models with head_dim 64 so 64-element groups fit.
"""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import llama, qwen3
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, load_prompt_cache, methods, save_prompt_cache
from veloxquant_mlx.caches.batch import BatchEvictionCache
from veloxquant_mlx.methods.streaming import StreamingLLM

from conftest import fit_tiny_scorer, forbid_host_sync, greedy, random_prompt, small_config
from test_batching import alone, batched, same_cache

METHODS = sorted(methods())
D = 64


def make_model(arch: str = "llama", seed: int = 0):
    """Tiny fp32 model: 4 query heads, 2 KV heads (GQA 2), head_dim 64, 2 layers."""
    mx.random.seed(seed)
    common = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128, max_position_embeddings=4096,
                  head_dim=D)
    if arch == "llama":
        model = llama.Model(llama.ModelArgs(model_type="llama", tie_word_embeddings=False, **common))
    else:
        model = qwen3.Model(qwen3.ModelArgs(model_type="qwen3", rope_theta=10000.0, tie_word_embeddings=True,
                                            **common))
    mx.eval(model.parameters())
    fit_tiny_scorer(model)  # kvzap's scorer for this model (conftest)
    return model


def cfg(method, budget=40, **kw):
    return small_config(method, budget, **kw)


def allocations(method):
    return [a for a in ("uniform", "ada") if cfg(method).method_class.supports_allocation(a)]


@pytest.fixture(scope="module")
def model():
    return make_model("llama")


# -- configuration and errors ----------------------------------------------------------------------
def test_config_fields_and_errors(monkeypatch):
    c = cfg("nexus", kv_bits=4)
    assert (c.kv_bits, c.kv_group_size) == (4, 32)  # the 4-bit default (config.default_kv_group_size)
    assert KVCacheConfig.from_dict(c.to_dict()) == c and c.replace(kv_bits=8).kv_bits == 8
    assert cfg("nexus").kv_bits is None
    for bad in (2, 3, 16, True, "4", 4.0):
        with pytest.raises(ValueError, match=r"kv_bits=.*not supported.*None \(full precision\) or one of \[4, 8\]"):
            cfg("nexus", kv_bits=bad)
    for bad in (48, 0, 256, 64.0):
        with pytest.raises(ValueError, match=r"kv_group_size=.*one of \[32, 64, 128\]"):
            cfg("nexus", kv_bits=4, kv_group_size=bad)
    with pytest.raises(ValueError, match="does not divide head_dim=96"):
        cfg("nexus", kv_bits=4, kv_group_size=64, head_dim=96)
    monkeypatch.setattr(StreamingLLM, "supports_kv_bits", False)
    with pytest.raises(ValueError, match="kv_bits=4 is not supported by method 'streaming'"):
        cfg("streaming", kv_bits=4)
    cfg("streaming")  # unquantized still fine


def test_group_size_not_dividing_the_models_head_dim():
    from conftest import make_tiny_model  # head_dim 16

    small = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(small, cfg("streaming", kv_bits=4, kv_group_size=32))
    with pytest.raises(ValueError, match="kv_group_size=32 does not divide the model's head_dim=16"):
        small(mx.array([[1, 2, 3]]), cache=caches)


def test_only_quantized_caches_have_bits(model):
    """mlx-lm picks its quantized attention by hasattr(cache, "bits"): an fp cache must not have it."""
    fp = KVCacheBuilder.for_model(model, cfg("nexus"))
    q = KVCacheBuilder.for_model(model, cfg("nexus", kv_bits=8, kv_group_size=32))
    assert not hasattr(fp[0], "bits") and not hasattr(fp[0], "group_size")
    assert (q[0].bits, q[0].group_size) == (8, 32)
    assert not hasattr(BatchEvictionCache.merge(fp[:1]), "bits")
    assert BatchEvictionCache.merge(q[:1]).bits == 8
    with pytest.raises(ValueError, match="mixes rows"):
        BatchEvictionCache([*BatchEvictionCache.merge(fp[:1]).rows, *BatchEvictionCache.merge(q[:1]).rows])


# -- equality with mlx-lm's QuantizedKVCache -------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_equals_quantized_kvcache_when_nothing_is_evicted(arch):
    m = make_model(arch)
    prompt = random_prompt(40, seed=3)
    ref_t, ref_lp = greedy(m, prompt, max_tokens=8, prefill_step_size=16,
                           prompt_cache=[QuantizedKVCache(group_size=64, bits=4) for _ in m.layers])
    _, fp_lp = greedy(m, prompt, max_tokens=8, prefill_step_size=16)
    assert np.abs(fp_lp - ref_lp).max() > 1e-2  # 4-bit rows really change the logits: the check can fail
    for method in METHODS:
        for allocation in allocations(method):
            caches = KVCacheBuilder.for_model(m, cfg(method, budget=4096, allocation=allocation, kv_bits=4,
                                                     kv_group_size=64))
            t, lp = greedy(m, prompt, max_tokens=8, prompt_cache=caches, prefill_step_size=16)
            assert t == ref_t, (method, allocation)
            assert np.abs(lp - ref_lp).max() <= 1e-3, (method, allocation)
            assert all(c.evictions == 0 and isinstance(c.keys, tuple) for c in caches)


# -- eviction moves packed rows --------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_eviction_gathers_packed_rows_without_requantizing(method):
    for allocation in allocations(method):
        for bits in (4, 8):
            c = cfg(method, allocation=allocation, kv_bits=bits, kv_group_size=32, prompt_eviction="stream")
            cache = EvictionCache(c, layer_idx=0, n_layers=2)
            cache.tap_active = True
            k = mx.random.normal((1, 2, 120, D), key=mx.random.key(1)) * mx.arange(1, 3).reshape(1, 2, 1, 1)
            v = mx.random.normal((1, 2, 120, D), key=mx.random.key(3))
            q = mx.random.normal((1, 4, 120, D), key=mx.random.key(2))
            at = 0
            for s in (30, 30, 30, 29, 1):
                cache.update_and_fetch(k[:, :, at:at + s], v[:, :, at:at + s])
                cache.observe_queries(q[:, :, at:at + s])
                at += s
            assert cache.evictions >= 1, (method, allocation)
            pos = np.array(cache.stored("positions"))
            real = pos != 2**31 - 1
            for buf, x in ((cache.store.raw("keys"), k), (cache.store.raw("values"), v)):
                want = mx.quantize(x, group_size=32, bits=bits)  # each token quantized once, on arrival
                for part, w in zip(buf, want):
                    got, ref = np.array(part), np.array(w)
                    for h in range(2):
                        np.testing.assert_array_equal(got[0, h][real[0, h]], ref[0, h][pos[0, h][real[0, h]]])


def test_ragged_mask_reaches_quantized_attention():
    """Ada-KV (ragged heads, GQA 2): the per-KV-head mask through mlx-lm's quantized attention equals
    fp attention over the dequantized rows with the per-query-head mask."""
    c = cfg("h2o", allocation="ada", kv_bits=4, kv_group_size=64, prompt_eviction="stream")
    cache = EvictionCache(c, layer_idx=0, n_layers=1)
    cache.tap_active = True
    k = mx.random.normal((1, 2, 110, D), key=mx.random.key(1)) * mx.array([1.0, 3.0]).reshape(1, 2, 1, 1)
    q = mx.random.normal((1, 4, 110, D), key=mx.random.key(2))
    at = 0
    for s in (40, 40, 19):
        cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
        cache.observe_queries(q[:, :, at:at + s])
        at += s
    assert cache.is_ragged
    for n in (1, 5):
        cache.continue_on_purpose()  # a 5-token step after a single one is deliberate here
        kq, vq = cache.update_and_fetch(k[:, :, at:at + n], k[:, :, at:at + n])
        qq = q[:, :, at:at + n] * 3.0
        mask = cache.attention_mask("causal" if n > 1 else None, qq)
        assert mask.shape[1] == 2  # per KV head
        # (mlx-lm's quantized path scales its queries in place: hand it a copy)
        out = mlx_base.scaled_dot_product_attention(qq + 0, kq, vq, cache=cache, scale=D ** -0.5, mask=mask)
        kd = mx.dequantize(*kq, group_size=64, bits=4)
        vd = mx.dequantize(*vq, group_size=64, bits=4)
        ref = mx.fast.scaled_dot_product_attention(qq, kd, vd, scale=D ** -0.5, mask=mx.repeat(mask, 2, axis=1))
        np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-4)
        # the padding is really hidden: without the mask the output differs
        bare = mx.fast.scaled_dot_product_attention(qq, kd, vd, scale=D ** -0.5)
        assert np.abs(np.array(bare) - np.array(ref)).max() > 1e-3
        cache.observe_queries(q[:, :, at:at + n])
        at += n


# -- bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_four_bit_bytes_at_a_small_budget(method, model):
    prompt = random_prompt(200, seed=4)
    for allocation in allocations(method):
        got = {}
        for bits in (None, 4):
            caches = KVCacheBuilder.for_model(model, cfg(method, allocation=allocation, kv_bits=bits, kv_group_size=64))
            greedy(model, prompt, max_tokens=6, prompt_cache=caches, prefill_step_size=64)
            got[bits] = caches
        a4 = sum(c.nbytes for c in got[4])
        assert a4 <= 0.35 * sum(c.nbytes for c in got[None]), (method, allocation)
        for c in got[4]:
            assert c.evictions >= 1
            # allocated: every held array, packed words + scales + biases included
            parts = [*c.keys, *c.values, c.positions, *c.store.fields.values(), c.window.q]
            assert c.nbytes == sum(p.nbytes for p in parts if p is not None)
            row = 2 * (D * 4 // 8 + 2 * (D // 64) * 4)  # K and V: 4-bit words + fp32 scale + bias
            assert c.store.row_bytes() == row
            assert c.full_seq_bytes == 2 * c.offset * 2 * D * 4  # the fp cache's bytes: B=1, H=2
            kept = np.array(c.kept_per_head()).sum()
            assert c.kept_bytes == kept * row


# -- batching, save / load -------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_batch_generate_equals_alone(model, method):
    prompts = [random_prompt(n, seed=s) for n, s in ((61, 1), (30, 2), (83, 3))]
    for allocation in allocations(method):
        config = small_config(method, budget=24, prompt_eviction="stream", allocation=allocation, kv_bits=4)
        ref = [alone(model, config, p, m) for p, m in zip(prompts, (9, 5, 7))]
        out = batched(model, config, prompts, [9, 5, 7])
        for (tokens, logprobs, caches), got, got_caches in zip(ref, out.token_ids, out.caches):
            assert got == tokens, (method, allocation)
            assert all(same_cache(a, b) for a, b in zip(caches, got_caches))
            assert all(isinstance(c.keys, tuple) for c in caches)
        assert all(c.evictions >= 1 for c in ref[2][2])  # the longest prompt evicted in every layer


@pytest.mark.parametrize("method", METHODS)
def test_save_load_round_trips_packed_rows(method, model, tmp_path):
    prompt = random_prompt(90, seed=5)
    for allocation in allocations(method):
        a = KVCacheBuilder.for_model(model, cfg(method, allocation=allocation, kv_bits=4))
        for i in range(0, len(prompt), 16):
            model(mx.array([prompt[i:i + 16]]), cache=a)
        for tok in (3, 4, 5):
            model(mx.array([[tok]]), cache=a)
        mx.eval([c.state for c in a])
        path = tmp_path / f"{method}-{allocation}.safetensors"
        save_prompt_cache(path, a)
        b = load_prompt_cache(path)
        for x, y in zip(a, b):
            assert x.evictions >= 1 and y.config.kv_bits == 4 and y.bits == 4
            for name in ("keys", "values"):
                for p, r in zip(x.store.raw(name), y.store.raw(name)):
                    assert p.dtype == r.dtype and np.array_equal(np.array(p), np.array(r))
        la = [np.array(model(mx.array([[t]]), cache=a)) for t in (7, 8, 9)]
        lb = [np.array(model(mx.array([[t]]), cache=b)) for t in (7, 8, 9)]
        assert all(np.array_equal(x, y) for x, y in zip(la, lb))


def test_hot_path_forces_no_host_sync():
    c = cfg("nexus", kv_bits=4, prompt_eviction="stream")
    cache = EvictionCache(c, layer_idx=0, n_layers=1)
    cache.tap_active = True
    k = mx.random.normal((1, 2, 120, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 120, D), key=mx.random.key(2))
    with forbid_host_sync():
        at = 0
        for s in (50, 50, 9, 1, 1, 1, 1, 1, 1, 1):
            cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
            cache.observe_queries(q[:, :, at:at + s])
            at += s
    assert cache.evictions >= 2
    mx.eval(cache.state)
