"""Shared helpers: the one tiny random mlx-lm model builder, the one cache factory, greedy generation."""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.models import gemma3_text, llama, qwen2, qwen3

from veloxquant_mlx import EvictionCache, KVCacheConfig
from veloxquant_mlx.options import small_options
from veloxquant_mlx.registry import get_method


def _register_example_method():
    """examples/add_a_method.py registers "tova" like a built-in method, so every registry-driven
    test (contract, batching, memory, save/load, distributed) runs it: a new method needs no test edits."""
    path = Path(__file__).resolve().parents[1] / "examples" / "add_a_method.py"
    spec = importlib.util.spec_from_file_location("add_a_method", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


EXAMPLE_METHOD = _register_example_method()
VOCAB = 128
SMALL_BUDGET = 32  # the budget the methods' small= options are sized for


# kvzap needs a scorer fitted for each model: the tiny models get theirs from the real fit code (KVzip+ scores
# of random token windows, ridge regression), written to a folder of this process on kvzap's search path, so
# every registry-driven test builds kvzap exactly as a user with a fitted scorer does. The folder is made by
# the first fit and removed when the process exits: a process that fits nothing (pytest before it re-executes
# itself with OpenBLAS, which skips exit handlers) leaves nothing in the temporary folder.
KVZAP_DIR = None
os.environ.pop("VELOXQUANT_KVZAP_PATH", None)  # a user's own scorers stay out of the tests


def kvzap_dir() -> Path:
    """This process's scorer folder (made, put on kvzap's search path and registered for removal at exit
    on the first call)."""
    global KVZAP_DIR
    if KVZAP_DIR is None:
        KVZAP_DIR = Path(tempfile.mkdtemp(prefix="vq-kvzap-scorers-"))
        os.environ["VELOXQUANT_KVZAP_PATH"] = str(KVZAP_DIR)
        atexit.register(shutil.rmtree, KVZAP_DIR, ignore_errors=True)
    return KVZAP_DIR


def fit_tiny_scorer(model) -> Path:
    """Fit (once per model identity) and store a kvzap scorer for a tiny test model."""
    from veloxquant_mlx.evaluation.kvzap_fit import tiny_scorer

    return tiny_scorer(model, kvzap_dir(), tiny_tokenizer())


def make_tiny_model(arch: str = "llama", seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    **args):
    model = _make_tiny_model(arch, seed, layers, heads, kv_heads, **args)
    fit_tiny_scorer(model)
    return model


def _make_tiny_model(arch, seed, layers, heads, kv_heads, **args):
    """A tiny fp32 model with GQA (``heads`` query heads, ``kv_heads`` KV heads, head_dim 16; gemma3:
    head_dim 32 with sliding-window layers). ``args`` override fields of the architecture's ModelArgs."""
    mx.random.seed(seed)
    if arch == "gemma3":
        model = gemma3_text.Model(gemma3_text.ModelArgs(**{
            "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": layers, "intermediate_size": 96,
            "num_attention_heads": heads, "head_dim": 32, "num_key_value_heads": kv_heads, "vocab_size": VOCAB,
            **args}))
        mx.eval(model.parameters())
        return model
    common = dict(hidden_size=16 * heads, num_hidden_layers=layers, intermediate_size=128,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  max_position_embeddings=4096)
    if arch == "llama":
        model = llama.Model(llama.ModelArgs(**{"model_type": "llama", "tie_word_embeddings": False, **common, **args}))
    elif arch == "qwen3":
        model = qwen3.Model(qwen3.ModelArgs(**{"model_type": "qwen3", "head_dim": 16, "rope_theta": 10000.0,
                                               "tie_word_embeddings": True, **common, **args}))
    elif arch == "qwen2":  # has pipeline()
        model = qwen2.Model(qwen2.ModelArgs(**{"model_type": "qwen2", "rope_theta": 10000.0,
                                               "tie_word_embeddings": True, **common, **args}))
    else:
        raise ValueError(arch)
    mx.eval(model.parameters())
    return model


def small_config(method: str, budget: int = SMALL_BUDGET, **kw) -> KVCacheConfig:
    """``KVCacheConfig`` of ``method`` with its ``small=`` options (so it evicts on tiny shapes); ``kw``
    (core fields, ``options=`` or flat ``<method>_<field>=``) override them."""
    options = {**small_options(get_method(method).Options), **(kw.pop("options", None) or {})}
    for key in kw:  # a flat override replaces the small value instead of conflicting with it
        if key.startswith(method + "_"):
            options.pop(key[len(method) + 1:], None)
    return KVCacheConfig(method=method, budget=budget, options=options, **kw)


def make_cache(method: str, *, small: bool = False, tap: bool | None = True, layer_idx: int = 0,
               n_layers: int = 1, **kw):
    """One layer's eviction cache, built directly (no model): ``KVCacheConfig(method, **kw)``, or
    :func:`small_config` when ``small``; ``tap`` sets ``tap_active`` (None leaves the default)."""
    cfg = small_config(method, **kw) if small else KVCacheConfig(method=method, **kw)
    cache = EvictionCache(cfg, layer_idx=layer_idx, n_layers=n_layers)
    if tap is not None:
        cache.tap_active = tap
    return cache


_TOKENIZER = None


def tiny_tokenizer():
    """A real (word-level) HF tokenizer over VOCAB tokens "t0".."t127", so stream_generate runs as usual."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
        tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        _TOKENIZER = TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=tk))
    return _TOKENIZER


def greedy(model, prompt, max_tokens=8, prompt_cache=None, prefill_step_size=2048):
    """Greedy generation through mlx_lm.stream_generate: (tokens, logprobs as numpy)."""
    toks, lps = [], []
    for r in stream_generate(model, tiny_tokenizer(), mx.array(prompt), max_tokens=max_tokens,
                             prompt_cache=prompt_cache, prefill_step_size=prefill_step_size):
        toks.append(r.token)
        lps.append(np.array(r.logprobs.astype(mx.float32)))
    return toks, np.stack(lps)


def random_prompt(n, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


@contextlib.contextmanager
def forbid_host_sync():
    """Make every MLX host synchronization raise inside the block.

    The one documented exception is ``caches.allocation.ragged_width``: ragged storage reads its width
    back once per eviction step. Those reads are allowed and counted in the yielded list."""
    from veloxquant_mlx.caches import allocation

    def boom(*a, **k):
        raise AssertionError("host sync inside the cache hot path")

    saved = {name: getattr(mx.array, name) for name in ("item", "tolist", "__bool__", "__int__", "__float__",
                                                         "__array__")
             if hasattr(mx.array, name)}
    saved_fns = {name: getattr(mx, name) for name in ("eval", "async_eval")}
    ragged_reads = []
    width = allocation.ragged_width

    def patch(on):
        for name, fn in saved.items():
            setattr(mx.array, name, boom if on else fn)
        for name, fn in saved_fns.items():
            setattr(mx, name, boom if on else fn)

    def counted_width(shard, counts):
        ragged_reads.append(counts.shape)
        patch(False)
        try:
            return width(shard, counts)
        finally:
            patch(True)

    try:
        patch(True)
        allocation.ragged_width = counted_width
        yield ragged_reads
    finally:
        patch(False)
        allocation.ragged_width = width


def pytest_configure(config):
    """Re-run the session once with OpenBLAS preloaded when one is installed (Linux CPU).

    MLX's Linux CPU wheel uses a reference BLAS; the real-model tests run several times faster with
    OpenBLAS preloaded (one thread): pip's ``cmeel-openblas`` (the ``fast-cpu`` extra, which .ci/run
    installs), else Debian's ``libopenblas0-pthread``. The re-run prints one ``fast-blas:`` line naming
    the library. Results do not depend on it (tests compare runs within one process or with
    tolerances). Set VELOXQUANT_NO_FAST_BLAS=1 to keep the reference BLAS.
    """
    import os

    if os.environ.get("VELOXQUANT_NO_FAST_BLAS"):
        return
    from veloxquant_mlx.platform import blas

    if blas.openblas_preloaded() or blas.find_blas() is None:
        return
    capman = config.pluginmanager.getplugin("capturemanager")
    if capman is not None:
        capman.suspend_global_capture(in_=True)  # hand the real stdout/stderr to the new process
    blas.reexec_with_openblas()  # only returns when it cannot re-exec (then we just carry on)
    if capman is not None:
        capman.resume_global_capture()


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="run slow real-model tests")
    parser.addoption("--write-architectures", action="store_true", default=False,
                     help="tests/test_architectures.py writes docs/architectures.md from its results")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: pass --run-slow to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
