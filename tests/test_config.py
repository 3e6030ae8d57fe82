"""KVCacheConfig / registry: validation, flat keywords, errors."""

import dataclasses

import pytest

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, methods
from veloxquant_mlx.methods.streaming import StreamingLLM

from conftest import make_tiny_model


def test_defaults_and_method_options_attribute():
    c = KVCacheConfig(method="streaming", budget=64)
    assert (c.budget, c.n_sink, c.seed) == (64, 4, 0)
    assert c.streaming is c.options
    assert c.streaming.evict_every == 32
    assert c.method_class is StreamingLLM


def test_unknown_method_lists_known():
    with pytest.raises(ValueError, match="unknown method 'nope'.*streaming"):
        KVCacheConfig(method="nope")


def test_registry_lists_streaming_with_description():
    assert "streaming" in methods()
    assert "StreamingLLM" in KVCacheBuilder.methods()["streaming"]


@pytest.mark.parametrize("kwargs,exc,msg", [
    (dict(budget=8, n_sink=4, recent=4), ValueError, "must exceed n_sink \\+ recent"),
    (dict(budget=0), ValueError, "budget must be >= 1"),
    (dict(budget=-5), ValueError, "budget must be >= 1"),
    (dict(n_sink=-1), ValueError, "n_sink must be >= 0"),
    (dict(recent=-1), ValueError, "recent must be >= 0"),
    (dict(budget=64.0), TypeError, "budget must be an int"),
    (dict(budget=True), TypeError, "budget must be an int"),
    (dict(budget="64"), TypeError, "budget must be an int"),
    (dict(seed=1.5), TypeError, "seed must be an int"),
    (dict(head_dim=0), ValueError, "head_dim must be >= 1"),
    (dict(streaming_evict_every=0), ValueError, "evict_every must be >= 1"),
    (dict(streaming_evict_every=2.5), TypeError, "evict_every must be an int"),
    (dict(streaming_bogus=1), TypeError, "unknown option 'streaming_bogus'"),
    (dict(nexus_window=3), TypeError, "flat options must start with 'streaming_'"),
    (dict(options={"bogus": 1}), TypeError, "unknown option"),
    (dict(options=3), TypeError, "options for 'streaming' must be"),
    (dict(budget=64, streaming_budget=32), ValueError, "conflicts"),
])
def test_bad_inputs_raise_clear_errors(kwargs, exc, msg):
    with pytest.raises(exc, match=msg):
        KVCacheConfig(method="streaming", **kwargs)


def test_flat_keywords_map_onto_one_source_of_truth():
    flat = KVCacheConfig(method="streaming", head_dim=16, streaming_budget=96, streaming_n_sink=2,
                         streaming_recent=8, streaming_seed=3, streaming_evict_every=16)
    nested = KVCacheConfig(method="streaming", head_dim=16, budget=96, n_sink=2, recent=8, seed=3,
                           options={"evict_every": 16})
    assert flat == nested
    assert flat.budget == 96 and flat.streaming.evict_every == 16


def test_round_trip_dict_and_replace():
    c = KVCacheConfig(method="streaming", budget=80, seed=7)
    assert KVCacheConfig.from_dict(c.to_dict()) == c
    d = c.replace(budget=120)
    assert d.budget == 120 and d.seed == 7 and c.budget == 80


def test_options_are_dataclasses_with_metadata():
    for f in dataclasses.fields(StreamingLLM.Options):
        assert "kind" in f.metadata, f"{f.name} must be declared with option()"


def test_head_dim_mismatch_is_reported():
    import mlx.core as mx
    cache = EvictionCache(KVCacheConfig(method="streaming", budget=64, head_dim=32))
    with pytest.raises(ValueError, match="head_dim=32.*head_dim=16"):
        cache.update_and_fetch(mx.zeros((1, 2, 3, 16)), mx.zeros((1, 2, 3, 16)))


def test_for_model_rejects_non_config():
    with pytest.raises(TypeError, match="KVCacheConfig"):
        KVCacheBuilder.for_model(make_tiny_model(), {"method": "streaming"})


def test_kv_group_size_default_follows_the_bits():
    """4-bit rows default to groups of 32 (docs/quality.md: groups of 64 lose Nexus's passkey answers on
    SmolLM2 and Gemma 3, groups of 32 restore them); 8-bit and float rows keep 64."""
    assert KVCacheConfig(method="nexus", kv_bits=4).kv_group_size == 32
    assert KVCacheConfig(method="nexus", kv_bits=8).kv_group_size == 64
    assert KVCacheConfig(method="nexus").kv_group_size == 64
    assert KVCacheConfig(method="nexus", kv_bits=4, kv_group_size=64).kv_group_size == 64
    c = KVCacheConfig(method="nexus", kv_bits=4)
    assert KVCacheConfig.from_dict(c.to_dict()) == c and c.replace(kv_bits=8).kv_group_size == 32  # explicit now


def test_published_4bit_labels_keep_the_groups_they_ran_with():
    """Figures labelled ``<method>-4bit`` ran with groups of 64: the label pins them."""
    from veloxquant_mlx.evaluation.results import make_caches, method_specs

    q, g32, full = method_specs(["nexus-4bit", "nexus-4bit-g32", "full-4bit"])
    assert (q.quant, g32.quant, full.quant) == ((4, 64), (4, 32), (4, 64))
    model = make_tiny_model("llama", head_dim=64)
    assert {c.config.kv_group_size for c in make_caches(model, q, budget=128)} == {64}
