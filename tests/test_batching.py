"""Continuous batching (mlx-lm's BatchGenerator / batch_generate) with eviction caches.

The target: every row of a batch generates exactly what its prompt generates alone with the same
config (greedy), and holds exactly the same cache (kept positions, offsets, eviction counts), while
rows of different lengths evict at different times, during the prompt and during decode.
"""

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from veloxquant_mlx import EvictionCache, KVCacheBuilder, methods
from veloxquant_mlx.caches.batch import HEADROOM, BatchEvictionCache

from conftest import forbid_host_sync, greedy, make_tiny_model, random_prompt, small_config, tiny_tokenizer
METHODS = sorted(methods())
PROMPTS = [random_prompt(n, seed=s) for n, s in ((61, 1), (30, 2), (83, 3))]
STEP = 8  # prefill chunk: every prompt is processed in several chunks, padded ones included


def cfg(method, budget=24, **kw):
    return small_config(method, budget=budget, **{"prompt_eviction": "stream", **kw})


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def alone(model, config, prompt, max_tokens):
    caches = KVCacheBuilder.for_model(model, config)
    tokens, logprobs = greedy(model, prompt, max_tokens=max_tokens, prompt_cache=caches,
                              prefill_step_size=STEP)
    return tokens, logprobs, caches


def batched(model, config, prompts, max_tokens, **kw):
    if config is not None:
        KVCacheBuilder.install(model, config)
    try:
        return batch_generate(model, tiny_tokenizer(), prompts, max_tokens=max_tokens,
                              prefill_step_size=STEP, return_prompt_caches=True,
                              return_token_ids=True, return_logprobs=True, **kw)
    finally:
        KVCacheBuilder.uninstall(model)


def same_cache(a, b):
    return (type(a) is type(b) and a.offset == b.offset and a.evictions == b.evictions
            and np.array_equal(np.array(a.kept_positions()), np.array(b.kept_positions())))


@pytest.mark.parametrize("method", METHODS)
def test_batch_generate_equals_each_prompt_alone(model, method):
    config = cfg(method)
    max_tokens = [12, 7, 10]  # rows also finish (and are filtered out) at different steps
    ref = [alone(model, config, p, m) for p, m in zip(PROMPTS, max_tokens)]
    out = batched(model, config, PROMPTS, max_tokens)
    for (tokens, logprobs, caches), got, got_lp, got_caches in zip(ref, out.token_ids, out.logprobs,
                                                                  out.caches):
        assert got == tokens
        picked = logprobs[np.arange(len(tokens)), tokens]
        np.testing.assert_allclose(got_lp, picked, atol=1e-4)
        assert all(same_cache(a, b) for a, b in zip(caches, got_caches))
    evictions = [[c.evictions for c in caches] for _, _, caches in ref]
    assert len({tuple(e) for e in evictions}) > 1, "rows of different lengths should evict differently"
    assert all(max(e) >= 1 for e in evictions)
    if not config.method_class.prefill_only:
        # decode-bounded: the longest row kept evicting during decode too
        longest = ref[2][2][0]
        assert longest.evictions > (len(PROMPTS[2]) - config.budget) // (config.budget + longest.slack) + 1


@pytest.mark.parametrize("method", ["h2o", "snapkv", "nexus"])
def test_ragged_ada_rows_batch_exactly(model, method):
    """Ada-KV gives heads different budgets (padding inside each row): per-head batch masks."""
    config = cfg(method, allocation="ada")
    ref = [alone(model, config, p, 9) for p in PROMPTS]
    out = batched(model, config, PROMPTS, 9)
    assert any(c.is_ragged for _, _, caches in ref for c in caches)
    for (tokens, _, caches), got, got_caches in zip(ref, out.token_ids, out.caches):
        assert got == tokens
        assert all(same_cache(a, b) for a, b in zip(caches, got_caches))


def test_no_eviction_equals_mlx_lm_batch_caches(model):
    theirs = batched(model, None, PROMPTS, 10)
    for method in ("streaming", "nexus"):
        ours = batched(model, cfg(method, budget=1000), PROMPTS, 10)
        assert ours.token_ids == theirs.token_ids
        for a, b in zip(ours.logprobs, theirs.logprobs):
            np.testing.assert_allclose(a, b, atol=1e-4)
        assert all(c.evictions == 0 for caches in ours.caches for c in caches)


