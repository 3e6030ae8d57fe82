"""The eval harness's quantized rows: group-size labels and the shared quantized prefill pass."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache

from veloxquant_mlx.evaluation import results as R
from veloxquant_mlx.evaluation.retrieval import shared_prefill_generate
from veloxquant_mlx.evaluation.speed import greedy_generate

from test_quantized import make_model


def test_group_size_labels():
    q, f8, f8g = R.method_specs(["nexus-4bit-g32", "full-8bit", "full-8bit-g32"])
    assert (q.method, q.quant) == ("nexus", (4, 32))
    assert (f8.method, f8.quant, f8g.quant) == (None, (8, 64), (8, 32))
    model = make_model()
    assert all(isinstance(c, QuantizedKVCache) and (c.bits, c.group_size) == (8, 32)
               for c in R.make_caches(model, f8g, budget=0))
    assert all((c.config.kv_bits, c.config.kv_group_size) == (4, 32) for c in R.make_caches(model, q, budget=128))
    assert R.method_specs(["nexus"])[0].quant == (None, 64)


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32)])
def test_shared_quantized_prefill_equals_lone_runs(bits, group):
    """One quantized pass per prompt for every quantized method gives each method's lone-run tokens
    and bytes, and the pass's own cache is mlx-lm's QuantizedKVCache run alone."""
    model = make_model()
    toks = [int(t) for t in mx.random.randint(0, 128, (500,), key=mx.random.key(3)).tolist()]
    suffix = f"-{bits}bit" + ("" if group == 64 else f"-g{group}")
    specs = R.method_specs([m + suffix for m in ("full", "nexus", "nestedkv", "snapkv", "h2o")])
    named = {s.name: R.make_caches(model, s, 150) for s in specs if s.method}
    out = shared_prefill_generate(model, toks, named, 6, kv_bits=bits, kv_group_size=group)
    for s in specs:
        alone = greedy_generate(model, toks, R.make_caches(model, s, 150), 6, 2048)
        got = out["__full__" if s.method is None else s.name]
        assert got["tokens"] == alone["tokens"], s.name
        assert got["kv_bytes_end"] == alone["kv_bytes_end"], s.name
    # Eviction ran and the stored rows are quantized.
    caches = named[specs[1].name]
    assert caches[0].evictions >= 1 and caches[0].bits == bits
    # The opt-in dequantized pass reads float attention (no bits on the fan-out layer).
    fast = shared_prefill_generate(model, toks, {}, 6, kv_bits=bits, kv_group_size=group, dequantized_prefill=True)
    assert len(fast["__full__"]["tokens"]) == 6
    # The fp pass differs: the quantized rows change the tokens on this random model.
    fp = shared_prefill_generate(model, toks, {}, 6)
    assert fp["__full__"]["tokens"] != out["__full__"]["tokens"] or bits == 8


def test_fan_out_takes_mlx_lms_quantized_attention_unless_dequantized():
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.evaluation.retrieval import FanOutCache

    q = QuantizedKVCache(group_size=32, bits=4)
    assert (FanOutCache(q, {}).bits, FanOutCache(q, {}).group_size) == (4, 32)
    assert not hasattr(FanOutCache(q, {}, dequantize=True), "bits")
    assert not hasattr(FanOutCache(KVCache(), {}), "bits")
    k = mx.random.normal((1, 2, 5, 64))
    out = FanOutCache(QuantizedKVCache(group_size=64, bits=8), {}, dequantize=True).update_and_fetch(k, k)[0]
    assert out.shape == k.shape and float(mx.abs(out - k).max()) < 0.05


def test_tasks_harness_runs_quantized_labels_alone():
    """eval tasks' shared pass attends over fp rows: a quantized label must take its own prefill."""
    from veloxquant_mlx.evaluation.task_eval import needs_own_prefill

    q4, f8, fp = R.method_specs(["nexus-4bit", "full-8bit", "nexus"])
    assert needs_own_prefill(q4) and needs_own_prefill(f8)
    assert not needs_own_prefill(fp)
