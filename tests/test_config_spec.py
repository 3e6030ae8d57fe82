"""The config grammar (config_spec): ``KVCacheConfig.parse(spec)`` and ``str(config)`` round-trip, and
bad input is refused with the key named."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from veloxquant_mlx.config import KV_BITS, KVCacheConfig, parse_full
from veloxquant_mlx.config_spec import CORE_FIELDS, parse_spec, valid_keys
from veloxquant_mlx.registry import get_method, methods

METHODS = sorted(methods())


def _values(meta: dict, default):
    """Values an option's metadata allows (free-text strings keep their default)."""
    kind, low, high = meta.get("kind"), meta.get("low"), meta.get("high")
    if meta.get("choices") is not None:
        s = st.sampled_from(list(meta["choices"]))
    elif kind is bool:
        s = st.booleans()
    elif kind is int:
        lo = 0 if low is None else int(low) + bool(meta.get("low_open"))
        s = st.integers(lo, lo + 4096 if high is None else int(high))
    elif kind is float:
        lo = -1e3 if low is None else float(low)
        s = st.floats(lo, lo + 1e3 if high is None else float(high), allow_nan=False, allow_infinity=False,
                      exclude_min=bool(meta.get("low_open")))
    elif kind is tuple and default is not None:
        s = st.tuples(*[st.floats(0.01, 10.0) for _ in default])
    else:
        s = st.just(default)
    return st.one_of(st.none(), s) if meta.get("allow_none") else s


@st.composite
def configs(draw):
    method = draw(st.sampled_from(METHODS))
    cls = get_method(method)
    options = {f.name: draw(_values(f.metadata, f.default)) for f in dataclasses.fields(cls.Options)
               if draw(st.booleans())}
    core = {"budget": draw(st.integers(256, 4096)), "seed": draw(st.integers(0, 99)),
            "n_sink": draw(st.integers(0, 8)), "prompt_eviction": draw(st.sampled_from(["end", "stream"])),
            "floor_alpha": draw(st.sampled_from([0.0, 0.2, 0.35])),
            "max_head_factor": draw(st.sampled_from([None, 1.0, 1.5, 2.0]))}
    if draw(st.booleans()):
        core["allocation"] = draw(st.sampled_from(["uniform", "ada"]))
    if draw(st.booleans()):
        core["kv_bits"] = draw(st.sampled_from(KV_BITS))
        if draw(st.booleans()):
            core["kv_group_size"] = draw(st.sampled_from([32, 64, 128]))
    if draw(st.booleans()):
        core["recent"] = draw(st.integers(0, 64))
    if draw(st.booleans()):
        core.update(recall="memory", recall_bits=draw(st.sampled_from([2, 4, 8])),
                    recall_page=draw(st.integers(1, 64)), recall_pages=draw(st.integers(1, 16)),
                    allocation="uniform")
    try:
        return KVCacheConfig(method=method, options=options, **core)
    except (ValueError, TypeError):  # a combination the method refuses
        assume(False)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(configs())
def test_str_round_trips(config):
    text = str(config)
    assert KVCacheConfig.parse(text) == config, text
    assert str(KVCacheConfig.parse(text)) == text  # the shortest form is canonical


@pytest.mark.parametrize("method", METHODS)
def test_defaults_are_the_bare_name(method):
    assert str(KVCacheConfig(method=method)) == method
    assert KVCacheConfig.parse(method) == KVCacheConfig(method=method)