def test_qwen3_batch_equals_alone():
    model = make_tiny_model("qwen3")
    config = cfg("h2o")
    ref = [alone(model, config, p, 8)[0] for p in PROMPTS]
    assert batched(model, config, PROMPTS, 8).token_ids == ref


@pytest.mark.filterwarnings("ignore:.*earlier generation")  # the stand-alone second turn, on purpose
def test_continuous_batching_with_late_arrivals_and_a_second_turn(model):
    """BatchGenerator: a sequence inserted while others decode, then a second turn that continues
    the first turn's caches (the server's multi-turn reuse) equals the same conversation alone."""
    config = cfg("nexus")
    KVCacheBuilder.install(model, config)
    try:
        gen = BatchGenerator(model, prefill_step_size=STEP)
        uids = gen.insert(PROMPTS[:2], [10, 10])
        out, caches = {u: [] for u in uids}, {}
        late = None
        for step in range(200):
            responses = gen.next_generated()
            if not responses:
                break
            for r in responses:
                out[r.uid].append(r.token)
                if r.finish_reason is not None:
                    caches[r.uid] = r.prompt_cache
            if step == 3:
                (late,) = gen.insert([PROMPTS[2]], [10])
                out[late] = []
        turn2 = [random_prompt(9, seed=7), random_prompt(17, seed=8)]
        second = batch_generate(model, tiny_tokenizer(), turn2, max_tokens=6, prefill_step_size=STEP,
                                prompt_caches=[caches[uids[0]], caches[uids[1]]], return_token_ids=True)
        gen.close()
    finally:
        KVCacheBuilder.uninstall(model)
    for uid, prompt in zip(uids + [late], PROMPTS):
        assert out[uid] == alone(model, config, prompt, 10)[0]
    for k, (uid, prompt) in enumerate(zip(uids, PROMPTS)):
        tokens, _, c = alone(model, config, prompt, 10)
        # The first turn's cache holds the prompt and every generated token (mlx-lm feeds each).
        assert all(a.offset == len(prompt) + 10 for a in c)
        assert all(same_cache(a, b) for a, b in zip(c, caches[uid]))
        assert second.token_ids[k] == greedy(model, turn2[k], max_tokens=6, prompt_cache=c,
                                             prefill_step_size=STEP)[0]


def test_merge_filter_extend_extract(model):
    config = cfg("h2o")
    rows = [KVCacheBuilder.for_model(model, config)[0] for _ in range(3)]
    assert all(hasattr(c, "merge") for c in rows)
    batch = rows[0].merge(rows)
    assert isinstance(batch, BatchEvictionCache) and batch.empty()
    assert all(b is not r and type(b) is type(r) for b, r in zip(batch.rows, rows))  # copies
    k = mx.random.normal((3, 2, 40, 16))
    batch.prepare(lengths=[40, 25, 10], right_padding=[0, 15, 30])
    out_k, _ = batch.update_and_fetch(k, k)
    batch.finalize()
    assert all(r.empty() for r in rows)  # the caches merged are left as they were
    rows = batch.rows
    assert [r.offset for r in rows] == [40, 25, 10]
    assert out_k.shape == (3, 2, 40, 16)
    np.testing.assert_array_equal(np.array(out_k[1, :, 15:]), np.array(k[1, :, :25]))  # left-padded
    assert np.array(batch.offset).tolist() == [40, 25, 10]
    # one (3, 2, 40 + headroom, 16) fp32 buffer for keys and one for values, plus each row's own state
    held = 2 * 3 * 2 * (40 + HEADROOM) * 16 * 4
    assert batch.nbytes == held + sum(r.nbytes - r.keys.nbytes - r.values.nbytes for r in rows)
    assert not batch.is_trimmable()

    copy_1 = batch.extract(1)
    assert copy_1 is not rows[1] and same_cache(copy_1, rows[1])
    batch.update_and_fetch(k[:, :, :1], k[:, :, :1])
    assert copy_1.offset == 25 and rows[1].offset == 26  # the extracted copy is independent

    rows = list(rows)
    batch.filter([2, 0])
    assert batch.rows == [rows[2], rows[0]]
    other = BatchEvictionCache.merge([copy_1])
    batch.extend(other)
    assert batch.rows[:2] == [rows[2], rows[0]] and same_cache(batch.rows[2], copy_1)
    assert batch.size() == max(r.size() for r in batch.rows) > 0
    deep = copy.deepcopy(batch)  # PromptProcessingBatch.split deep-copies its caches
    assert all(same_cache(a, b) and a is not b for a, b in zip(deep.rows, batch.rows))


