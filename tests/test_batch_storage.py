"""Batch-native serving storage (caches.batch_storage): one key/value buffer per layer for the batch.

1. Continuous batching equals running alone for every registered method (and its quantized and
   Ada-KV variants where the method supports them), with rows of different lengths joining mid-run,
   leaving at different steps, evicting at different times, and one row decoding long enough for the
   batch buffer to be compacted.
2. A decode step copies no key/value rows: the number of copies of 4-D (key/value) arrays made by
   ``update_and_fetch`` does not grow with the batch size (allocations counted, not time).
"""

import contextlib

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from veloxquant_mlx import EvictionCache, KVCacheBuilder, methods
from veloxquant_mlx.caches import batch_storage
from veloxquant_mlx.caches.batch import HEADROOM, BatchEvictionCache
from veloxquant_mlx.registry import get_method

from conftest import make_tiny_model, random_prompt, small_config
from test_batching import STEP, alone, same_cache

METHODS = sorted(methods())


def variants():
    """(method, extra config) for every method; then 4-bit rows and Ada-KV where the method has them
    (those run with --run-slow: tests/test_quantized.py and test_batching.py batch them by default)."""
    out = [(m, {}) for m in METHODS]
    out += [pytest.param(m, {"kv_bits": 4, "kv_group_size": 32}, marks=pytest.mark.slow) for m in METHODS
            if get_method(m).supports_kv_bits]
    out += [pytest.param(m, {"allocation": "ada"}, marks=pytest.mark.slow) for m in METHODS
            if get_method(m).supports_allocation("ada")]
    return out


def _plain(v):
    return v.values if hasattr(v, "values") else v


def _id(v):
    method, kw = _plain(v)
    return method + "".join(f"-{k}={x}" for k, x in kw.items() if k != "kv_group_size")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", head_dim=32)  # quantized rows need whole groups of 32


@contextlib.contextmanager
def counting(*names):
    """Count calls of BatchRows methods (which storage paths a run took)."""
    calls = dict.fromkeys(names, 0)
    saved = {n: getattr(batch_storage.BatchRows, n) for n in names}

    def wrap(name, fn):
        def inner(self, *a, **k):
            calls[name] += 1
            return fn(self, *a, **k)
        return inner

    for n, fn in saved.items():
        setattr(batch_storage.BatchRows, n, wrap(n, fn))
    try:
        yield calls
    finally:
        for n, fn in saved.items():
            setattr(batch_storage.BatchRows, n, fn)


# prompt, max_tokens, decode step at which it joins (None: at the start)
ARRIVALS = [(random_prompt(61, seed=1), HEADROOM + 40, None),  # decodes past a compaction of the buffer
            (random_prompt(30, seed=2), 6, None),               # leaves early
            (random_prompt(83, seed=3), 20, 3),                 # joins while the others decode
            (random_prompt(45, seed=4), 9, 11)]                 # joins after one left


@pytest.mark.parametrize("method, kw", variants(), ids=lambda x: x if isinstance(x, str) else _id(("", x))[1:] or "plain")
def test_continuous_batching_equals_alone(model, method, kw):
    config = small_config(method, budget=24, prompt_eviction="stream", **kw)
    KVCacheBuilder.install(model, config)
    try:
        with counting("append_all", "put_row", "compact", "filter", "extend") as calls:
            gen = BatchGenerator(model, prefill_step_size=STEP)
            first = [a for a in ARRIVALS if a[2] is None]
            uids = list(gen.insert([p for p, _, _ in first], [m for _, m, _ in first]))
            out, caches, step = {u: [] for u in uids}, {}, 0
            while True:
                for prompt, m, at in ARRIVALS:
                    if at == step:
                        (u,) = gen.insert([prompt], [m])
                        uids.append(u)
                        out[u] = []
                responses = gen.next_generated()
                if not responses and step > max(a[2] or 0 for a in ARRIVALS):
                    break
                for r in responses:
                    out[r.uid].append(r.token)
                    if r.finish_reason is not None:
                        caches[r.uid] = r.prompt_cache
                step += 1
            gen.close()
    finally:
        KVCacheBuilder.uninstall(model)
    # the run took every storage path: decode writes, per-row eviction write-backs, a compaction,
    # rows leaving (filter) and joining (extend)
    assert all(calls[n] > 0 for n in ("append_all", "compact", "filter", "extend")), calls
    order = [a for a in ARRIVALS if a[2] is None] + [a for a in ARRIVALS if a[2] is not None]
    for uid, (prompt, m, _) in zip(uids, order):
        tokens, _, ref = alone(model, config, prompt, m)
        assert out[uid] == tokens
        assert all(same_cache(a, b) for a, b in zip(ref, caches[uid]))
        assert all(b.keys is not None and not b.store.external for b in caches[uid])  # a lone cache again
    if not config.method_class.prefill_only:
        assert calls["put_row"] > 0  # rows evicted during decode and wrote back their own slice