def test_spec_sets_options_and_core_fields():
    c = KVCacheConfig.parse("nexus:window=8,kv_bits=4,allocation=ada,budget=256,n_samples=none")
    assert c == KVCacheConfig(method="nexus", budget=256, kv_bits=4, allocation="ada",
                              options={"window": 8, "n_samples": None})
    assert str(c) == "nexus:window=8,n_samples=none,budget=256,allocation=ada,kv_bits=4"
    p = KVCacheConfig.parse("nestedkv:prior=(0.5,0.3,0.2),cross_head=false")
    assert p.options.prior == (0.5, 0.3, 0.2) and p.options.cross_head is False
    # an option a core field shadows is written <method>.<name>; the bare key is the core field
    shadow = KVCacheConfig.parse("nestedkv:nestedkv.max_head_factor=2,max_head_factor=none")
    assert shadow.options.max_head_factor == 2.0 and shadow.max_head_factor is None
    assert KVCacheConfig.parse(str(shadow)) == shadow and "nestedkv.max_head_factor=2.0" in str(shadow)
    assert KVCacheConfig.parse("nexus:nexus.window=8") == KVCacheConfig.parse("nexus:window=8")


def test_budget_given_apart_must_agree_with_the_spec():
    assert KVCacheConfig.parse("snapkv", budget=128).budget == 128
    assert KVCacheConfig.parse("snapkv:budget=128", budget=128).budget == 128
    with pytest.raises(ValueError, match=r"budget is given twice with different values: 'snapkv:budget=64': 64 "
                                         r"and separately: 128"):
        KVCacheConfig.parse("snapkv:budget=64", budget=128)
    with pytest.raises(ValueError, match="window is given twice"):
        KVCacheConfig.parse("nexus:window=8,window=16")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        KVCacheConfig.parse("nexus", bogus=1)


def test_bad_key_lists_the_valid_ones():
    with pytest.raises(ValueError) as e:
        KVCacheConfig.parse("snapkv:n_samples=3")
    msg = str(e.value)
    assert "unknown key 'n_samples'" in msg
    assert msg.endswith("valid keys for snapkv: " + ", ".join(valid_keys("snapkv")))
    fields = [f.name for f in dataclasses.fields(get_method("snapkv").Options)]
    assert valid_keys("snapkv") == fields + list(CORE_FIELDS)
    with pytest.raises(ValueError, match="unknown method 'bogus'; known methods: "):
        KVCacheConfig.parse("bogus:window=1")
    with pytest.raises(ValueError, match=r"'window' is not key=value"):
        KVCacheConfig.parse("nexus:window")


@pytest.mark.parametrize("spec,msg", [
    ("nexus:window=abc", r"window=abc: expected an int, got 'abc'"),
    ("nexus:window=none", r"window=none: expected an int, got 'none'"),
    ("nexus:prompt_top_k=maybe", r"prompt_top_k=maybe: expected true or false"),
    ("nexus:floor_alpha=x", r"floor_alpha=x: expected a number"),
    ("nexus:kv_bits=3", r"kv_bits=3 is not supported"),  # typed by the grammar, checked by the config
    ("nexus:window=0", r"NexusOptions.window must be >= 1"),
    ("nexus:allocation=even", r"KVCacheConfig.allocation must be one of \['uniform', 'ada'\]"),
])
def test_bad_value_names_the_key(spec, msg):
    with pytest.raises(ValueError, match=msg):
        KVCacheConfig.parse(spec)


def test_full_takes_only_its_quantization():
    assert parse_full("full") == (None, 64)
    assert parse_full("full:kv_bits=4") == (4, 32)
    assert parse_full("full:kv_bits=8,kv_group_size=128") == (8, 128)
    with pytest.raises(ValueError, match="valid keys for full: kv_bits, kv_group_size"):
        parse_full("full:budget=64")
    with pytest.raises(ValueError, match=r"kv_bits=2 is not supported"):
        parse_full("full:kv_bits=2")
    with pytest.raises(ValueError, match="mlx-lm's own cache"):
        KVCacheConfig.parse("full")
    assert parse_spec("full:kv_bits=none") == ("full", {"kv_bits": None}, {})


def test_recall_dir_and_head_dim_round_trip(tmp_path):
    c = KVCacheConfig(method="snapkv", budget=128, recall="disk", recall_dir=str(tmp_path), head_dim=64,
                      recall_window=16)
    assert str(c) == f"snapkv:budget=128,head_dim=64,recall=disk,recall_dir={tmp_path},recall_window=16"
    assert KVCacheConfig.parse(str(c)) == c
