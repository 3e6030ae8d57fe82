"""One contract every registered eviction method must keep (methods added later join automatically).

Per method: budget invariants under chunked updates, ``offset`` = tokens seen, exact equality with
mlx-lm's KVCache when nothing is evicted, chunked-prefill generation with eviction, save/load then
continue with identical logits, no host sync in the hot path, clear errors for bad options.
"""

import dataclasses
import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheBuilder, load_prompt_cache, methods, save_prompt_cache

from conftest import SMALL_BUDGET, forbid_host_sync, greedy, make_cache, make_tiny_model, random_prompt, small_config

METHODS = sorted(methods())  # every registered method, each with its own small= options (conftest)
ALLOCATIONS = ["uniform", "ada"]
BUDGET = SMALL_BUDGET
D = 16


def config(method, budget=BUDGET, **kw):
    return small_config(method, budget=budget, **kw)


def direct_cache(method, tap=True, **kw):
    return make_cache(method, small=True, tap=tap, n_layers=2, **kw)


def real_positions(cache):
    pos = np.array(cache.kept_positions())
    return [[row[row >= 0] for row in b] for b in pos]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


_ARCH_MODELS = {}


def _arch_model(arch):
    if arch not in _ARCH_MODELS:
        _ARCH_MODELS[arch] = make_tiny_model(arch)
    return _ARCH_MODELS[arch]


# -- invariants ------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["stream", "end"])
@pytest.mark.parametrize("method", METHODS)
def test_budget_invariants_under_chunked_updates(method, policy):
    cache = direct_cache(method, prompt_eviction=policy)
    rng = np.random.default_rng(0)
    seen, compressed_at = 0, None
    for s in [20, 13, 40, 7] + [1] * 12:
        k = mx.array(rng.normal(size=(1, 2, s, D)).astype(np.float32))
        v = k * 0.5
        keys, values = cache.update_and_fetch(k, v)
        assert mx.array_equal(keys[:, :, -s:], k) and mx.array_equal(values[:, :, -s:], v)
        cache.observe_queries(mx.array(rng.normal(size=(1, 4, s, D)).astype(np.float32)))
        seen += s
        assert cache.offset == seen == cache.tokens_seen
        for row in real_positions(cache)[0]:
            assert len(set(row.tolist())) == len(row) and row.min() >= 0
            assert row.max() == seen - 1  # the newest token is always kept
        if s > 1 and (policy == "end"):
            assert cache.evictions == 0 and cache.size() == seen  # "end": the whole prompt is held
        elif cache.prefill_only:
            if s == 1 and compressed_at is None:
                compressed_at = seen
                assert cache.tokens_kept <= cache.budget + 1
                chunk_evictions = cache.evictions - 1
            if compressed_at is not None:
                assert cache.evictions == chunk_evictions + 1  # compress once at the end, then only append
                assert cache.tokens_kept <= cache.budget + (seen - compressed_at) + 1
            else:  # "stream": compressed at the chunks already
                assert cache.size() <= cache.budget + cache.slack
        else:
            assert cache.size() <= cache.budget + cache.slack
    assert cache.evictions >= 1


# -- exact equivalence with KVCache ----------------------------------------------------------------
@pytest.mark.parametrize("arch,step", [("llama", 16), ("qwen3", 2048)])  # chunked / one-chunk prompt
@pytest.mark.parametrize("method", METHODS)
def test_equals_kvcache_when_nothing_is_evicted(method, arch, step):
    model = _arch_model(arch)
    prompt = random_prompt(40, seed=3)
    ref_tokens, ref_lp = greedy(model, prompt, max_tokens=8, prefill_step_size=step)
    caches = KVCacheBuilder.for_model(model, config(method, budget=4096))
    tokens, lp = greedy(model, prompt, max_tokens=8, prompt_cache=caches, prefill_step_size=step)
    assert tokens == ref_tokens
    assert np.abs(lp - ref_lp).max() <= 1e-5
    assert all(c.evictions == 0 and c.offset == len(prompt) + 8 for c in caches)
    assert all(c.tap_active and c.queries_observed > 0 for c in caches)  # the tap ran


# -- generation with eviction ----------------------------------------------------------------------
def _skip_unsupported(method, allocation):
    if not config(method).method_class.supports_allocation(allocation):
        pytest.skip(f"{method} does not support allocation={allocation!r}")


