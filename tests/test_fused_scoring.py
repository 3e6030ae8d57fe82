"""The one-pass attention path: a method whose scoring pass computes the attention weights (H2O's
accumulated mass) returns the layer's output from those weights, and the tap skips mlx-lm's attention.
It must equal the two-pass path (scoring + mlx-lm's fused kernel): outputs, scores and kept rows."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from veloxquant_mlx import KVCacheBuilder, tap
from veloxquant_mlx.ops.attention import fused_scoring_default
from veloxquant_mlx.registry import get_method, methods

from conftest import make_cache, make_tiny_model, random_prompt, small_config

pytestmark = pytest.mark.filterwarnings("ignore:.*earlier generation")

# Every registered method with the switch: the ones whose scoring pass computes attention weights.
FUSING = [m for m in methods() if "attention_pass" in {f.name for f in dataclasses.fields(get_method(m).Options)}]


def test_some_method_fuses():
    assert "h2o" in FUSING


def test_auto_is_fused_on_cpu_only():
    assert fused_scoring_default() == (mx.default_device().type == mx.DeviceType.cpu)


def _layer_steps(method, mode, chunks, q_heads=4, kv_heads=2, D=16, seed=0):
    """Feed chunks through one cache as the tap does; (outputs, scores, kept positions) per step."""
    c = make_cache(method, small=True, prompt_eviction="stream", options={"attention_pass": mode,
                                                                         "query_block": 5})
    n = sum(chunks)
    k = mx.random.normal((1, kv_heads, n, D), key=mx.random.key(seed))
    v = mx.random.normal((1, kv_heads, n, D), key=mx.random.key(seed + 1))
    q = mx.random.normal((1, q_heads, n, D), key=mx.random.key(seed + 2))
    outs, scores, start = [], [], 0
    for s in chunks:
        K, V = c.update_and_fetch(k[:, :, start:start + s], v[:, :, start:start + s])
        qs = q[:, :, start:start + s]
        outs.append(tap.tapped_scaled_dot_product_attention(qs, K, V, cache=c, scale=D ** -0.5,
                                                            mask="causal" if s > 1 else None))
        scores.append(np.array(c.stored("score")))
        start += s
    return outs, scores, np.array(c.kept_positions()), c


@pytest.mark.parametrize("method", FUSING)
def test_fused_layer_step_equals_separate(method, monkeypatch):
    calls = []
    original = tap._ORIGINAL_SDPA
    monkeypatch.setattr(tap, "_ORIGINAL_SDPA", lambda *a, **k: calls.append(1) or original(*a, **k))
    chunks = [13, 7, 1, 1, 9] + [1] * 12  # sub-blocks of 5 queries, evictions in prefill and decode
    fused = _layer_steps(method, "fused", chunks)
    assert not calls, "the fused path must not run a second attention pass"
    separate = _layer_steps(method, "separate", chunks)
    assert len(calls) == len(chunks)
    assert fused[3].evictions > 1
    for a, b in zip(fused[0], separate[0]):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    for a, b in zip(fused[1], separate[1]):
        np.testing.assert_array_equal(a, b)  # the scores come from the same weights
    np.testing.assert_array_equal(fused[2], separate[2])


@pytest.mark.parametrize("method", FUSING)
@pytest.mark.parametrize("extra", [{}, {"allocation": "ada"}])
def test_fused_generation_equals_separate(method, extra):
    """Through mlx-lm's generate_step on a tiny GQA model (ragged storage with Ada-KV): same logits
    within float rounding, same tokens, same kept positions."""
    if extra and not get_method(method).supports_allocation("ada"):
        pytest.skip("no Ada-KV")
    model = make_tiny_model(layers=2, heads=4, kv_heads=2)
    prompt = mx.array(random_prompt(70, seed=3))
    runs = {}
    for mode in ("fused", "separate"):
        cfg = small_config(method, options={"attention_pass": mode}, **extra)
        caches = KVCacheBuilder.for_model(model, cfg)
        steps = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=24, prefill_step_size=32))
        runs[mode] = ([int(t) for t, _ in steps], np.stack([np.array(lp) for _, lp in steps]),
                      [np.array(c.kept_positions()) for c in caches], [np.array(c.stored("score")) for c in caches])
        assert sum(c.evictions for c in caches) > len(caches)
    KVCacheBuilder.uninstall(model)
    (tf, lf, kf, sf), (ts, ls, ks, ss) = runs["fused"], runs["separate"]
    assert tf == ts
    np.testing.assert_allclose(lf, ls, rtol=1e-4, atol=1e-4)
    for a, b in zip(kf, ks):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(sf, ss):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


# Prefill-only methods that read no queries but compute their prompt chunks' attention themselves.
BLOCKED = [m for m in methods() if "prefill_attention" in {f.name for f in dataclasses.fields(get_method(m).Options)}]


def test_nestedkv_computes_its_prompt_attention():
    assert "nestedkv" in BLOCKED


@pytest.mark.parametrize("method", BLOCKED)
def test_blocked_prompt_attention_equals_mlx(method, monkeypatch):
    """Prompt chunks (also a second turn over ragged, compressed storage) attend in blocked sub-blocks
    without calling mlx-lm's kernel; outputs equal mlx-lm's within float rounding, kept rows identical."""
    calls = []
    original = tap._ORIGINAL_SDPA
    monkeypatch.setattr(tap, "_ORIGINAL_SDPA", lambda q, *a, **k: calls.append(q.shape[2]) or original(q, *a, **k))
    chunks = [30, 20, 1, 1, 1, 25, 14, 1, 1]  # two turns; turn 2's chunks read the compressed turn 1
    kv_heads, q_heads, D = 2, 4, 16
    n = sum(chunks)
    k, v, q = (mx.random.normal((1, h, n, D), key=mx.random.key(s)) for s, h in
               ((0, kv_heads), (1, kv_heads), (2, q_heads)))
    runs = {}
    for mode in ("blocked", "mlx"):
        calls.clear()
        c = make_cache(method, small=True, options={"prefill_attention": mode, "query_block": 5})
        c.tap_active = True
        outs, start = [], 0
        for s in chunks:
            K, V = c.update_and_fetch(k[:, :, start:start + s], v[:, :, start:start + s])
            outs.append(tap.tapped_scaled_dot_product_attention(q[:, :, start:start + s], K, V, cache=c,
                                                                scale=D ** -0.5, mask="causal" if s > 1 else None))
            start += s
            if s > 1 and start > 51:
                assert c.stored("keys").shape[2] < c.offset  # turn 2's chunks attend to a compressed past
        runs[mode] = (outs, np.array(c.kept_positions()), list(calls), c.evictions)
    (ob, kb, cb, eb), (om, km, cm, em) = runs["blocked"], runs["mlx"]
    assert all(s == 1 for s in cb), "blocked prompt chunks must not call mlx-lm's attention"
    assert sorted(cm) == sorted(chunks) and eb == em == 2
    for a, b in zip(ob, om):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(kb, km)


@pytest.mark.parametrize("method", BLOCKED)
@pytest.mark.parametrize("prefill_step", [32, 2048])
def test_blocked_prompt_generation_equals_mlx(method, prefill_step):
    """Through mlx-lm's generate_step on a tiny GQA model: same tokens, logprobs within rounding, same
    kept positions per layer."""
    model = make_tiny_model(layers=2, heads=4, kv_heads=2)
    prompt = mx.array(random_prompt(90, seed=5))
    runs = {}
    for mode in ("blocked", "mlx"):
        caches = KVCacheBuilder.for_model(model, small_config(method, options={"prefill_attention": mode,
                                                                              "query_block": 7}))
        steps = list(generate_step(prompt, model, prompt_cache=caches, max_tokens=16, prefill_step_size=prefill_step))
        runs[mode] = ([int(t) for t, _ in steps], np.stack([np.array(lp) for _, lp in steps]),
                      [np.array(c.kept_positions()) for c in caches])
        assert all(c.evictions == 1 for c in caches)
    KVCacheBuilder.uninstall(model)
    (tb, lb, kb), (tm, lm, km) = runs["blocked"], runs["mlx"]
    assert tb == tm
    np.testing.assert_allclose(lb, lm, rtol=1e-4, atol=1e-4)
    for a, b in zip(kb, km):
        np.testing.assert_array_equal(a, b)
