"""What a user's process really holds: allocated bytes follow the budget.

Measured the way a user meets it: mlx-lm's own generation loop (``generate_step``, what
``mlx_lm.generate`` runs) with its default arguments, memory as allocated bytes (``nbytes``) and MLX's
active memory, never a count derived from kept rows.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, methods
from veloxquant_mlx.registry import get_method

from conftest import make_tiny_model, random_prompt

METHODS = sorted(methods())
DECODE_BOUNDED = [m for m in METHODS if not get_method(m).prefill_only]


def _generate(model, prompt, caches, max_tokens=8, **kw):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=max_tokens, **kw)]


def _held(model, prompt, make, max_tokens=24):
    """(sum of nbytes, growth of active memory) right after a generation through generate_step, as
    the user's process holds it (no extra evaluation of the cache state: decode evaluates only the
    tokens, so state a step updated lazily, e.g. H2O's scores, must not pin old buffers)."""
    mx.eval(model.parameters())
    mx.clear_cache()
    before = mx.get_active_memory()
    caches = make()
    _generate(model, prompt, caches, max_tokens)
    active = mx.get_active_memory() - before
    return sum(c.nbytes for c in caches), active, caches


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_allocated_and_active_memory_follow_the_budget(arch):
    model = make_tiny_model(arch)
    prompt = random_prompt(1000, seed=1)
    full_alloc, full_active, _ = _held(model, prompt, lambda: make_prompt_cache(model))
    assert full_alloc > 0 and full_active >= 0.9 * full_alloc
    for name in METHODS:
        cfg = KVCacheConfig(method=name, budget=160)
        alloc, active, caches = _held(model, prompt, lambda: KVCacheBuilder.for_model(model, cfg))
        assert all(c.evictions >= 1 for c in caches), name
        assert alloc <= 0.5 * full_alloc, (name, alloc / full_alloc)
        assert active <= 0.5 * full_active, (name, active / full_active)


@pytest.mark.parametrize("name", DECODE_BOUNDED)
def test_decode_soak_memory_stops_growing(name):
    """Thousands of decode steps: once the budget is reached, allocated bytes and active memory stay flat."""
    model = make_tiny_model("llama")
    cfg = KVCacheConfig(method=name, budget=128)
    caches = KVCacheBuilder.for_model(model, cfg)
    mx.clear_cache()
    base = mx.get_active_memory()
    alloc, active, widths = [], [], []
    for i, _ in enumerate(generate_step(mx.array(random_prompt(40, seed=2)), model, prompt_cache=caches,
                                        max_tokens=1500)):
        if i >= 300 and i % 100 == 0:
            mx.eval([c.state for c in caches])
            alloc.append(sum(c.nbytes for c in caches))
            active.append(mx.get_active_memory() - base)
            # ragged heads (Ada-KV): as wide as the widest head kept, which its cap bounds, plus headroom
            widths += [(c.positions.shape[2], max(c.budget, cfg.head_cap_rows(c.schedule.keep())) + c.slack + 1)
                       for c in caches]
    assert caches[0].offset > 1500 and caches[0].evictions > 10
    if cfg.allocation == "uniform":
        assert max(alloc) == min(alloc), alloc  # the buffers never grow past budget + headroom
    else:
        assert all(w <= bound for w, bound in widths), widths
    assert max(active) - min(active) <= 64 * 1024, active  # nothing else accumulates either


def test_prefill_only_shrinks_right_after_its_one_shot_compression():
    model = make_tiny_model("llama")
    prompt = random_prompt(700, seed=3)
    for name in [m for m in METHODS if get_method(m).prefill_only]:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=name, budget=160))
        _generate(model, prompt, caches, max_tokens=2)
        for c in caches:
            assert c.evictions == 1
            appended = c.offset - len(prompt)  # decode steps after the compression (it ends the last prompt step)
            width = int(c.kept_per_head().max()) - appended  # ragged storage: the largest head actually kept
            assert c.keys.shape[2] == width + c.store.decode_step, (name, c.keys.shape, width)


def test_prefill_only_prompt_shorter_than_budget_is_never_compressed():
    """Decode tokens are appended, never evicted: a short prompt must not be compressed mid-decode."""
    model = make_tiny_model("llama")
    for name in [m for m in METHODS if get_method(m).prefill_only]:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method=name, budget=160))
        _generate(model, random_prompt(150, seed=4), caches, max_tokens=40)
        # PyramidKV's deeper layer has a smaller budget than the prompt: it compresses once, at the end.
        assert any(c.budget >= 149 for c in caches)
        for c in caches:
            assert c.offset == 190 and c.evictions == (1 if 149 > c.budget else 0), (name, c.budget)
            assert c.size() == (190 if c.evictions == 0 else c.kept_per_head().max().item())


