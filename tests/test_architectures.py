"""Every architecture file of the installed mlx-lm, built tiny (tests/mlx_lm_archs.py), gets one of three
statuses from the library, and the test checks the one the table expects (``EXPECT``):

- evicts: with a budget above the prompt, ``for_model``'s caches give exactly mlx-lm's greedy tokens and
  logits; with a small budget every eviction cache evicts, and the query-aware method saw real queries
  through the tap (or, ``keys as queries``, keys stood in with the one warning);
- refused: ``for_model`` raises one clear line before any prefill.

An architecture file missing from the table fails as ``unknown architecture``. ``--write-architectures``
writes docs/architectures.md from the results (tests/architectures_page.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from architectures_page import write as write_page
from conftest import small_config
from mlx_lm_archs import (ARCHS, EVICTS, KEYS_AS_QUERIES, REFUSED, VARIANTS, CannotRun, NoTinyConfig,
                          architecture_files, build)
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.caches import EvictionCache
from veloxquant_mlx.model_dims import model_dims
from veloxquant_mlx.tap import kv_sources

PROMPT, NEW, CHUNK = 40, 4, 16  # a prompt fed in chunks (mlx-lm's prefill), then greedy decode
BUDGET = 16  # evicting runs: well below the prompt
RESULTS: dict = {}  # name -> (status, detail), for the docs page


def _run(model, caches, prompt=None):
    """Greedy tokens and every step's logits, fed as mlx_lm.generate feeds them."""
    x = mx.array(prompt or np.random.default_rng(1).integers(1, 120, PROMPT).tolist())
    done = 0
    while x.shape[0] - done > 1:
        m = min(CHUNK, x.shape[0] - done - 1)
        model(x[None, done:done + m], cache=caches)
        mx.eval([c.state for c in caches])
        done += m
    ids, toks, logits = x[-1:], [], []
    for _ in range(NEW):
        out = model(ids[None], cache=caches)[0, -1].astype(mx.float32)
        ids = mx.argmax(out, keepdims=True)
        mx.eval(ids, out)
        toks.append(int(ids.item()))
        logits.append(np.array(out))
    return toks, np.stack(logits)


def _ours(caches) -> list:
    """The eviction caches among ``caches``, those inside a CacheList layer included."""
    flat = [x for c in caches for x in getattr(c, "caches", (c,))]
    return [c for c in flat if isinstance(c, EvictionCache)]


def _record(name, status, detail=""):
    RESULTS[name] = (status, detail)


@pytest.fixture(scope="module", autouse=True)
def _write_page(request):
    """``--write-architectures``: write docs/architectures.md from this run's results (every architecture ran)."""
    yield
    if request.config.getoption("--write-architectures"):
        missing = sorted(set(architecture_files()) - set(RESULTS))
        assert not missing, f"--write-architectures needs every architecture's test to run; missing {missing}"
        write_page({n: {"status": s, "detail": d} for n, (s, d) in RESULTS.items()})


