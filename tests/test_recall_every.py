"""``recall_every=N`` (caches/recall.py): every Nth decode step recalls with that step's query, the
method's compression returns the hot tier to its budget, with no host sync and nothing lost."""

import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import KVCacheConfig, methods

from conftest import forbid_host_sync, make_cache
from test_recall import D, NEEDLE, _uniform, needle_keys, assert_nothing_lost, hot_positions


def test_config_validates_and_round_trips_recall_every():
    cfg = KVCacheConfig("snapkv", budget=64, recall="memory", recall_every=4)
    assert cfg.to_dict()["recall_every"] == 4 and KVCacheConfig.from_dict(cfg.to_dict()) == cfg
    assert "recall_every" not in KVCacheConfig("snapkv", budget=64, recall="memory").to_dict()
    with pytest.raises(ValueError, match="needs recall='memory'"):
        KVCacheConfig("snapkv", budget=64, recall="disk", recall_every=4)
    with pytest.raises(ValueError, match="needs recall='memory'"):
        KVCacheConfig("snapkv", budget=64, recall_every=4)
    with pytest.raises(ValueError, match=">= 1"):
        KVCacheConfig("snapkv", budget=64, recall="memory", recall_every=0)
    with pytest.raises(TypeError, match="int"):
        KVCacheConfig("snapkv", budget=64, recall="memory", recall_every=2.5)


def _decode_needle(every, steps=8):
    """The prompt never attends to the needle row, so SnapKV evicts it at the prompt's end; then the
    decode queries point at its key (no new multi-token input, so only ``recall_every`` can recall)."""
    cache = make_cache("snapkv", small=True, budget=32, recall="memory", recall_page=8, recall_pages=2,
                       recall_every=every)
    rng, (H, Hq, N), u, keys = needle_keys()
    q_off = rng.normal(size=(1, Hq, N, D)).astype(np.float32) * 0.1
    q_off[..., :4] = -1.0
    q_off = mx.array(q_off)

    def step(k, q):
        cache.update_and_fetch(k, k * 2 + 1)
        cache.observe_queries(q)

    for a in range(0, N - 1, 33):
        b = min(a + 33, N - 1)
        step(keys[:, :, a:b], q_off[:, :, a:b])
    step(keys[:, :, N - 1:], q_off[:, :, N - 1:])
    assert all(NEEDLE not in row for row in hot_positions(cache)[0])  # evicted
    q_needle = mx.broadcast_to(mx.array(u * 4), (1, Hq, 1, D))
    with forbid_host_sync():
        for _ in range(steps):
            step(mx.array(rng.normal(size=(1, H, 1, D)).astype(np.float32)) * 0.1, q_needle)
    return cache, keys


def test_decode_recalls_the_evicted_row_every_n_steps():
    cache, keys = _decode_needle(every=4, steps=8)
    assert cache.cold.recalls == 2  # steps 4 and 8
    pos = np.array(cache.kept_positions())
    hot_k = np.array(cache.stored("keys"))
    want = np.array(mx.dequantize(*mx.quantize(keys[:, :, NEEDLE:NEEDLE + 1], group_size=32, bits=4),
                                  group_size=32, bits=4))
    for h in range(2):
        j = np.flatnonzero(pos[0, h] == NEEDLE)
        assert len(j) == 1, pos[0, h]
        np.testing.assert_array_equal(hot_k[0, h, j[0]], want[0, h, 0])
        assert np.all(np.diff(pos[0, h]) > 0)
    assert cache.size() == cache.budget
    assert_nothing_lost(cache)


def test_without_recall_every_decode_never_recalls():
    cache, _ = _decode_needle(every=None, steps=8)
    assert cache.cold.recalls == 0 and all(NEEDLE not in row for row in hot_positions(cache)[0])


