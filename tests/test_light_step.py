"""The cheap branch of a decode step between evictions (EvictionCache.update_and_fetch / tap_step): the same
rows, scores and tokens as the full step, and a step's weight (Python calls of ours, graph nodes over
mlx-lm's RotatingKVCache)."""

from __future__ import annotations

import cProfile
import pstats
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

import veloxquant_mlx
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, methods
from veloxquant_mlx.caches import EvictionCache
from veloxquant_mlx.decode import feed_prompt, greedy, step

from conftest import fit_tiny_scorer, make_tiny_model, random_prompt

PACKAGE = str(Path(veloxquant_mlx.__file__).resolve().parent)
BUDGET, PROMPT, DECODE = 96, 300, 70  # decode crosses evictions (slack 32 for the decode-bounded methods)


def _config(method, model, **kw):
    opts = {"kvzap_scorer": str(fit_tiny_scorer(model))} if method == "kvzap" else {}
    return KVCacheConfig(method=method, seed=0, **{"budget": BUDGET, **opts, **kw})


def _generate(model, cfg, light: bool):
    caches = KVCacheBuilder.for_model(model, cfg)
    if not light:
        for c in caches:
            c._refresh_light = lambda c=c: setattr(c, "_light", 0)
    x = mx.array(random_prompt(PROMPT))
    feed_prompt(model, x, caches, 128)
    y = step(model, x[-1:], caches)
    toks = greedy(model, caches, y, DECODE, feed_last=True)
    KVCacheBuilder.uninstall(model)
    return caches, toks


@pytest.mark.parametrize("method,kw", [("streaming", {}), ("h2o", {}), ("snapkv", {}), ("morphkv", {}),
                                       ("nexus", {"budget": 160}), ("kvzap", {}), ("kvzip", {}),
                                       ("nestedkv", {}), ("random", {}), ("h2o", {"allocation": "ada"}),
                                       ("morphkv", {"prompt_eviction": "stream"})])
def test_light_step_keeps_what_the_full_step_keeps(method, kw):
    model = make_tiny_model()
    cfg = _config(method, model, **kw)
    light, toks = _generate(model, cfg, True)
    full, toks_full = _generate(model, cfg, False)
    assert toks == toks_full
    assert sum(c.queries_observed for c in light) == sum(c.queries_observed for c in full)
    for a, b in zip(light, full):
        assert a.offset == b.offset and a.evictions == b.evictions
        assert np.array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))
        for name in a.store.fields:
            assert np.array_equal(np.array(a.stored(name)), np.array(b.stored(name))), name
        qa, qb = a.window_queries()[0], b.window_queries()[0]
        assert (qa is None) == (qb is None) and (qa is None or np.array_equal(np.array(qa), np.array(qb)))
    assert any(c.evictions for c in light) or cfg.method_class.prefill_only


def _decode_ready(method, model, **kw):
    """Caches of ``method`` (or mlx-lm's rotating window) a few decode steps after the prompt."""
    if method == "rotating":
        caches = [RotatingKVCache(max_size=BUDGET, keep=4) for _ in model.layers]
    else:
        caches = KVCacheBuilder.for_model(model, _config(method, model, **kw))
    x = mx.array(random_prompt(PROMPT))
    feed_prompt(model, x, caches, 512)
    y = step(model, x[-1:], caches)
    for _ in range(3):
        y = step(model, y.reshape(1), caches)
    mx.eval(y, [c.state for c in caches])
    return caches, y


def held_arrays(c) -> list:
    """Every array a cache holds (its buffers, positions, fields, query window), as held."""
    if not isinstance(c, EvictionCache):
        return [a for a in vars(c).values() if isinstance(a, mx.array)]
    st = c.store
    bufs = [st.keys, st.values, st.positions, *st.fields.values(), c.window.q]
    return [x for b in bufs for x in (b if isinstance(b, tuple) else (b,)) if isinstance(x, mx.array)]


def _weight(method):
    """(Python calls, of them in veloxquant_mlx made by every layer, graph nodes) of one decode step, per
    layer (the package's calls made once per forward, the model-pass wrapper's and make_mask's, left out)."""
    model = make_tiny_model(layers=4)
    kw = {"nexus": {"budget": 160}, "pyramidkv": {"pyramidkv_beta": 2.0}}.get(method, {})
    caches, y = _decode_ready(method, model, **kw)
    prof = cProfile.Profile()
    prof.enable()
    logits = model(y.reshape(1, 1), cache=caches)
    prof.disable()
    held = [a for c in caches for a in held_arrays(c)]
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, logits, *held)
        nodes = len(re.findall(r'shape=rectangle\]', Path(f.name).read_text()))
    st = pstats.Stats(prof).stats
    n = len(model.layers)
    calls = sum(v[0] for v in st.values())
    ours = sum(v[0] for k, v in st.items() if k[0].startswith(PACKAGE) and v[0] >= n)
    KVCacheBuilder.uninstall(model)
    return calls / n, ours / n, nodes / n


