"""Prompt-cache save/load: exact round trip, identical continuation, clear errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache

from conftest import make_tiny_model, random_prompt


def _run(model, caches, tokens, chunk=16):
    logits = None
    for i in range(0, len(tokens), chunk):
        logits = model(mx.array([tokens[i:i + chunk]]), cache=caches)[:, -1]
    return logits


def _decode(model, caches, first, n):
    out, tok = [], first
    for _ in range(n):
        logits = model(mx.array([[tok]]), cache=caches)[:, -1]
        tok = int(mx.argmax(logits, axis=-1).item())
        out.append((tok, np.array(logits)))
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_load_continue_equals_uninterrupted(tmp_path, arch):
    model = make_tiny_model(arch)
    cfg = KVCacheConfig(method="streaming", budget=24, streaming_evict_every=4)
    prompt = random_prompt(60)
    a = KVCacheBuilder.for_model(model, cfg)
    logits = _run(model, a, prompt)
    first = int(mx.argmax(logits, axis=-1).item())
    _decode(model, a, first, 3)
    mx.eval([c.state for c in a])
    path = tmp_path / "cache.safetensors"
    save_prompt_cache(path, a, metadata={"note": "hi"})
    b, meta = load_prompt_cache(path, return_metadata=True)
    assert meta == {"note": "hi"}
    for x, y in zip(a, b):
        assert type(x) is type(y)
        assert (x.offset, x.size(), x.evictions, x.config) == (y.offset, y.size(), y.evictions, y.config)
        for name in x.state:
            assert mx.array_equal(x.state[name], y.state[name]), name
    cont_a = _decode(model, a, 7, 12)
    cont_b = _decode(model, b, 7, 12)
    assert [t for t, _ in cont_a] == [t for t, _ in cont_b]
    assert max(np.abs(la - lb).max() for (_, la), (_, lb) in zip(cont_a, cont_b)) == 0
    assert a[0].evictions > 1


def test_mixed_cache_types_round_trip(tmp_path):
    k = mx.random.normal((1, 2, 5, 8))
    plain, rot = KVCache(), RotatingKVCache(max_size=4)
    plain.update_and_fetch(k, k)
    rot.update_and_fetch(k, k)
    path = tmp_path / "mixed.safetensors"
    save_prompt_cache(path, [plain, rot])
    p2, r2 = load_prompt_cache(path)
    assert type(p2) is KVCache and type(r2) is RotatingKVCache
    assert p2.offset == 5 and mx.array_equal(p2.state[0], plain.state[0])
    assert (r2.offset, r2.max_size, r2.keep) == (5, 4, 0)


def test_corrupted_and_foreign_files_raise(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="cannot read"):
        load_prompt_cache(bad)
    foreign = tmp_path / "foreign.safetensors"
    mx.save_safetensors(str(foreign), {"x": mx.zeros(2)}, {"format": "something-else"})
    with pytest.raises(ValueError, match="not a veloxquant prompt cache"):
        load_prompt_cache(foreign)


def test_mismatched_metadata_raises(tmp_path):
    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=24))
    _run(model, caches, random_prompt(30))
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches)
    arrays, header = mx.load(str(path), return_metadata=True)
    layers = json.loads(header["layers"])
    meta = json.loads(layers[0]["meta_state"])
    meta["rows"] += 3  # arrays no longer match the metadata
    layers[0]["meta_state"] = json.dumps(meta)
    header["layers"] = json.dumps(layers)
    mx.save_safetensors(str(path), arrays, header)
    with pytest.raises(ValueError, match="rows"):
        load_prompt_cache(path)
    del arrays["0.positions"]
    mx.save_safetensors(str(path), arrays, header)
    with pytest.raises(ValueError, match="missing"):
        load_prompt_cache(path)