def _allocated_after_each_call(model, prompt, caches, step):
    """Sum of nbytes right after every update_and_fetch (before any eviction the step runs later):
    the most this generation ever allocated for KV, call by call."""
    seen = []

    def recording(c):
        inner = c.update_and_fetch

        def update_and_fetch(keys, values):
            out = inner(keys, values)
            seen.append(sum(x.nbytes for x in caches))
            return out
        return update_and_fetch

    for c in caches:
        c.update_and_fetch = recording(c)
    _generate(model, prompt, caches, max_tokens=2, prefill_step_size=step)
    return seen


def test_prompt_eviction_stream_bounds_the_peak_and_end_holds_the_prompt():
    model = make_tiny_model("llama")
    prompt = random_prompt(1200, seed=5)
    full_caches = make_prompt_cache(model)
    _generate(model, prompt, full_caches, max_tokens=1)
    per_row = sum(c.nbytes for c in full_caches) / full_caches[0].keys.shape[2]  # every layer, K + V
    stream = _allocated_after_each_call(model, prompt, KVCacheBuilder.for_model(
        model, KVCacheConfig(method="nexus", budget=160, prompt_eviction="stream")), 128)
    end_caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="nexus", budget=160))
    end = _allocated_after_each_call(model, prompt, end_caches, 128)
    # stream: never more than budget + one block of slack + one chunk (+ positions, window), whatever
    # the prompt length
    assert max(stream) <= 1.1 * per_row * (160 + 32 + 128), max(stream) / per_row
    # end: holds the whole prompt until it ends, then compresses once down to budget + headroom
    assert max(end) >= 0.95 * per_row * 1199 and end_caches[0].evictions == 1
    assert all(c.keys.shape[2] == 160 + 32 + 1 for c in end_caches)  # budget + one block + the crossing token


def test_saved_query_window_does_not_pin_the_chunk():
    """The observation window is a copy: a long prefill chunk's queries are freed after the step."""
    cache = EvictionCache(KVCacheConfig(method="nexus", budget=256))
    k = mx.random.normal((1, 2, 4096, 64), key=mx.random.key(0))
    cache.update_and_fetch(k, k)
    mx.eval(cache.state)
    mx.clear_cache()
    before = mx.get_active_memory()
    q = mx.random.normal((1, 8, 4096, 64), key=mx.random.key(1))  # 8 MiB of queries
    cache.observe_queries(q)
    mx.eval(cache.state)
    del q
    mx.clear_cache()
    assert mx.get_active_memory() - before < 512 * 1024
    assert cache.window.q.shape == (1, 8, 16, 64)


@pytest.mark.parametrize("call", ["lambda", "install"])
def test_make_cache_swap_builds_fresh_caches(call):
    model = make_tiny_model("llama")
    cfg = KVCacheConfig(method="h2o", budget=48)
    if call == "lambda":  # for_model inside a make_cache swap asks the model's class (no recursion)
        model.make_cache = lambda *a, **k: KVCacheBuilder.for_model(model, cfg)
    else:
        KVCacheBuilder.install(model, cfg)
    prompt = random_prompt(90, seed=6)
    first = make_prompt_cache(model)
    second = make_prompt_cache(model)
    assert first[0] is not second[0] and first[0].method.name == "h2o"
    a = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
    b = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
    ref = _generate(model, prompt, KVCacheBuilder.for_model(model, cfg), max_tokens=6)
    assert a == b == ref


def test_byte_report_shows_allocated_beside_kept_and_full():
    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", budget=100))
    _generate(model, random_prompt(600, seed=7), caches, max_tokens=4)
    r = caches[0].byte_report()
    assert r["allocated_bytes"] == caches[0].nbytes > r["kept_bytes"]
    assert r["full_seq_bytes"] == 1 * 2 * 604 * 2 * 16 * 4  # B * H_kv * tokens seen * (K + V) * D * fp32
    assert r["allocated_fraction"] == pytest.approx(r["allocated_bytes"] / r["full_seq_bytes"])
    assert r["allocated_fraction"] < 0.4
    from veloxquant_mlx.caches.accounting import kv_report

    rep = kv_report(caches)
    assert rep["allocated_bytes"] == sum(c.nbytes for c in caches)
    assert rep["other_allocated_bytes"] == 0  # every layer is ours
    full = make_prompt_cache(model)
    _generate(model, random_prompt(600, seed=7), full, max_tokens=4)
    frep = kv_report(full)
    assert frep["allocated_bytes"] == sum(c.nbytes for c in full) >= frep["full_bytes"]
    assert frep["other_allocated_bytes"] == frep["allocated_bytes"]  # all mlx-lm's own
    assert np.isclose(frep["fraction"], frep["allocated_bytes"] / frep["full_bytes"])