# Graph nodes over RotatingKVCache's per layer-step where a method's own work needs more than the target's
# 4: H2O's attention mass (a field written every step; its fused kernel replaces mlx-lm's attention) and the
# ragged heads' decode mask of NestedKV and of kvzap's and kvzip's Ada-KV allocation (here their rows' scores
# are held until the rows are next read: caches.cache.fold_held).
NODES_ABOVE = {"h2o": 7, "nestedkv": 5, "kvzap": 5, "kvzip": 5}


@pytest.mark.parametrize("method", sorted(methods()))
def test_light_step_weighs_no_more_than_its_targets(method):
    calls, ours, nodes = _weight(method)
    base_calls, _, base_nodes = _weight("rotating")
    assert ours <= 8, f"{method}: {ours} calls of ours per layer-step"
    assert calls <= 1.5 * base_calls, f"{method}: {calls} calls per layer-step vs rotating {base_calls}"
    allowed = NODES_ABOVE.get(method, 4)
    assert nodes <= base_nodes + allowed, f"{method}: {nodes} graph nodes per layer-step vs rotating {base_nodes}"


def test_light_step_refuses_a_bad_token_like_the_full_step():
    model = make_tiny_model()
    caches, y = _decode_ready("streaming", model)
    c = caches[0]
    assert c._light > c.size()  # the next step would be light
    k = mx.zeros((1, c.keys.shape[1], 1, c.keys.shape[3] + 1))
    with pytest.raises(ValueError, match="do not match the stored"):
        c.update_and_fetch(k, k)
    KVCacheBuilder.uninstall(model)


def test_light_path_is_off_where_the_full_step_has_work():
    model = make_tiny_model()
    caches, _ = _decode_ready("streaming", model)
    c = caches[0]
    assert c._light == c.schedule.threshold()  # at most up to the next eviction
    c.prompt.open = True
    c._refresh_light()
    assert c._light == 0
    KVCacheBuilder.uninstall(model)
    assert isinstance(c, EvictionCache)


@pytest.mark.parametrize("method", ["snapkv", "morphkv", "nexus", "kvzip", "tova"])
def test_observed_window_is_the_one_key_fallback_until_queries_arrive(method):
    from conftest import make_cache

    c = make_cache(method, small=True, budget=64)
    k = mx.random.normal((1, 2, 40, 16), key=mx.random.key(1))
    c.update_and_fetch(k, k)
    W = min(c.window.size, 40)
    q, q_pos, scale = c.observed_window()  # no query observed: the newest W keys, at the newest positions
    assert np.array_equal(np.array(q), np.array(k[:, :, 40 - W:]))
    assert np.array(q_pos).tolist() == list(range(40 - W, 40)) and scale == 16 ** -0.5
    queries = mx.random.normal((1, 4, 1, 16), key=mx.random.key(2))
    c.update_and_fetch(k[:, :, :1], k[:, :, :1])
    c.observe_queries(queries, 0.5)
    q, q_pos, scale = c.observed_window()
    assert np.array_equal(np.array(q[:, :, -1:]), np.array(queries)) and int(q_pos[-1]) == 40 and scale == 0.5


def test_continue_on_purpose_ends_the_light_steps():
    model = make_tiny_model()
    caches, _ = _decode_ready("streaming", model)
    c = caches[0]
    assert c._light > c.size()
    c.continue_on_purpose()
    assert c._light == 0 and not c.prompt.saw_decode
    KVCacheBuilder.uninstall(model)


def test_held_work_is_written_before_a_read_and_dropped_with_replaced_rows():
    model = make_tiny_model()
    caches, y = _decode_ready("kvzap", model)
    c = caches[0]
    assert not c.holds  # reading the state wrote what the light steps held
    saved = {k: mx.array(v) for k, v in c.state.items()}
    y = step(model, y.reshape(1), caches)
    assert c.holds  # a light step: its row's score waits for the next read
    c.state = saved  # rows replaced: the held score belonged to the old rows
    assert not c.holds
    assert np.array_equal(np.array(c.stored("zap_score")), np.array(saved["row.zap_score"]))
    KVCacheBuilder.uninstall(model)
