"""Prompt-cache save/load: exact round trip, identical continuation, clear errors."""

import copy
import json
from pathlib import Path

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


def _saved(tmp_path, model=None, name="c.safetensors", **cfg):
    model = model or make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=24, **cfg))
    _run(model, caches, random_prompt(30))
    path = tmp_path / name
    save_prompt_cache(path, caches, metadata={"note": "hi"}, model=model)
    return path, caches


def _flip_data_byte(path, at=5):
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # safetensors: u64 header length, header, tensor data
    data[start + at] ^= 0x01
    path.write_bytes(bytes(data))


def test_file_says_what_it_holds(tmp_path):
    path, _ = _saved(tmp_path)
    _, header = mx.load(str(path), return_metadata=True)
    what = json.loads(header["contents"])
    assert (what["method"], what["budget"], what["n_sink"], what["kv_bits"], what["tokens"]) == \
        ("streaming", 24, 4, None, 30)
    assert what["options"] == {"evict_every": 32} and what["layers"] == 2
    assert what["model"]["model_type"] == "llama" and len(what["model"]["sha256"]) == 16
    import hashlib

    arrays = mx.load(str(path))
    h = hashlib.sha256()
    for name in sorted(arrays):  # the checksum is reproducible from the file alone
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(bytes(memoryview(a)))
    assert header["checksum"] == h.hexdigest()


def test_corrupted_tensor_data_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    load_prompt_cache(path)
    for at in (0, 37, 401):
        p, _ = _saved(tmp_path, name=f"bad{at}.safetensors")
        _flip_data_byte(p, at)
        with pytest.raises(ValueError, match="checksum"):
            load_prompt_cache(p)


def test_file_for_another_model_is_refused(tmp_path):
    path, _ = _saved(tmp_path)
    load_prompt_cache(path, model=make_tiny_model("llama", seed=5))  # same architecture and config: fine
    for other in (make_tiny_model("llama", layers=3), make_tiny_model("qwen3"),
                  make_tiny_model("llama", max_position_embeddings=512)):
        with pytest.raises(ValueError, match="another model"):
            load_prompt_cache(path, model=other)
    load_prompt_cache(path)  # no model given: nothing to compare


def test_file_from_before_checksums_loads_with_a_warning(tmp_path):
    path, caches = _saved(tmp_path)
    arrays, header = mx.load(str(path), return_metadata=True)
    old = tmp_path / "old.safetensors"
    mx.save_safetensors(str(old), arrays, {k: header[k] for k in ("format", "layers", "user")})
    with pytest.warns(UserWarning, match="written before checksums"):
        loaded = load_prompt_cache(old, model=make_tiny_model("llama"))
    assert all(mx.array_equal(a.state["keys"], b.state["keys"]) for a, b in zip(caches, loaded))


def test_save_is_all_or_nothing(tmp_path, monkeypatch):
    path, _ = _saved(tmp_path)
    before = path.read_bytes()
    real = mx.save_safetensors

    def dies_halfway(file, arrays, metadata=None):
        real(file, arrays, metadata)
        with open(file, "r+b") as f:
            f.truncate(100)
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        _saved(tmp_path)
    assert path.read_bytes() == before  # the old file is intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # and no temporary is left


def test_any_file_name_is_written_and_read_as_named(tmp_path):
    path, caches = _saved(tmp_path, name="doc.cache")  # mlx would append ".safetensors" to this name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.cache"]
    assert load_prompt_cache(path)[0].offset == caches[0].offset


def _fresh_process(model):
    """The model as a new process sees it: no query tap (the tap patches the model's modules)."""
    from veloxquant_mlx.tap import query_tap_installed, remove_query_tap

    remove_query_tap(model)
    assert not query_tap_installed(model)


@pytest.mark.parametrize("spec", [dict(method="nestedkv"),  # ragged heads: padding needs the tap's mask
                                  dict(method="snapkv", recall="disk", recall_page=8, recall_pages=2, recent=4)])
@pytest.mark.filterwarnings("ignore:.*receives a new prompt")  # the follow-up continues on purpose
def test_a_loaded_cache_needs_its_tap_and_load_with_model_attaches_it(tmp_path, spec):
    model = make_tiny_model()
    a = KVCacheBuilder.for_model(model, KVCacheConfig(budget=16, **spec))
    logits = _run(model, a, random_prompt(60, seed=2))
    _decode(model, a, int(mx.argmax(logits, axis=-1).item()), 2)
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, a, model=model)
    follow = random_prompt(12, seed=3)
    cont = copy.deepcopy(a)  # continued apart from the saved caches (a disk tier's file is copied too)
    want = _run(model, cont, follow)
    want_tokens = [t for t, _ in _decode(model, cont, int(mx.argmax(want, axis=-1).item()), 6)]

    _fresh_process(model)
    from veloxquant_mlx.prompt_cache import load_prompt_cache as read_only
    raw = read_only(path, model=model)  # the file alone: the model still lacks the tap
    with pytest.raises(RuntimeError, match="expects the query tap"):
        _run(model, raw, follow, chunk=6)

    _fresh_process(model)
    b = load_prompt_cache(path, model=model)  # veloxquant_mlx's: attached to the model
    got = _run(model, b, follow)
    assert mx.array_equal(got, want)
    assert [t for t, _ in _decode(model, b, int(mx.argmax(got, axis=-1).item()), 6)] == want_tokens
    if spec.get("recall"):
        assert b[0].cold.recalls == cont[0].cold.recalls >= 1  # the follow-up recalled in both


def test_attach_refuses_tapped_caches_on_a_model_without_the_tap_call(tmp_path, monkeypatch):
    model = make_tiny_model()
    a = KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", budget=16, recent=4))
    import veloxquant_mlx.builder as builder

    monkeypatch.setattr(builder, "install_query_tap", lambda m: [])  # a model that never calls the tap's name
    with pytest.raises(ValueError, match="built with the query tap"):
        KVCacheBuilder.attach(model, a)