@pytest.mark.parametrize("name", architecture_files())
def test_architecture(name):
    row = ARCHS.get(name)
    if row is None:
        _record(name, "unknown", "not in tests/mlx_lm_archs.py")
        pytest.fail(f"unknown architecture {name!r}: add it to tests/mlx_lm_archs.py's ARCHS")
    if isinstance(row, (CannotRun, NoTinyConfig)):
        _record(name, "not run" if isinstance(row, CannotRun) else "not tested", row.reason)
        pytest.skip(f"{name}: {row.reason}")
    try:
        _check(name, row[1])
    except BaseException as e:
        if not isinstance(e, pytest.skip.Exception):
            _record(name, "FAILS", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        raise


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variant(variant):
    name, extra, expected = VARIANTS[variant]
    _check(name, expected, extra, record=False)


def _check(name, expected, extra=None, record=True):
    assert expected in (EVICTS, KEYS_AS_QUERIES, REFUSED), (name, expected)
    model = build(name, extra=extra)
    if expected == REFUSED:
        with pytest.raises(ValueError) as err:
            KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET))
        line = str(err.value)
        assert line and "\n" not in line, f"{name}: the refusal is not one line: {line!r}"
        if record:
            _record(name, REFUSED, line)
        return

    reference = _run(model, make_prompt_cache(model))
    # Exact with nothing evicted: the budget holds the prompt and every new token.
    with warnings.catch_warnings(record=True) as caught:  # the no-tap warning comes once per model
        warnings.simplefilter("always")
        full = KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", budget=PROMPT + NEW + 64))
    no_tap = [str(w.message) for w in caught if "scaled_dot_product_attention" in str(w.message)]
    if expected == EVICTS:
        assert not no_tap, f"{name}: {no_tap}"
    else:
        assert no_tap, f"{name}: expected the one warning that keys stand in for queries"
    ours = _ours(full)
    assert ours, f"{name}: for_model built no eviction cache, and did not refuse"
    toks, logits = _run(model, full)
    assert toks == reference[0], f"{name}: greedy tokens differ from mlx-lm's caches with nothing evicted"
    np.testing.assert_array_equal(logits, reference[1], err_msg=f"{name}: logits differ with nothing evicted")
    assert all(c.evictions == 0 for c in ours)

    # Evicting: a query-free method and a query-aware one.
    for method in ("streaming", "snapkv"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            caches = KVCacheBuilder.for_model(model, small_config(method, budget=BUDGET))
        ours = _ours(caches)
        toks, _ = _run(model, caches)
        assert len(toks) == NEW
        assert all(c.evictions > 0 for c in ours), f"{name} {method}: a layer did not evict"
        assert all(c.size() <= BUDGET + c.slack for c in ours), f"{name} {method}: rows above the budget"
        if method == "snapkv":
            if expected == EVICTS:
                assert all(c.tap_active and not c.queries_from_keys and c.queries_observed > 0 for c in ours), \
                    f"{name}: the tap did not hand real queries to every eviction cache"
            else:
                assert all(c.queries_from_keys for c in ours), f"{name}: expected keys as queries"
    how = [f"{len(ours)} of {len(caches)} layers evict"]
    if expected == EVICTS:
        how.append(_paged_prompt(name, model))
    sharers = [j for j, i in kv_sources(model).items() if isinstance(caches[i], EvictionCache)]
    if sharers:
        how.append(f"{len(sharers)} KV-shared layer{'s read' if len(sharers) > 1 else ' reads'} the kept rows")
    if any(getattr(c, "latent_query", None) is not None for c in ours):
        how.append("MLA latents, scored with the absorbed query")
    if any(type(c).__name__ == "CacheList" for c in caches):
        how.append("the attention part of CacheList layers")
    if record:
        _record(name, expected, "; ".join(how))


def _paged_prompt(name, model) -> str:
    """prompt_eviction="offload" gives "end"'s tokens and logits (the prompt read exactly against the page
    file, then compressed as "end" does), or is refused in one line."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = _run(model, KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET)))
        try:
            got = _run(model, KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET,
                                                                           prompt_eviction="offload")))
        except ValueError as e:
            line = str(e)
            assert "offload" in line and "\n" not in line, f"{name}: the offload refusal is not one line: {line!r}"
            return "the paged prompt refused"
    assert got[0] == ref[0], f"{name}: offload's tokens differ from end's"
    assert np.abs(got[1] - ref[1]).max() <= 1e-3, f"{name}: offload's logits differ from end's"
    return "the paged prompt gives end's tokens"


@pytest.mark.parametrize("name", [n for n in architecture_files()
                                  if isinstance(ARCHS.get(n), tuple) and ARCHS[n][1] != REFUSED])
def test_model_dims_read_every_architecture(name):
    """The one reader of model dimensions (kvzap's identity, the CLI) gets this architecture's from its
    real config (nested text_config, other field names), matching the layers the model builds."""
    model = build(name)
    dims = model_dims(model)
    assert (dims.n_layers, dims.d_model, dims.n_heads) == (4, 64, 4), dims  # the table's TINY values
    assert dims.n_kv_heads in (1, 2, 4) and dims.head_dim in (16, 32, 64), dims


def test_mla_latent_query_scores_as_the_decompressed_keys():
    """MLA: the tap's latent-space query scores a latent row exactly as the prefill query scores the key
    decompressed from it (``q_nope . embed_q(latent)``), so methods rank the rows attention reads."""
    from veloxquant_mlx.tap import LatentQuery

    model = build("deepseek_v3")
    attn = model.layers[0].self_attn
    q_nope = mx.random.normal((1, attn.num_heads, 5, attn.qk_nope_head_dim))
    latent = mx.random.normal((1, 1, 7, attn.kv_lora_rank))
    to_rows = LatentQuery(attn)
    absorbed = to_rows(q_nope)
    assert absorbed.shape == (1, attn.num_heads, 5, attn.kv_lora_rank)
    to_rows.reads_latent = True  # a decode call (the tap sets it per call): the query is absorbed already
    assert to_rows(absorbed) is absorbed
    direct = q_nope @ attn.embed_q(latent, transpose=False).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(absorbed @ latent.swapaxes(-1, -2)), np.array(direct), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("variant", ["deepseek_v3-nope-eq-rank", "mistral4-nope-rope-eq-rank"])
def test_mla_scores_rows_as_each_attention_call_reads_them(variant, monkeypatch):
    """Where the prefill query is as wide as the latent, the query a method scores latent rows with still
    gives the logits that call of attention computes (over the query's no-rope part): ``q_nope`` against
    the decompressed keys at prefill, the absorbed query against the latent rows at decode."""
    from veloxquant_mlx import tap

    name, extra, _ = VARIANTS[variant]
    model = build(name, extra=extra)
    original, calls = tap._ORIGINAL_SDPA, []

    def spy(queries, keys, values, cache=None, **kwargs):
        to_rows = getattr(cache, "latent_query", None)
        if to_rows is not None:
            latent = cache.keys[:, :, :cache.size()]  # nothing is evicted: the rows this call reads
            width = keys.shape[-1] if keys is values else to_rows.nope
            calls.append((queries.shape[2], to_rows(queries) @ latent.swapaxes(-1, -2),
                          queries[..., :width] @ keys[..., :width].swapaxes(-1, -2)))
        return original(queries, keys, values, cache=cache, **kwargs)

    monkeypatch.setattr(tap, "_ORIGINAL_SDPA", spy)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", budget=PROMPT + NEW + 64))
    _run(model, caches)
    assert {s > 1 for s, _, _ in calls} == {True, False}, "expected prefill and decode calls"
    for s, scored, attended in calls:
        np.testing.assert_allclose(np.array(scored), np.array(attended), rtol=1e-3, atol=1e-4,
                                   err_msg=f"{variant}: a {'prefill' if s > 1 else 'decode'} call")


def test_mla_refuses_quantized_rows_in_one_line():
    model = build("deepseek_v3")
    with pytest.raises(ValueError, match="MLA latents") as err:
        KVCacheBuilder.for_model(model, KVCacheConfig("snapkv", budget=64, kv_bits=8, kv_group_size=32))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["exaone", "gpt2", "dbrx", "llama4", "gemma3", "qwen3_5", "mistral3"])
def test_kvzap_identity_reads_the_real_text_config(name):
    """kvzap's identity (what a fitted scorer is matched on) from configs that spell or nest their fields
    differently: num_layers, n_embd, d_model, text_config."""
    from veloxquant_mlx.methods.kvzap import model_identity

    ident = model_identity(build(name))
    assert (ident["n_layers"], ident["d_model"], ident["n_kv_heads"]) == (4, 64, 2), ident
    assert ident["architecture"] == name


def test_model_dims_refuse_in_one_line():
    class Bare:
        pass

    class Args:
        model_type, hidden_size = "odd", 64  # no layer count under any known name

    class NoLayers:
        args = Args()

    for model, words in ((Bare(), "no mlx-lm ModelArgs"), (NoLayers(), "cannot read the model's n_layers")):
        with pytest.raises(ValueError, match=words) as err:
            model_dims(model)
        assert "\n" not in str(err.value)


def test_cachelist_layers_refuse_saving_in_one_line(tmp_path):
    from veloxquant_mlx import save_prompt_cache

    model = build("falcon_h1")
    caches = KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET))
    model(mx.array([list(range(1, 20))]), cache=caches)
    with pytest.raises(ValueError, match="holds a CacheList") as err:
        save_prompt_cache(tmp_path / "c.safetensors", caches, model=model)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_linear"])
def test_mla_refuses_per_layer_budgets_in_one_line(name):
    """An MLA model folds one mask, built for layer 0's rows, into every layer's rotary logits: layers that
    keep different row counts (pyramidkv) would crash at the next multi-token input, so they are refused."""
    with pytest.raises(ValueError, match="per-layer budgets") as err:
        KVCacheBuilder.for_model(build(name), small_config("pyramidkv", budget=24))
    assert "\n" not in str(err.value)


@pytest.mark.filterwarnings("ignore:.*already holds")  # a follow-up continues the cache on purpose
@pytest.mark.parametrize("name", ["deepseek_v3", "mistral4", "falcon_h1"])
def test_a_follow_up_input_after_eviction_runs(name):
    """After the prompt was compressed, a second multi-token input (a follow-up turn) runs through MLA's
    folded masks and CacheList layers, and evicts again."""
    model = build(name)
    caches = KVCacheBuilder.for_model(model, small_config("snapkv", budget=BUDGET))
    _run(model, caches)
    first = [c.evictions for c in _ours(caches)]
    toks, _ = _run(model, caches, prompt=list(range(5, 45)))
    assert len(toks) == NEW and all(c.evictions > e for c, e in zip(_ours(caches), first))


@pytest.mark.parametrize("name", ["falcon_h1", "baichuan_m1"])
def test_model_pass_methods_refuse_cachelist_layers_in_one_line(name):
    """kvzip's pass at the prompt's end finds deferred work among the top-level layer caches: inside a
    CacheList it would never run (no eviction at all), so it is refused up front."""
    with pytest.raises(ValueError, match="CacheList") as err:
        KVCacheBuilder.for_model(build(name), small_config("kvzip", budget=BUDGET))
    assert "\n" not in str(err.value)


def test_every_model_file_is_an_architecture():
    """Every file of mlx_lm.models that names both ``Model`` and ``ModelArgs`` is tested, however it binds
    them: a dataclass ``ModelArgs`` without a base class (phixtral), a ``Model`` imported from another
    file (solar_open re-exports glm4_moe's)."""
    import re

    import mlx_lm.models as models

    found = set(architecture_files())
    assert {"phixtral", "solar_open"} <= found
    named = {p.stem for p in Path(models.__path__[0]).glob("*.py")
             if re.search(r"\bModel\b", p.read_text()) and re.search(r"\bModelArgs\b", p.read_text())}
    assert named - found == set()


def test_the_table_names_each_architecture_once():
    """A dict literal keeps the last of two rows silently: the table must name each architecture once."""
    import ast
    import collections

    import mlx_lm_archs

    tree = ast.parse(Path(mlx_lm_archs.__file__).read_text())
    (table,) = [n.value for n in tree.body if isinstance(n, ast.AnnAssign) and n.target.id == "ARCHS"]
    twice = [k for k, n in collections.Counter(k.value for k in table.keys).items() if n > 1]
    assert twice == []


_REFUSAL_CONFIGS = {
    "snapkv": lambda: small_config("snapkv", budget=BUDGET),
    "offload": lambda: small_config("snapkv", budget=BUDGET, prompt_eviction="offload"),
    "kv_bits": lambda: small_config("snapkv", budget=64, kv_bits=8, kv_group_size=32),
    "pyramidkv": lambda: small_config("pyramidkv", budget=24),
    "kvzip": lambda: small_config("kvzip", budget=BUDGET),
}


@pytest.mark.filterwarnings("ignore:.*scaled_dot_product_attention")  # keys stand in for queries
@pytest.mark.parametrize("name", [n for n in architecture_files() if isinstance(ARCHS.get(n), tuple)])
def test_refusal_says_what_for_model_does(name):
    """``KVCacheBuilder.refusal`` answers, without building, what ``for_model`` does: None where it builds,
    its exact line where it refuses (paged prompts, quantized rows, per-layer budgets, model passes)."""
    for label, make in _REFUSAL_CONFIGS.items():
        config = make()
        model = build(name)
        said = KVCacheBuilder.refusal(model, config)
        try:
            KVCacheBuilder.for_model(model, config)
        except ValueError as e:
            assert said == str(e), f"{name} {label}: refusal() said {said!r}, for_model raised {str(e)!r}"
        else:
            assert said is None, f"{name} {label}: refusal() said {said!r}, for_model built"
