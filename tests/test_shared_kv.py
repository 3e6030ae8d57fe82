"""KV shared across layers: gemma4_text's small checkpoints end in layers that compute no keys or values and
read the rows an earlier layer (their source) returned from its cache this step. The source's eviction cache
evicts after its own attention; its sharers must read the same rows, with the mask that describes them
(ragged per-head storage hides padding there), and quantized rows through mlx-lm's quantized attention.
The table's rows (tests/mlx_lm_archs.py) check exactness with nothing evicted and eviction with real queries;
these check what each sharer's attention reads while the source evicts.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from conftest import fit_tiny_scorer, small_config
from mlx_lm_archs import build
from test_architectures import BUDGET, _run
from veloxquant_mlx import KVCacheBuilder, tap
from veloxquant_mlx.caches import PAD_POSITION


def _reference(q, keys, values, scale, positions, offset, bits=None, group_size=None):
    """Attention of queries ``q`` (B, Hq, S, D) at the last S positions before ``offset``, computed directly
    over the rows at ``positions`` (B, H_kv, rows) that are real and causally visible."""
    if bits is not None:
        keys, values = (mx.dequantize(*x, group_size=group_size, bits=bits) for x in (keys, values))
    S, group = q.shape[2], q.shape[1] // keys.shape[1]
    keys, values, positions = (mx.repeat(x, group, axis=1) for x in (keys, values, positions))
    q_pos = mx.arange(offset - S, offset)
    visible = (positions[:, :, None, :] <= q_pos[None, None, :, None]) & (positions[:, :, None, :] != PAD_POSITION)
    logits = (q * scale) @ keys.swapaxes(-1, -2)
    logits = mx.where(visible, logits, -mx.inf)
    return mx.softmax(logits, axis=-1, precise=True) @ values


@pytest.mark.parametrize("how", [{}, {"allocation": "ada"}, {"kv_bits": 8, "kv_group_size": 32}],
                         ids=["uniform", "ragged", "quantized"])
@pytest.mark.parametrize("name", ["gemma4_text", "gemma4"])
def test_sharers_attend_to_the_rows_their_source_returned(name, how, monkeypatch):
    """At every prefill chunk and decode step, each KV-shared layer's attention equals attention computed
    directly over the rows its source's eviction cache returned for that step (real rows only, causal),
    while the source evicts: uniform, ragged per-head (padding hidden by the source's mask) and quantized."""
    model = build(name)
    assert tap.kv_sources(model) == {2: 0, 3: 1}  # the table's gemma4: [sliding, full] then their sharers
    for layer in model.layers:  # soft attention (its logits are unscaled dot products of unit-RMS vectors), so
        layer.self_attn.q_norm.weight = layer.self_attn.q_norm.weight * 0.2  # every row read, padding too, counts
    original, calls = tap._ORIGINAL_SDPA, []

    def spy(queries, keys, values, cache=None, scale=None, mask=None, **kwargs):
        out = original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        if isinstance(cache, tap.SharedRows):
            src = cache.source
            calls.append((out, _reference(queries, keys, values, scale, src.fetched.positions, src.offset,
                                          getattr(cache, "bits", None), getattr(cache, "group_size", None)),
                          src.fetched.positions.shape[-1] < src.offset, src.fetched.ragged))
        return out

    caches = KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET, **how))
    monkeypatch.setattr(tap, "_ORIGINAL_SDPA", spy)  # after the tap is installed (it rebinds the original)
    source = caches[1]
    _run(model, caches)
    assert source.evictions > 0 and calls, "the source did not evict, or no sharer read its rows"
    assert any(evicted for _, _, evicted, _ in calls), "no sharer read rows after an eviction"
    if how.get("allocation") == "ada":
        assert any(ragged for *_, ragged in calls), "no sharer read ragged rows (padding to hide)"
    tol = 1e-3 if how.get("kv_bits") else 1e-5
    for i, (out, ref, _, _) in enumerate(calls):
        np.testing.assert_allclose(np.array(out), np.array(ref), rtol=tol, atol=tol, err_msg=f"sharer call {i}")