# Files saved by the package at c5c66a7 (a cache of one class per method), with the tokens the saved caches
# went on to decode there: today's code loads them and decodes the same tokens. Written by
#   PYTHONPATH=<that package>:tests python -c "from test_save_load import write_saved_before as w; w()"
SAVED_BEFORE = Path(__file__).resolve().parent / "data" / "saved_c5c66a7"
SAVED_METHODS = {"streaming": {"streaming_evict_every": 4}, "snapkv": {"snapkv_window": 8},
                 "h2o": {"h2o_evict_every": 4}, "nestedkv": {"nestedkv_window": 8}}


def write_saved_before(folder=SAVED_BEFORE):
    folder.mkdir(parents=True, exist_ok=True)
    expected = {}
    for method, extra in SAVED_METHODS.items():
        model, caches = _saved_run_of({"method": method, **extra})
        save_prompt_cache(folder / f"{method}.safetensors", caches, model=model)
        expected[method] = [t for t, _ in _decode(model, caches, 7, 12)]
        KVCacheBuilder.uninstall(model)
    (folder / "continued.json").write_text(json.dumps(expected, indent=1) + "\n")


@pytest.mark.parametrize("method", sorted(SAVED_METHODS))
def test_files_saved_before_the_light_step_load_and_continue_alike(method):
    model = make_tiny_model()
    caches = load_prompt_cache(SAVED_BEFORE / f"{method}.safetensors", model=model)
    expected = json.loads((SAVED_BEFORE / "continued.json").read_text())[method]
    assert [t for t, _ in _decode(model, caches, 7, 12)] == expected
    KVCacheBuilder.uninstall(model)


# Files saved by every method at 9cc861f (methods as subclasses of the cache), with the tokens they
# decoded there: today's code loads them and decodes the same tokens. kvzap's scorer lies beside them (the
# saved path is relative: the test runs in that folder). Written by
#   cd tests && PYTHONPATH=<that package>:. python -c "from test_save_load import write_saved_9cc861f as w; w()"
SAVED_9CC861F = Path(__file__).resolve().parent / "data" / "saved_9cc861f"
SAVED_RUNS = {
    "streaming": dict(method="streaming", streaming_evict_every=4),
    "random": dict(method="random", random_evict_every=4),
    "snapkv": dict(method="snapkv", snapkv_window=8),
    "snapkv_ada": dict(method="snapkv", snapkv_window=8, allocation="ada"),
    "pyramidkv": dict(method="pyramidkv", pyramidkv_window=8, pyramidkv_beta=2.0),
    "morphkv": dict(method="morphkv", morphkv_window=8, morphkv_evict_every=4),
    "morphkv_stream": dict(method="morphkv", morphkv_window=8, morphkv_evict_every=4, prompt_eviction="stream"),
    "h2o": dict(method="h2o", h2o_evict_every=4),
    "h2o_ada": dict(method="h2o", h2o_evict_every=4, allocation="ada"),
    "nestedkv": dict(method="nestedkv", nestedkv_window=8),
    "nexus": dict(method="nexus", nexus_block_size=4, nexus_window=4),
    "nexus_ada": dict(method="nexus", nexus_block_size=4, nexus_window=4, allocation="ada"),
    "kvzap": dict(method="kvzap", kvzap_layers="each", kvzap_evict_every=4, kvzap_scorer="kvzap_scorer.safetensors"),
    "kvzap_global": dict(method="kvzap", kvzap_layers="global", kvzap_evict_every=4,
                         kvzap_scorer="kvzap_scorer.safetensors"),
    "kvzip": dict(method="kvzip", kvzip_chunk=24, kvzip_window=8, kvzip_layers="each"),
    "kvzip_global": dict(method="kvzip", kvzip_chunk=24, kvzip_window=8, kvzip_layers="global"),
    "tova": dict(method="tova", tova_evict_every=4),
}


def _saved_run_of(spec):
    import warnings

    model = make_tiny_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kvzip's note that the tiny model has no tokenizer
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(budget=28, seed=3, **spec))
        logits = _run(model, caches, random_prompt(60))
        _decode(model, caches, int(mx.argmax(logits, axis=-1).item()), 5)
    mx.eval([c.state for c in caches])
    return model, caches


def write_saved_9cc861f(folder=SAVED_9CC861F):
    import os
    import shutil

    from conftest import fit_tiny_scorer

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(fit_tiny_scorer(make_tiny_model()), folder / "kvzap_scorer.safetensors")
    here = os.getcwd()
    os.chdir(folder)
    try:
        expected = {}
        for label, spec in SAVED_RUNS.items():
            model, caches = _saved_run_of(spec)
            save_prompt_cache(f"{label}.safetensors", caches, model=model)
            expected[label] = [t for t, _ in _decode(model, caches, 7, 12)]
            KVCacheBuilder.uninstall(model)
    finally:
        os.chdir(here)
    (folder / "continued.json").write_text(json.dumps(expected) + "\n")


@pytest.mark.parametrize("label", sorted(SAVED_RUNS))
def test_files_saved_before_the_composition_load_and_continue_alike(label, monkeypatch):
    monkeypatch.chdir(SAVED_9CC861F)  # kvzap's scorer is named relative to the folder
    model = make_tiny_model()
    caches = load_prompt_cache(f"{label}.safetensors", model=model)
    expected = json.loads((SAVED_9CC861F / "continued.json").read_text())[label]
    assert [t for t, _ in _decode(model, caches, 7, 12)] == expected
    KVCacheBuilder.uninstall(model)
