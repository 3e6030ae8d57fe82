"""Recallable eviction (KVCacheConfig(recall=...), caches/recall.py): evicted rows go cold, a follow-up
input recalls the ones it attends to, nothing is lost, bytes are accounted, disk files are owned."""

import copy
import gc
import os
import warnings

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, load_prompt_cache, methods, save_prompt_cache
from veloxquant_mlx.caches.batch import BatchEvictionCache
from veloxquant_mlx.caches.recall import COLD_GROUP
from veloxquant_mlx.ops.recall import PAD, page_summaries, quest_bounds

from conftest import forbid_host_sync, greedy, make_cache, make_tiny_model, random_prompt, small_config

D = 32  # cold rows are quantized in groups of 32 along head_dim
TIERS = ["memory", "disk"]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", hidden_size=128)  # 4 query heads, 2 KV heads, head_dim 32


def cold_positions(cache):
    """(B, H) lists of the real positions held in the cold tier."""
    t = cache.cold
    if cache.config.recall == "memory":
        pos = np.array(t.pos[:, :, :t.filled])
    else:
        parts = [np.array(p) for _, _, p in t.pending]
        if t.flushed:
            mm = np.memmap(t.path, dtype=t.record, mode="r", shape=(t.flushed, *t.shape))
            parts.insert(0, np.moveaxis(np.array(mm["pos"]), 0, 2).reshape(*t.shape, -1))
        pos = np.concatenate(parts, axis=2)
    if t.carry is not None:  # evicted rows short of a whole page
        pos = np.concatenate([pos, np.array(t.carry[2])], axis=2)
    return [[row[row != 2**31 - 1] for row in b] for b in pos]


def hot_positions(cache):
    return [[row[row >= 0] for row in b] for b in np.array(cache.kept_positions())]


def assert_nothing_lost(cache):
    """Every position seen is in exactly one tier (hot or cold), once."""
    for hot_b, cold_b in zip(hot_positions(cache), cold_positions(cache)):
        for hot, cold in zip(hot_b, cold_b):
            both = np.concatenate([hot, cold])
            assert sorted(both.tolist()) == list(range(cache.offset))