def test_sharers_read_mlx_lm_caches_as_before():
    """With mlx-lm's own caches (no eviction cache to name) the link changes nothing: the sharers get no cache."""
    model = build("gemma4_text")
    reference = _run(model, make_prompt_cache(model))
    KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET))  # installs the tap and the link
    assert tap.install_shared_rows(model) == 4
    again = _run(model, make_prompt_cache(model))
    assert again[0] == reference[0]
    np.testing.assert_array_equal(again[1], reference[1])
    KVCacheBuilder.uninstall(model)
    assert not any(getattr(type(layer), "__veloxquant_sharing__", False) for layer in model.layers)


@pytest.mark.parametrize("method", ["streaming", "h2o", "nexus", "nestedkv", "kvzip", "kvzap", "pyramidkv"])
def test_every_kind_of_method_evicts_under_shared_kv(method):
    """Methods that score with queries, accumulate attention, keep ragged heads, run a model pass or read
    hidden states all run on a KV-shared model and evict in its source layer."""
    model = build("gemma4_text")
    if method == "kvzap":
        fit_tiny_scorer(model)  # its fitted scorer (the fit runs through the shared layers too)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        caches = KVCacheBuilder.for_model(model, small_config(method, budget=24 if method == "pyramidkv" else BUDGET))
    toks, logits = _run(model, caches)
    assert len(toks) == 4 and np.isfinite(logits).all()
    assert caches[1].evictions > 0


@pytest.mark.parametrize("name", ["gemma3n", "afm7"])
def test_layers_reading_another_layers_cache_stay_refused(name):
    """gemma3n's and afm7's shared layers read a cache's stored rows themselves (``keys_and_values``), not the
    rows a step returned: an eviction would change them behind the attention's back."""
    with pytest.raises(ValueError, match="read another layer's cache") as err:
        KVCacheBuilder.for_model(build(name), small_config("snapkv", budget=BUDGET))
    assert "\n" not in str(err.value)


def test_a_batch_equals_each_prompt_alone_under_shared_kv():
    """batch_generate on a KV-shared model: the sharers read the batch cache's rows with its per-row,
    per-head mask (ragged Ada-KV rows of prompts of different lengths), so each row generates exactly what
    its prompt generates alone and keeps the same rows."""
    from test_batching import PROMPTS, alone, batched, cfg, same_cache

    model = build("gemma4_text")
    for layer in model.layers:  # soft attention, as above
        layer.self_attn.q_norm.weight = layer.self_attn.q_norm.weight * 0.2
    config = cfg("snapkv", allocation="ada")
    ref = [alone(model, config, p, 9) for p in PROMPTS]
    out = batched(model, config, PROMPTS, 9)
    assert any(c.is_ragged for _, _, caches in ref for c in caches if hasattr(c, "is_ragged"))
    for (tokens, _, caches), got, got_caches in zip(ref, out.token_ids, out.caches):
        assert got == tokens
        assert same_cache(caches[1], got_caches[1])  # layer 1: the full-attention source


def test_attach_links_the_shared_layers_again():
    """Caches made ready on a model that lost its tap (a loaded file, ``attach``) get the link back."""
    model = build("gemma4_text")
    caches = KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET))
    KVCacheBuilder.uninstall(model)
    assert not any(getattr(type(layer), "__veloxquant_sharing__", False) for layer in model.layers)
    KVCacheBuilder.attach(model, caches)
    assert all(getattr(type(layer), "__veloxquant_sharing__", False) for layer in model.layers)


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4"])
def test_kvzips_pass_over_a_paged_prompt_reaches_the_shared_layers(name, tmp_path):
    """KVzip's reconstruction pass over a paged prompt on a KV-shared model keeps "end"'s rows and gives its
    tokens. (The sharers attend to their source's rows from its file during the pass; in these models they are
    the last layers, so no score depends on their output, and this test cannot see it.)"""
    model = build(name)
    out = {}
    for policy in ("end", "offload"):
        extra = {"page_dir": str(tmp_path)} if policy == "offload" else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches = KVCacheBuilder.for_model(model, small_config("kvzip", budget=BUDGET, prompt_eviction=policy,
                                                                  **extra))
            out[policy] = _run(model, caches), [np.array(c.kept_positions()) for c in caches
                                                if hasattr(c, "kept_positions")]
        assert caches[1].evictions > 0
    (ref, kept_ref), (got, kept) = out["end"], out["offload"]
    assert got[0] == ref[0]
    assert np.abs(got[1] - ref[1]).max() <= 1e-3
    assert all(np.array_equal(a, b) for a, b in zip(kept_ref, kept))