def test_left_padding_is_dropped_and_shifts_rope_offsets():
    config = cfg("streaming", budget=100)
    rows = [EvictionCache(config, 0, 1) for _ in range(2)]
    for r in rows:
        r.tap_active = True
    batch = BatchEvictionCache.merge(rows)
    rows = batch.rows
    batch.prepare(left_padding=[0, 3])
    assert np.array(batch.offset).tolist() == [0, -3]  # real tokens of row 1 start at position 0
    k = mx.random.normal((2, 2, 5, 8))
    batch.update_and_fetch(k, k)
    assert [r.offset for r in rows] == [5, 2]
    np.testing.assert_array_equal(np.array(rows[1].stored("keys")), np.array(k[1:, :, 3:]))
    mask = np.array(batch.attention_mask("causal", mx.zeros((2, 4, 5, 8))))
    # row 1, its first real query (index 3) sees its first real key (column 3) only
    assert mask[1, 0, 3].tolist() == [False, False, False, True, False]
    assert mask[0, 0, 4].all() and mask[0, 0, 0].tolist() == [True, False, False, False, False]


def test_batch_hot_path_forces_no_host_sync(model):
    config = cfg("nexus")
    rows = [KVCacheBuilder.for_model(model, config)[0] for _ in range(2)]
    batch = BatchEvictionCache.merge(rows)
    rows = batch.rows
    k = mx.random.normal((2, 2, 30, 16))
    mx.eval(k)
    batch.prepare(lengths=[30, 12], right_padding=[0, 18])
    with forbid_host_sync():
        for s in (8, 8, 8, 6):
            batch.update_and_fetch(k[:, :, :s], k[:, :, :s])
            q = mx.repeat(k[:, :, :s], 2, axis=1)
            batch.observe_queries(q, 0.25)
            batch.attention_mask("causal", q)
        batch.finalize()
        for _ in range(12):
            batch.update_and_fetch(k[:, :, :1], k[:, :, :1])
            batch.observe_queries(mx.repeat(k[:, :, :1], 2, axis=1), 0.25)
            batch.attention_mask(None, mx.repeat(k[:, :, :1], 2, axis=1))
    assert [r.offset for r in rows] == [42, 24] and rows[0].evictions >= 1


def test_caches_that_cannot_batch_have_no_merge(model):
    config = cfg("h2o")
    c = KVCacheBuilder.for_model(model, config)[0]
    c.tap_active = False  # a model without the query tap: per-layer masks cannot reach attention
    assert not hasattr(c, "merge")
    with pytest.raises(ValueError, match="query tap"):
        BatchEvictionCache.merge([c])
    two = KVCacheBuilder.for_model(model, config)[0]
    two.update_and_fetch(mx.zeros((2, 2, 3, 16)), mx.zeros((2, 2, 3, 16)))
    assert not hasattr(two, "merge")  # already a B=2 generation
    # the class attribute is still there for mlx-lm's type(c).merge(...) style
    assert type(c).merge([KVCacheBuilder.for_model(model, config)[0]]).rows


def test_server_sees_our_caches_as_batchable(model):
    KVCacheBuilder.install(model, cfg("snapkv"))
    try:
        caches = make_prompt_cache(model)
        assert all(hasattr(c, "merge") for c in caches)  # mlx_lm.server's is_batchable probe
        assert isinstance(caches[0].merge(caches[:1]), BatchEvictionCache)
    finally:
        KVCacheBuilder.uninstall(model)
    assert isinstance(make_prompt_cache(model)[0].merge(make_prompt_cache(model)[:1]), BatchKVCache)