# -- config ------------------------------------------------------------------------------------------
def test_config_validates_recall_fields(tmp_path):
    with pytest.raises(ValueError, match="recall='ssd'"):
        KVCacheConfig("snapkv", recall="ssd")
    with pytest.raises(ValueError, match="recall_bits=3"):
        KVCacheConfig("snapkv", recall="memory", recall_bits=3)
    with pytest.raises(ValueError, match="recall_page"):
        KVCacheConfig("snapkv", recall="memory", recall_page=0)
    with pytest.raises(ValueError, match="not an existing folder"):
        KVCacheConfig("snapkv", recall="disk", recall_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not writable"):
        KVCacheConfig("snapkv", recall="disk", recall_dir="/proc")  # no file can be created there, even as root
    with pytest.raises(ValueError, match="only used by recall='disk'"):
        KVCacheConfig("snapkv", recall="memory", recall_dir=str(tmp_path))
    with pytest.raises(ValueError, match="uniform per-head storage"):
        KVCacheConfig("snapkv", recall="memory", allocation="ada")
    with pytest.raises(ValueError, match="cross_head=False"):
        KVCacheConfig("nestedkv", recall="memory")
    KVCacheConfig("nestedkv", recall="memory", nestedkv_cross_head=False)


def test_recall_none_serializes_as_before_and_round_trips(tmp_path):
    plain = KVCacheConfig("nexus", budget=256)
    assert not any(k.startswith("recall") for k in plain.to_dict()) and plain.recall is None
    cfg = KVCacheConfig("nexus", budget=256, recall="disk", recall_dir=str(tmp_path), recall_bits=2)
    assert KVCacheConfig.from_dict(cfg.to_dict()) == cfg and cfg != plain
    assert "recall='disk'" in repr(cfg)


def test_head_dim_not_a_multiple_of_the_cold_group_fails_before_storing():
    cache = make_cache("streaming", small=True, recall="memory")
    k = mx.zeros((1, 2, 4, 16))
    with pytest.raises(ValueError, match=f"groups of {COLD_GROUP}"):
        cache.update_and_fetch(k, k)
    assert cache.keys is None


# -- nothing evicted: exactly KVCache --------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("method", sorted(methods()))
def test_equals_kvcache_when_nothing_is_evicted(method, tier, model):
    prompt = random_prompt(40, seed=3)
    ref_tokens, ref_lp = greedy(model, prompt, max_tokens=6)
    kw = {"allocation": "uniform"} if config_allocation(method) == "ada" else {}
    if method == "nestedkv":
        kw["nestedkv_cross_head"] = False
    caches = KVCacheBuilder.for_model(model, small_config(method, budget=4096, recall=tier, **kw))
    tokens, lp = greedy(model, prompt, max_tokens=6, prompt_cache=caches)
    assert tokens == ref_tokens and np.abs(lp - ref_lp).max() <= 1e-5
    assert all(c.evictions == 0 and c.cold.n_pages == 0 for c in caches)


def config_allocation(method):
    return small_config(method).allocation


# -- a follow-up recalls exactly what was evicted ---------------------------------------------------
NEEDLE = 40


def needle_keys():
    """(rng, (H, Hq, N), u, keys): small random keys of 2 KV heads x 100 rows with the strong key
    ``u`` at row ``NEEDLE``; ``rng`` continues from there for the caller's later draws."""
    rng = np.random.default_rng(0)
    H, Hq, N = 2, 4, 100
    keys = rng.normal(size=(1, H, N, D)).astype(np.float32) * 0.1
    u = np.zeros(D, np.float32)
    u[:4] = 3.0
    keys[:, :, NEEDLE] = u
    return rng, (H, Hq, N), u, mx.array(keys)


def _needle_run(tier, tmp_path=None, budget=32, attend=False, hold=False):
    """The prompt's queries point away from the needle row (position 40), so SnapKV evicts it at the
    prompt's end; the follow-up's queries point at its key, so the recall must offer it back and
    SnapKV's compression of the follow-up keep it."""
    kw = {"recall_dir": str(tmp_path)} if tier == "disk" and tmp_path is not None else {}
    if tmp_path is not None:
        os.makedirs(tmp_path, exist_ok=True)
    if tier is not None:
        kw.update(recall_page=8, recall_pages=2, **({"recall_hold": True} if hold else {}))
    cache = make_cache("snapkv", small=True, budget=budget, recall=tier, **kw)
    rng, (H, Hq, N), u, keys = needle_keys()
    values = keys * 2 + 1
    q_off = rng.normal(size=(1, Hq, N, D)).astype(np.float32) * 0.1
    q_off[..., :4] = -1.0  # q . needle = -12: the prompt never attends to it
    q_off = mx.array(q_off)

    def step(k, v, q):
        cache.update_and_fetch(k, v)
        cache.observe_queries(q)

    for a in range(0, N - 1, 33):  # the prompt in chunks, then its last token alone
        b = min(a + 33, N - 1)
        step(keys[:, :, a:b], values[:, :, a:b], q_off[:, :, a:b])
    step(keys[:, :, N - 1:], values[:, :, N - 1:], q_off[:, :, N - 1:])
    assert all(NEEDLE not in row for row in hot_positions(cache)[0])  # evicted
    for i in range(3):  # a short answer
        k = mx.array(rng.normal(size=(1, H, 1, D)).astype(np.float32)) * 0.1
        step(k, k, mx.array(rng.normal(size=(1, Hq, 1, D)).astype(np.float32)) * 0.1)
    cache.continue_on_purpose()
    # the follow-up: its queries attend strongly to the needle's key
    q_needle = mx.broadcast_to(mx.array(u * 4), (1, Hq, 6, D))
    k2 = mx.array(rng.normal(size=(1, H, 7, D)).astype(np.float32)) * 0.1
    if attend:  # the tap's one-pass path: the chunk recalls at once and attends to the recalled rows
        cache.update_and_fetch(k2[:, :, :6], k2[:, :, :6])
        out = cache.observe_and_attend(q_needle)
        assert any(NEEDLE in row for row in hot_positions(cache)[0]) and cache.cold.recalls == 1
        want = mx.fast.scaled_dot_product_attention(q_needle, cache.stored("keys"), cache.stored("values"),
                                                    scale=D ** -0.5, mask="causal")
        np.testing.assert_allclose(np.array(out), np.array(want), atol=1e-6)
    else:
        step(k2[:, :, :6], k2[:, :, :6], q_needle)
        assert tier is None or cache.cold.armed
    step(k2[:, :, 6:], k2[:, :, 6:], q_needle[:, :, :1])
    return cache, keys, values


@pytest.mark.parametrize("attend", [False, True])
@pytest.mark.parametrize("tier", TIERS)
def test_follow_up_recalls_the_exact_evicted_row_at_its_position(tier, attend, tmp_path):
    cache, keys, values = _needle_run(tier, tmp_path, attend=attend)
    assert cache.cold.recalls == 1 and not cache.cold.armed
    pos = np.array(cache.kept_positions())
    hot_k, hot_v = np.array(cache.stored("keys")), np.array(cache.stored("values"))
    for h in range(2):
        j = np.flatnonzero(pos[0, h] == NEEDLE)
        assert len(j) == 1, (h, pos[0, h])
        want_k, want_v = keys[:, h:h + 1, NEEDLE:NEEDLE + 1], values[:, h:h + 1, NEEDLE:NEEDLE + 1]
        if tier == "memory":  # what the cold tier holds: the row at recall_bits
            bits = cache.config.recall_bits
            want_k = mx.dequantize(*mx.quantize(want_k, group_size=COLD_GROUP, bits=bits), group_size=COLD_GROUP, bits=bits)
            want_v = mx.dequantize(*mx.quantize(want_v, group_size=COLD_GROUP, bits=bits), group_size=COLD_GROUP, bits=bits)
        np.testing.assert_array_equal(hot_k[0, h, j[0]], np.array(want_k).reshape(-1))
        np.testing.assert_array_equal(hot_v[0, h, j[0]], np.array(want_v).reshape(-1))
        assert np.all(np.diff(pos[0, h]) > 0)  # the hot tier stays in position order
    assert cache.size() == cache.budget  # the hot tier holds its budget
    assert_nothing_lost(cache)  # the row it displaced went cold


def test_without_recall_the_row_stays_lost():
    cache, _, _ = _needle_run(None)
    assert cache.cold is None and all(NEEDLE not in r for r in hot_positions(cache)[0])


def test_quest_bound_is_an_upper_bound():
    rng = np.random.default_rng(1)
    keys = mx.array(rng.normal(size=(1, 2, 5, 8, D)).astype(np.float32))  # 5 pages of 8 rows
    q = mx.array(rng.normal(size=(1, 4, 3, D)).astype(np.float32))
    bound = np.array(quest_bounds(q, keys.min(axis=3), keys.max(axis=3)))
    exact = np.einsum("bhgwd,bhprd->bhpgwr", np.array(q).reshape(1, 2, 2, 3, D), np.array(keys))
    exact = exact.reshape(1, 2, 5, -1).max(-1)
    assert np.all(bound >= exact - 1e-5) and np.all(bound < exact + 50)



@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_a_page_of_padding_only_is_never_bounded_above_a_real_page(dtype):
    """Summaries of a page with no real row are +inf / -inf: its bound is -inf, and its infinities
    leave every other page's bound finite and exact (the same as without that page)."""
    rng = np.random.default_rng(2)
    keys = mx.array(rng.normal(size=(1, 2, 4 * 8, D)).astype(np.float32)).astype(dtype)  # 4 pages of 8 rows
    pos = np.tile(np.arange(32, dtype=np.int32), (1, 2, 1))
    pos[0, 1, 8:16] = PAD  # head 1: page 1 padding only
    pos[0, 0, 20:24] = PAD  # head 0: page 2 half padding
    lo, hi = page_summaries(keys, mx.array(pos), 8)
    q = mx.array(rng.normal(size=(1, 4, 3, D)).astype(np.float32))
    bound = np.array(quest_bounds(q, lo, hi))
    assert bound[0, 1, 1] == -np.inf and np.isfinite(np.delete(bound[0, 1], 1)).all() and np.isfinite(bound[0, 0]).all()
    keep = [0, 2, 3]
    alone = np.array(quest_bounds(q, lo[:, :, keep], hi[:, :, keep]))
    np.testing.assert_allclose(bound[..., keep], alone, rtol=1e-5, atol=1e-5)  # (BLAS blocks by width)

# -- accounting, files ------------------------------------------------------------------------------
@pytest.mark.parametrize("tier", TIERS)
def test_bytes_are_accounted_by_tier(tier, tmp_path):
    cache, _, _ = _needle_run(tier, tmp_path)
    r = cache.byte_report()
    t = cache.cold
    assert r["hot_bytes"] + r["cold_resident_bytes"] + r["summary_bytes"] == r["allocated_bytes"] == cache.nbytes
    assert r["summary_bytes"] == t.kmin.nbytes + t.kmax.nbytes > 0
    assert r["cold_pages"] == t.n_pages > 0
    carry = sum(a.nbytes for a in t.carry or ())  # evicted rows short of a whole page, in memory
    if tier == "memory":
        assert r["cold_resident_bytes"] == sum(p.nbytes for p in (*t.k, *t.v, t.pos)) + carry
        assert r["cold_disk_bytes"] == 0
    else:
        assert r["cold_resident_bytes"] == carry  # pages flushed at the compression and the recall
        assert r["cold_disk_bytes"] == os.path.getsize(t.path) > 0


def test_disk_file_is_owned_removed_on_free_and_copied_on_deepcopy(tmp_path):
    cache, _, _ = _needle_run("disk", tmp_path)
    path = cache.cold.path
    assert os.path.dirname(path) == str(tmp_path) and os.path.exists(path)
    twin = copy.deepcopy(cache)
    assert twin.cold.path != path and os.path.getsize(twin.cold.path) == os.path.getsize(path)
    twin_path = twin.cold.path
    del cache
    gc.collect()
    assert not os.path.exists(path) and os.path.exists(twin_path)  # the copy still holds its own rows
    assert_nothing_lost(twin)
    twin.cold.free()
    assert not os.path.exists(twin_path)


def test_a_killed_processs_files_go_with_the_next_disk_tier(tmp_path):
    """A SIGKILLed owner cannot remove its file: the next disk tier opened in that folder removes every
    file whose owner's pid no longer runs, and leaves live owners' files and other names alone."""
    import subprocess
    import sys

    code = ("import os, sys, time; sys.path.insert(0, 'tests'); from conftest import make_cache; "
            f"c = make_cache('streaming', small=True, recall='disk', recall_dir={str(tmp_path)!r}); "
            "print(c.cold.path, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        orphan = child.stdout.readline().strip()
    finally:
        child.kill()
        child.wait()
    assert os.path.exists(orphan) and f"-{child.pid}-" in os.path.basename(orphan)
    live = make_cache("streaming", small=True, recall="disk", recall_dir=str(tmp_path))
    other = tmp_path / "veloxquant-recall-notapid.bin"
    other.write_bytes(b"")
    assert not os.path.exists(orphan)  # gone with the second tier's start
    assert os.path.exists(live.cold.path)
    again = make_cache("streaming", small=True, recall="disk", recall_dir=str(tmp_path))
    assert os.path.exists(live.cold.path) and os.path.exists(again.cold.path) and other.exists()


def test_failed_disk_write_drops_nothing(tmp_path, monkeypatch):
    cache = make_cache("streaming", small=True, budget=32, recall="disk", recall_dir=str(tmp_path), recall_page=8)
    k = mx.random.normal((1, 2, 100, D))
    q = mx.random.normal((1, 4, 100, D))
    cache.update_and_fetch(k[:, :, :99], k[:, :, :99])
    cache.observe_queries(q[:, :, :99])
    import builtins

    real_open = builtins.open

    def full_disk(path, mode="r", *a, **kw):
        if str(path) == cache.cold.path and "a" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **kw)

    monkeypatch.setattr(builtins, "open", full_disk)
    with pytest.raises(RuntimeError, match="No space left"):
        cache.update_and_fetch(k[:, :, 99:], k[:, :, 99:])
        cache.observe_queries(q[:, :, 99:])  # the prompt's end: compress, whose rows are written first
    assert cache.size() == 100 and cache.evictions == 0  # the hot tier was not touched
    assert cache.cold.resident_bytes > 0  # the evicted rows are still pending in memory


# -- no host sync (memory), save / load, batching ----------------------------------------------------
def test_memory_tier_never_syncs():
    cache = make_cache("snapkv", small=True, recall="memory", recall_page=8)
    k = mx.random.normal((1, 2, 92, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 92, D), key=mx.random.key(2))
    with forbid_host_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at = 0
        for s in (40, 29, 1, 1, 1, 9, 1, 1, 8, 1):  # two follow-up turns
            cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
            cache.observe_queries(q[:, :, at:at + s])
            at += s
    assert cache.evictions == 3 and cache.cold.recalls == 2
    assert_nothing_lost(cache)


def _decode(model, caches, tok, n):
    out = []
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=caches)[:, -1]
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append(np.array(logits))
    return out