@pytest.mark.parametrize("policy", ["end", "stream"])
@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("method", METHODS)
def test_chunked_prefill_generation_with_eviction(method, allocation, policy, model):
    _skip_unsupported(method, allocation)
    prompt = random_prompt(80, seed=4)
    caches = KVCacheBuilder.for_model(model, config(method, allocation=allocation, prompt_eviction=policy))
    tokens, lp = greedy(model, prompt, max_tokens=8, prompt_cache=caches, prefill_step_size=16)
    assert len(tokens) == 8 and np.isfinite(lp).all()
    for c in caches:
        assert c.evictions >= 1 and c.queries_observed > 0
        if c.prefill_only:  # compressed when the last prompt token (position 79) arrived
            assert c.tokens_kept <= c.budget + (c.offset - 79)
        elif allocation == "uniform":
            assert c.size() <= c.budget + c.slack
        else:  # ragged: the mean real rows per head stay within budget + slack
            assert c.tokens_kept <= c.budget + c.slack


# -- save / load -----------------------------------------------------------------------------------
def _decode(model, caches, tok, n):
    out = []
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=caches)[:, -1]
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(np.array(logits))
    return out


@pytest.mark.parametrize("allocation", ALLOCATIONS)
@pytest.mark.parametrize("method", METHODS)
def test_save_load_then_continue_is_identical(method, allocation, model, tmp_path):
    _skip_unsupported(method, allocation)
    a = KVCacheBuilder.for_model(model, config(method, allocation=allocation))
    prompt = random_prompt(70, seed=5)
    for i in range(0, len(prompt), 16):
        model(mx.array([prompt[i:i + 16]]), cache=a)
    _decode(model, a, 3, 3)
    mx.eval([c.state for c in a])
    path = tmp_path / f"{method}.safetensors"
    save_prompt_cache(path, a)
    b = load_prompt_cache(path)
    for x, y in zip(a, b):
        assert type(x) is type(y) and (x.offset, x.size(), x.evictions) == (y.offset, y.size(), y.evictions)
        assert x.config == y.config and x.budget == y.budget and x.is_ragged == y.is_ragged
    la, lb = _decode(model, a, 7, 6), _decode(model, b, 7, 6)
    assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    assert a[0].evictions >= 1


# -- no host sync ----------------------------------------------------------------------------------
def option_variants(method):
    """The method's small options, then each code-path switch flipped: every bool option negated and
    every option that allows None (e.g. Nexus n_samples=None: top-K) set to None."""
    cls = config(method).method_class
    out = [{}]
    for f in dataclasses.fields(cls.Options):
        if f.metadata.get("kind") is bool:
            out.append({f.name: not f.default})
        elif f.metadata.get("allow_none") and f.default is not None:
            out.append({f.name: None})
    return out


@pytest.mark.parametrize("method", METHODS)
def test_hot_path_forces_no_host_sync(method):
    cls = config(method).method_class
    cases = [(a, {}) for a in ("uniform", "ada") if cls.supports_allocation(a)]
    cases += [("uniform", v) for v in option_variants(method)[1:]]
    for allocation, variant in cases:
        cache = direct_cache(method, allocation=allocation, options=variant)
        k = mx.random.normal((1, 2, 69, D), key=mx.random.key(1))
        q = mx.random.normal((1, 4, 69, D), key=mx.random.key(2))
        with forbid_host_sync() as ragged_reads, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the last chunk: a new prompt after decoding (a second turn)
            at = 0
            for s in (20, 20, 9, 1, 1, 1, 1, 1, 1, 1, 9, 1):
                cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
                cache.observe_queries(q[:, :, at:at + s])
                cache.attention_mask(None, q[:, :, at:at + s])
                at += s
        assert cache.evictions >= 1, (allocation, variant)
        # Uniform storage never syncs; ragged storage reads its width back once per eviction step.
        assert len(ragged_reads) == (cache.evictions if cache.is_ragged else 0), (allocation, variant, ragged_reads)
        mx.eval(cache.state)


# -- errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_bad_options_raise_clear_errors(method):
    with pytest.raises(TypeError, match=f"unknown option '{method}_bogus'"):
        config(method, **{f"{method}_bogus": 1})
    cls = config(method).method_class
    for f in dataclasses.fields(cls.Options):
        kind = f.metadata.get("kind")
        if kind in (int, float):
            with pytest.raises(TypeError, match=f.name):
                config(method, **{f"{method}_{f.name}": "nope"})
        if f.metadata.get("low") is not None and kind in (int, float):
            with pytest.raises(ValueError, match=f.name):
                config(method, **{f"{method}_{f.name}": kind(f.metadata["low"]) - 1})
    with pytest.raises(ValueError, match="allocation"):
        config(method, allocation="bogus")