def test_steps_before_the_nth_do_not_recall():
    cache, _ = _decode_needle(every=4, steps=3)
    assert cache.cold.recalls == 0 and all(NEEDLE not in row for row in hot_positions(cache)[0])


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_recalls_during_decode_without_sync_and_loses_nothing(method):
    cache = make_cache(method, small=True, n_layers=2, recall="memory", recall_page=8, recall_every=3,
                       **_uniform(method))
    k = mx.random.normal((1, 2, 140, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 140, D), key=mx.random.key(2))
    with forbid_host_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at = 0
        for s in (30, 30, 9, 1, *[1] * 12, 9, 1, *[1] * 6):  # a prompt, decode, a follow-up, decode
            cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
            cache.observe_queries(q[:, :, at:at + s])
            cache.attention_mask(None, q[:, :, at:at + s])
            at += s
    # decode steps 3, 6, 9, 12, the follow-up's recall, steps 15, 18 (an input's last token is no step)
    assert cache.cold.recalls == 7, cache.cold.recalls
    assert cache.size() <= cache.schedule.threshold()
    assert_nothing_lost(cache)
    mx.eval(cache.state)


def test_cli_flag_sets_recall_every_and_refuses_it_without_the_memory_tier():
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.args import CLIError, config_from_args

    def cfg(*flags):
        return config_from_args(build_parser().parse_args(["generate", "--method", "snapkv", "--budget", "64",
                                                           *flags]), 100)
    assert cfg("--recall", "memory", "--recall-every", "8").recall_every == 8
    assert cfg("--recall", "memory").recall_every is None
    with pytest.raises(ValueError, match="needs recall='memory'"):
        cfg("--recall", "disk", "--recall-every", "8")
    with pytest.raises(CLIError, match="only apply with --recall"):
        cfg("--recall-every", "8")


def test_save_load_keeps_the_decode_step_count(tmp_path):
    """A loaded cache recalls on the same decode step as the one it was saved from."""
    from veloxquant_mlx import load_prompt_cache, save_prompt_cache

    cache, _ = _decode_needle(every=4, steps=2)  # two decode steps into the cycle
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert loaded.cold.steps == 2 and loaded.config.recall_every == 4
    rng = np.random.default_rng(3)
    for i in range(2):
        k = mx.array(rng.normal(size=(1, 2, 1, D)).astype(np.float32)) * 0.1
        q = mx.array(rng.normal(size=(1, 4, 1, D)).astype(np.float32))
        for c in (cache, loaded):
            c.update_and_fetch(k, k * 2 + 1)
            c.observe_queries(q)
        assert cache.cold.recalls == loaded.cold.recalls == i  # step 3: none; step 4: both recall
    np.testing.assert_array_equal(np.array(cache.kept_positions()), np.array(loaded.kept_positions()))
    assert_nothing_lost(loaded)


def test_a_cache_saved_between_a_recall_and_its_compression_loses_nothing(tmp_path):
    """A follow-up's first chunk recalls (the one-pass path) and the compression waits for the input's
    end: a save in between carries the pages the recall read, so the loaded cache refills them."""
    from veloxquant_mlx import load_prompt_cache, save_prompt_cache

    cache = make_cache("snapkv", small=True, budget=32, recall="memory", recall_page=8, recall_pages=2)
    k = mx.random.normal((1, 2, 130, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 130, D), key=mx.random.key(2))
    at = 0
    for s in (50, 49, 1, 1, 1):  # a prompt (its last token alone) and two decode steps
        cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
        cache.observe_queries(q[:, :, at:at + s])
        at += s
    cache.continue_on_purpose()
    cache.update_and_fetch(k[:, :, at:at + 10], k[:, :, at:at + 10])
    cache.observe_and_attend(q[:, :, at:at + 10])  # the follow-up's first chunk: recalled at once
    at += 10
    assert cache.cold.recalls == 1 and cache.cold.holes is not None
    save_prompt_cache(tmp_path / "c.safetensors", [cache])
    (loaded,) = load_prompt_cache(tmp_path / "c.safetensors")
    for c in (cache, loaded):
        c.update_and_fetch(k[:, :, at:at + 1], k[:, :, at:at + 1])
        c.observe_queries(q[:, :, at:at + 1])  # the input's last token: the compression refills the holes
        assert c.size() == c.budget and c.cold.holes is None
        assert_nothing_lost(c)
    np.testing.assert_array_equal(np.array(cache.kept_positions()), np.array(loaded.kept_positions()))