def _two_turns(model, caches):
    for i in range(0, 70, 16):
        model(mx.array([random_prompt(70, seed=5)[i:i + 16]]), cache=caches)
    _decode(model, caches, 3, 3)
    for c in caches:
        c.continue_on_purpose()
    model(mx.array([random_prompt(12, seed=6)]), cache=caches)  # a follow-up
    _decode(model, caches, 4, 2)


@pytest.mark.parametrize("tier", TIERS)
def test_save_load_carries_the_cold_tier(tier, model, tmp_path):
    kw = {"recall_dir": str(tmp_path)} if tier == "disk" else {}
    a = KVCacheBuilder.for_model(model, small_config("snapkv", recall=tier, recall_page=8, **kw))
    _two_turns(model, a)
    assert all(c.cold.recalls == 1 for c in a)
    mx.eval([c.state for c in a])
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, a)
    b = load_prompt_cache(path)
    for x, y in zip(a, b):
        assert y.cold.n_pages == x.cold.n_pages and y.cold.recalls == x.cold.recalls
        if tier == "disk":
            assert y.cold.path != x.cold.path
    for c in (*a, *b):
        c.continue_on_purpose()
    model(mx.array([random_prompt(9, seed=7)]), cache=a)  # a third turn recalls from each copy alike
    model(mx.array([random_prompt(9, seed=7)]), cache=b)
    la, lb = _decode(model, a, 7, 4), _decode(model, b, 7, 4)
    assert all(np.array_equal(x, y) for x, y in zip(la, lb))
    assert all(c.cold.recalls == 2 for c in (*a, *b))
    for c in b:
        assert_nothing_lost(c)