_COPIES = ("concatenate", "contiguous", "pad", "stack", "zeros", "zeros_like", "full", "take",
           "take_along_axis", "repeat", "tile", "broadcast_to")


@contextlib.contextmanager
def kv_copies():
    """Count the 4-D arrays (key/value rows: (B, H, rows, D) or their quantized parts) that MLX's
    allocating functions produce while the block runs. Positions and per-row scores are 3-D."""
    made = []
    saved = {n: getattr(mx, n) for n in _COPIES}

    def wrap(fn):
        def inner(*a, **k):
            out = fn(*a, **k)
            if isinstance(out, mx.array) and out.ndim == 4:
                made.append(tuple(out.shape))
            return out
        return inner

    for n, fn in saved.items():
        setattr(mx, n, wrap(fn))
    try:
        yield made
    finally:
        for n, fn in saved.items():
            setattr(mx, n, fn)


def decode_copies(method: str, B: int, steps: int = 40, **kw) -> list:
    """Per decode step, the key/value copies a B-row batch's update_and_fetch makes (rows of different
    lengths that evict at different times)."""
    config = small_config(method, budget=24, prompt_eviction="stream", **kw)
    rows = [EvictionCache(config, 0, 1) for _ in range(B)]
    for r in rows:
        r.tap_active = True
    batch = BatchEvictionCache.merge(rows)
    lengths = [40 + 7 * (i % 4) for i in range(B)]  # the widest row is the same for B = 2 and B = 8
    S = max(lengths)
    key = mx.random.key(0)
    k = mx.random.normal((B, 2, S + steps + 2, 32), key=key)
    batch.prepare(lengths=lengths, right_padding=[S - n for n in lengths])
    for lo in range(0, S, 16):
        chunk = k[:, :, lo:min(lo + 16, S)]
        batch.update_and_fetch(chunk, chunk)
        batch.observe_queries(mx.repeat(chunk, 2, axis=1), 0.25)
    batch.finalize()
    before = [r.evictions for r in batch.rows]
    per_step = []
    for t in range(steps + 2):
        x = k[:, :, S + t:S + t + 1]
        with kv_copies() as made:
            batch.update_and_fetch(x, x)
        batch.observe_queries(mx.repeat(x, 2, axis=1), 0.25)
        mx.eval([r.state for r in batch.rows])
        if t >= 2:  # after the prompt's end (one-shot compressions, first decode growth of each row)
            per_step.append(len(made))
    if not config.method_class.prefill_only:  # rows kept evicting (each at its own steps) while counted
        assert all(r.evictions > b + 1 for r, b in zip(batch.rows, before))
    return per_step


def copy_variants():
    """Every method, plus the first method's quantized and Ada-KV variants (other paths of the storage)."""
    quant = next(_plain(v) for v in variants() if "kv_bits" in _plain(v)[1])
    ada = next(_plain(v) for v in variants() if "allocation" in _plain(v)[1])
    return [(m, {}) for m in METHODS] + [quant, ada]


@pytest.mark.parametrize("variant", copy_variants(), ids=_id)
def test_decode_copies_do_not_grow_with_batch_size(variant):
    method, kw = variant
    small, large = decode_copies(method, 2, **kw), decode_copies(method, 8, **kw)
    assert sum(small) == sum(large), (small, large)
    # Only the buffer's compaction copies rows, once per HEADROOM decode steps at most, whatever B.
    busy = sum(1 for n in large if n)
    assert busy <= len(large) // HEADROOM + 1, large