def test_load_refuses_when_the_disk_file_is_gone(model, tmp_path):
    a = KVCacheBuilder.for_model(model, small_config("snapkv", recall="disk", recall_page=8, recall_dir=str(tmp_path)))
    _two_turns(model, a)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, a)
    for c in a:
        c.cold.free()
    with pytest.raises(ValueError, match="is gone"):
        load_prompt_cache(path)


def test_state_with_a_cold_tier_refuses_a_config_without_recall(model, tmp_path):
    a = KVCacheBuilder.for_model(model, small_config("snapkv", recall="memory", recall_page=8))
    _two_turns(model, a)
    plain = EvictionCache(small_config("snapkv"), layer_idx=0, n_layers=2)
    with pytest.raises(ValueError, match="recall=None"):
        plain.state = a[0].state


def test_batching_refuses_clearly(model):
    caches = KVCacheBuilder.for_model(model, small_config("nexus", recall="memory"))
    assert not hasattr(caches[0], "merge")  # mlx-lm's server then serves it on its own
    with pytest.raises(ValueError, match="cold tier"):
        BatchEvictionCache.merge([caches[0]])


# -- every method ------------------------------------------------------------------------------------
def _uniform(method, **kw):
    if config_allocation(method) == "ada":
        kw["allocation"] = "uniform"
    if method == "nestedkv":
        kw["nestedkv_cross_head"] = False
    return kw


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_recalls_without_sync_and_loses_nothing(method):
    cache = make_cache(method, small=True, n_layers=2, recall="memory", recall_page=8, **_uniform(method))
    k = mx.random.normal((1, 2, 120, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 120, D), key=mx.random.key(2))
    with forbid_host_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at = 0
        for s in (30, 30, 9, 1, 1, 1, 1, 1, 1, 1, 9, 1, 1, 12, 1):  # a prompt and two follow-up turns
            cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
            cache.observe_queries(q[:, :, at:at + s])
            cache.attention_mask(None, q[:, :, at:at + s])
            at += s
    assert cache.evictions >= 1 and cache.cold.recalls == 2
    assert_nothing_lost(cache)
    mx.eval(cache.state)


@pytest.mark.parametrize("method", sorted(methods()))
def test_every_method_generates_follow_ups_with_a_disk_tier(method, model, tmp_path):
    cfg = small_config(method, recall="disk", recall_dir=str(tmp_path), recall_page=8, **_uniform(method))
    caches = KVCacheBuilder.for_model(model, cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kvzip: the tiny model has no tokenizer for its pass
        greedy(model, random_prompt(90, seed=4), max_tokens=4, prompt_cache=caches, prefill_step_size=32)
        for c in caches:
            c.continue_on_purpose()
        tokens, lp = greedy(model, random_prompt(20, seed=5), max_tokens=4, prompt_cache=caches)
    assert len(tokens) == 4 and np.isfinite(lp).all()
    for c in caches:
        assert c.cold.recalls == 1 and c.byte_report()["cold_disk_bytes"] > 0
        assert_nothing_lost(c)


def test_disk_tier_syncs_only_where_documented(tmp_path, monkeypatch):
    """The disk tier's host reads happen in flush (the prompt's compression, a recall) and in the
    page reads / writes of a recall, never in a decode step's eviction."""
    from veloxquant_mlx.caches.recall_disk import DiskTier

    names = [n for n in ("item", "tolist", "__bool__", "__int__", "__float__", "__array__") if hasattr(mx.array, n)]
    real = {n: getattr(mx.array, n) for n in names}
    real_fns = {n: getattr(mx, n) for n in ("eval", "async_eval")}
    calls = []

    def allowed(fn):
        def run(self, *a, **k):
            boom = {n: getattr(mx.array, n) for n in names}, {n: getattr(mx, n) for n in real_fns}
            for n, f in real.items():
                setattr(mx.array, n, f)
            for n, f in real_fns.items():
                setattr(mx, n, f)
            try:
                calls.append(fn.__name__)
                return fn(self, *a, **k)
            finally:
                for n, f in boom[0].items():
                    setattr(mx.array, n, f)
                for n, f in boom[1].items():
                    setattr(mx, n, f)
        return run

    for name in ("flush", "read", "write"):
        monkeypatch.setattr(DiskTier, name, allowed(getattr(DiskTier, name)))
    cache = make_cache("h2o", small=True, recall="disk", recall_dir=str(tmp_path), recall_page=8)
    k = mx.random.normal((1, 2, 140, D), key=mx.random.key(1))
    q = mx.random.normal((1, 4, 140, D), key=mx.random.key(2))
    with forbid_host_sync(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        at = 0
        for s in [60, 9] + [1] * 40 + [12, 1]:  # decode evicts (h2o) between the prompt and the follow-up
            n_before = len(calls)
            cache.update_and_fetch(k[:, :, at:at + s], k[:, :, at:at + s])
            cache.observe_queries(q[:, :, at:at + s])
            if 70 < at < 110:
                assert len(calls) == n_before  # decode steps never write or read the file
            at += s
    assert cache.evictions >= 3 and cache.cold.recalls == 1
    assert calls.count("read") == 1 and "write" in calls
    assert_nothing_lost(cache)


@pytest.mark.parametrize("tier", TIERS)
def test_a_deep_copy_recalls_without_touching_the_original(tier, tmp_path):
    cache, _, _ = _needle_run(tier, tmp_path)
    before = cold_positions(cache)
    twin = copy.deepcopy(cache)  # what mlx-lm's prompt-cache reuse does
    k = mx.random.normal((1, 2, 12, D), key=mx.random.key(5))
    q = mx.random.normal((1, 4, 12, D), key=mx.random.key(6))
    for a, b in ((0, 1), (1, 2), (2, 11), (11, 12)):  # decode, then one more follow-up on the copy
        twin.update_and_fetch(k[:, :, a:b], k[:, :, a:b])
        twin.observe_queries(q[:, :, a:b])
    assert twin.cold.recalls == cache.cold.recalls + 1
    after = cold_positions(cache)
    assert all(np.array_equal(x, y) for bx, by in zip(before, after) for x, y in zip(bx, by))
    assert_nothing_lost(cache)
    assert_nothing_lost(twin)


@pytest.mark.parametrize("tier", TIERS)
def test_quantized_hot_rows_recall_at_the_inputs_end(tier, model, tmp_path):
    kw = {"recall_dir": str(tmp_path)} if tier == "disk" else {}
    cfg = small_config("snapkv", recall=tier, recall_page=8, kv_bits=4, kv_group_size=32, **kw)
    caches = KVCacheBuilder.for_model(model, cfg)
    greedy(model, random_prompt(90, seed=4), max_tokens=4, prompt_cache=caches)
    for c in caches:
        c.continue_on_purpose()
    tokens, lp = greedy(model, random_prompt(20, seed=5), max_tokens=4, prompt_cache=caches)
    assert len(tokens) == 4 and np.isfinite(lp).all()
    for c in caches:
        assert c.cold.recalls == 1 and isinstance(c.keys, tuple)  # the hot rows stay packed
        assert c.size() <= c.budget + 4
        assert_nothing_lost(c)


# -- recall_hold: a turn's recalled rows stay through its answer -------------------------------------
def test_recall_hold_is_validated():
    with pytest.raises(ValueError, match="needs a cold tier"):
        KVCacheConfig("snapkv", recall_hold=True)
    with pytest.raises(TypeError, match="True or False"):
        KVCacheConfig("snapkv", recall="memory", recall_hold=1)
    with pytest.raises(ValueError, match="not supported by 'kvzip'"):
        KVCacheConfig("kvzip", recall="memory", recall_hold=True, allocation="uniform")
    cfg = KVCacheConfig("nexus", recall="memory", recall_hold=True, allocation="uniform")
    assert KVCacheConfig.from_dict(cfg.to_dict()).recall_hold and "recall_hold" not in KVCacheConfig(
        "nexus", recall="memory", allocation="uniform").to_dict()


def _recalled_positions(cache):
    from veloxquant_mlx.ops.recall import page_rows

    t = cache.cold  # the pages the last recall read back, and the positions their rows hold
    pos = np.array(t.read(t.holes, page_rows(t.holes, t.page))[2])
    return [set(row[row != 2**31 - 1].tolist()) for row in pos[0]]


@pytest.mark.parametrize("tier", TIERS)
def test_recall_hold_keeps_every_recalled_row_through_the_answer(tier, tmp_path):
    """The needle run with recall_hold: the follow-up's compression waits, so its answer attends to
    every row the recall read back (and to the needle); the next input compresses to the budget first,
    refilling the pages, and nothing is lost."""
    def run(hold):
        return _needle_run(tier, tmp_path / str(hold), hold=hold)

    plain, _, _ = run(False)
    held, _, _ = run(True)
    assert plain.size() == plain.budget and plain.cold.holes is None
    recalled = _recalled_positions(held)
    hot = hot_positions(held)[0]
    for h in range(2):  # every recalled row is hot, and the needle among them
        assert recalled[h] <= set(hot[h].tolist()) and NEEDLE in hot[h]
    assert held.cold.held and held.size() == held.budget + 3 + 2 * 8 + 7  # + answer, recalled pages, input
    seen = [set(np.concatenate([a, b]).tolist()) for a, b in zip(hot_positions(held)[0], cold_positions(held)[0])]
    assert all(s == set(range(held.offset)) for s in seen)  # nothing lost while holding
    rng = np.random.default_rng(3)
    k = mx.array(rng.normal(size=(1, 2, 5, D)).astype(np.float32)) * 0.1
    held.continue_on_purpose()
    held.update_and_fetch(k, k)  # the next input: the held compression runs first, then the new rows
    assert not held.cold.held and held.size() == held.budget + 5
    assert_nothing_lost(held)


def test_recall_hold_is_bounded_in_decode_by_the_slack(model):
    cfg = small_config("h2o", recall="memory", recall_page=8, recall_pages=2, recall_hold=True)
    caches = KVCacheBuilder.for_model(model, cfg)
    greedy(model, random_prompt(90, seed=4), max_tokens=2, prompt_cache=caches, prefill_step_size=32)
    for c in caches:
        c.continue_on_purpose()
    prompt = random_prompt(12, seed=5)
    tokens, _ = greedy(model, prompt, max_tokens=1, prompt_cache=caches)
    held = [c.size() for c in caches]
    assert all(c.cold.held and c.size() > c.budget for c in caches)
    greedy(model, [tokens[-1]], max_tokens=60, prompt_cache=caches)
    for c, h in zip(caches, held):  # decode past the slack: compressed back, pages refilled
        assert not c.cold.held and c.size() <= c.budget + c.slack
        assert c.evictions >= 2
        assert_nothing_lost(c)


def test_shared_index_gather_and_scatter_move_every_buffer_as_one_at_a_time():
    from veloxquant_mlx.caches.recall import put_rows_of
    from veloxquant_mlx.ops import gather_rows
    from veloxquant_mlx.ops.select import gather_rows_of

    rng = np.random.default_rng(3)
    B, H, N, k = 2, 3, 17, 5
    bufs = [mx.array(rng.normal(size=(B, H, N, 4)).astype(np.float32)), mx.array(rng.integers(0, 9, (B, H, N)).astype(np.int32)),
            mx.array(rng.integers(0, 2**31, (B, H, N, 2)).astype(np.uint32))]
    idx = mx.array(np.stack([[rng.choice(N, k, replace=False) for _ in range(H)] for _ in range(B)]).astype(np.int32))
    for got, b in zip(gather_rows_of(bufs, idx), bufs, strict=True):
        want = np.take_along_axis(np.array(b), np.array(idx).reshape(B, H, k, *[1] * (b.ndim - 3)), axis=2)
        assert got.dtype == b.dtype and np.array_equal(np.array(got), want) and np.array_equal(np.array(gather_rows(b, idx)), want)
    rows = [mx.zeros((B, H, k, *b.shape[3:]), b.dtype) + 7 for b in bufs]
    for got, b in zip(put_rows_of(bufs, idx, rows), bufs, strict=True):
        want = np.array(b).copy()
        for bb in range(B):
            for h in range(H):
                want[bb, h, np.array(idx)[bb, h]] = 7
        assert np.array_equal(np.array(got), want)
    with pytest.raises(ValueError, match="one \\(B, H, rows\\)"):
        gather_rows_of([bufs[0], bufs[0][:, :, :9]], idx)
    with pytest.raises(ValueError, match="one \\(B, H, rows\\)"):
        put_rows_of([bufs[0], bufs[1][:1]], idx, rows[:2])


@pytest.mark.parametrize("rows,K", [(40, 25), (41, 25), (97, 60)])  # new row counts reuse the compiled graphs
def test_compiled_recall_composites_match_numpy(rows, K):
    from veloxquant_mlx.ops.recall import gather_evicted, join_in_order, pick_pages

    rng = np.random.default_rng(rows)
    B, H, D, M = 2, 3, 8, 16
    pos = np.sort(rng.choice(10 * rows, size=(B, H, rows), replace=True), axis=-1).astype(np.int32)
    keys = rng.normal(size=(B, H, rows, D)).astype(np.float32)
    kept = np.sort(np.stack([[rng.choice(rows, K, replace=False) for _ in range(H)] for _ in range(B)]), -1)
    gpos, (gk,) = gather_evicted(mx.array(kept.astype(np.int32)), mx.array(pos), [mx.array(keys)])
    for b in range(B):
        for h in range(H):
            gone = np.setdiff1d(np.arange(rows), kept[b, h])
            assert np.array_equal(np.array(gpos)[b, h], pos[b, h, gone])
            assert np.array_equal(np.array(gk)[b, h], keys[b, h, gone])
    cold_pos = rng.choice(10 * rows, size=(B, H, M)).astype(np.int32)
    cold = rng.normal(size=(B, H, M, D)).astype(np.float32)
    jpos, (jk,) = join_in_order(mx.array(pos), mx.array(cold_pos), [mx.array(keys)], [mx.array(cold)])
    both_pos, both = np.concatenate([pos, cold_pos], 2), np.concatenate([keys, cold], 2)
    order = np.argsort(both_pos, axis=-1, kind="stable")
    assert np.array_equal(np.array(jpos), np.take_along_axis(both_pos, order, -1))
    assert np.array_equal(np.sort(np.array(jk), axis=2), np.sort(np.take_along_axis(both, order[..., None], 2), axis=2))
    q = mx.array(rng.normal(size=(B, 2 * H, 4, D)).astype(np.float32))
    lo = mx.array(rng.normal(size=(B, H, rows // 4, D)).astype(np.float32))
    hi = lo + 1
    bound = np.array(quest_bounds(q, lo, hi))
    want = np.sort(np.argsort(-bound, axis=-1, kind="stable")[..., :5], -1)
    assert np.array_equal(np.array(pick_pages(q, lo, hi, 5)), want)


# -- a streamed prompt recalls at its end with its last queries ---------------------------------------
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("method", ["nexus", "morphkv"])
def test_streamed_prompt_recalls_what_its_question_needs_at_its_end(method, tier, tmp_path):
    """prompt_eviction="stream" with a cold tier: the chunks evict the needle row (their queries point
    away from it) into the cold tier; the prompt's last chunk (the question) points at it, so at the
    prompt's last token its queries recall the needle's page and the end compression keeps it. The disk
    tier writes at every chunk's eviction: nothing evicted waits in memory while the prompt streams."""
    kw = {"recall_dir": str(tmp_path)} if tier == "disk" else {}
    cache = make_cache(method, small=True, budget=48, recall=tier, recall_page=8, recall_pages=2,
                       prompt_eviction="stream", allocation="uniform", **kw)
    rng, (H, Hq, N), u, keys = needle_keys()
    values = keys * 2 + 1
    q = rng.normal(size=(1, Hq, N, D)).astype(np.float32) * 0.1
    q[..., :4] = -1.0  # the text's queries never attend to the needle
    q[:, :, -12:] = u * 4  # the question's do
    q = mx.array(q)
    pending = []
    for a in range(0, N - 1, 16):  # the prompt in chunks, then its last token alone
        b = min(a + 16, N - 1)
        cache.update_and_fetch(keys[:, :, a:b], values[:, :, a:b])
        cache.observe_queries(q[:, :, a:b])
        pending.append(len(getattr(cache.cold, "pending", ())))
    assert cache.evictions >= 2 and cache.cold.recalls == 0 and max(pending) == 0
    assert all(NEEDLE not in row for row in hot_positions(cache)[0])
    cache.update_and_fetch(keys[:, :, N - 1:], values[:, :, N - 1:])
    cache.observe_queries(q[:, :, N - 1:])
    assert cache.cold.recalls == 1 and all(NEEDLE in row for row in hot_positions(cache)[0])
    assert cache.size() <= cache.budget + cache.slack
    assert_nothing_lost(cache)
