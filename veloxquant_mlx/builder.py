"""KVCacheBuilder: per-layer eviction caches for an mlx-lm model, and make_cache installation."""

from __future__ import annotations

import warnings

from mlx_lm.models.cache import CacheList, KVCache

from .caches.cache import EvictionCache
from .config import KVCacheConfig
from .caches.shard import HeadShard
from .model_dims import config_field
from .distributed import attach as attach_group, layer_span, resolve_group
from .model_pass import install_model_pass, remove_model_pass
from .prompt_cache import load_prompt_cache as read_prompt_cache
from .tap import (bind_latent_queries, install_hidden_tap, install_query_tap, kv_sources, latent_refusal, mla_layers,
                  query_tap_reaches, remove_query_tap)
from .registry import methods, register

_ORIGINAL_MAKE_CACHE = "_veloxquant_original_make_cache"
_warned_no_tap: set = set()
_asking_model: set = set()  # ids of models whose own make_cache we are calling right now


def _model_layer_caches(model) -> list:
    """The caches the model itself would build (ignoring our own installation).

    A user's ``model.make_cache = lambda *a, **k: KVCacheBuilder.for_model(model, cfg)`` makes that
    call re-enter for_model; the inner call then asks the model's class instead (no recursion)."""
    if _ORIGINAL_MAKE_CACHE in model.__dict__:
        make = model.__dict__[_ORIGINAL_MAKE_CACHE]  # installed: ask what the model had before us
    elif id(model) in _asking_model:
        cls_make = getattr(type(model), "make_cache", None)
        make = cls_make.__get__(model) if cls_make is not None else None
    else:
        make = getattr(model, "make_cache", None)
    _asking_model.add(id(model))
    try:
        made = make() if callable(make) else None
    finally:
        _asking_model.discard(id(model))
    return list(made) if made is not None else [KVCache() for _ in model.layers]


def _install_glue(model, methods, tokenizer=None) -> bool:
    """The query tap, and the model pass / hidden-state tap when one of ``methods`` (method classes) needs
    it. Returns whether the query tap reaches the model's attention."""
    tapped = bool(install_query_tap(model))
    if any(m.needs.model_pass for m in methods):
        install_model_pass(model, tokenizer)
    if any(m.needs.hidden_states for m in methods):
        install_hidden_tap(model)
    return tapped


# Config fields of models whose layers read another layer's KV rows. Where those layers read the rows their
# source's update_and_fetch returned, passed along the forward (gemma4_text), the tap hands them the source's
# mask (tap.install_shared_rows); where they read a cache's stored rows themselves (afm7 and gemma3n call
# ``keys_and_values``), an eviction would change them behind the attention's back, so those are refused.
# (Hunyuan's cross-layer attention, ``use_cla``, shares the key and value projections only: every layer
# still stores its own rows in its own cache, so it evicts as any model does.)
_SHARED_KV_FIELDS = ("num_kv_reuse_layers", "num_kv_shared_layers")


def _evictable(c) -> bool:
    return type(c) is KVCache or isinstance(c, EvictionCache)


def _layers_refusal(model, base: list) -> str | None:
    """Where no layer of ``model`` (whose own caches are ``base``) can evict: layers that read another
    layer's cache (afm7, gemma3n), several KV caches in one layer (a sparse-attention indexer over the
    latent's rows: deepseek_v32; two attentions: longcat_flash; the layer's mask and the indexer's row
    numbers assume the rows of one cache), or no full-attention KV cache at all (SSM, sliding windows only)."""
    what, fix = type(model).__module__, "run it with mlx-lm's own caches"
    shared = [(f, config_field(model, f)) for f in _SHARED_KV_FIELDS if config_field(model, f)]
    if shared and not kv_sources(model):
        return f"{what} has layers that read another layer's cache ({shared[0][0]}={shared[0][1]!r}): " \
               f"eviction is not supported; {fix}"
    parts = [list(c.caches) if type(c) is CacheList else [c] for c in base]
    if any(sum(map(_evictable, p)) > 1 for p in parts):
        return f"{what} keeps several KV caches per layer (a sparse-attention indexer, or two attentions): " \
               f"eviction is not supported; {fix}"
    if not any(_evictable(x) for p in parts for x in p):
        kinds = sorted({type(c).__name__ for c in base})
        return f"{what} has no full-attention KV cache to evict (its layers keep {', '.join(kinds)}): {fix}"
    return None


def _refusal(model, config: KVCacheConfig, base: list) -> str | None:
    """The one line ``for_model`` refuses ``config`` on ``model`` with (its own caches: ``base``), or None.
    It reads the model and the config and installs nothing."""
    refusal = _layers_refusal(model, base)
    if refusal:
        return refusal
    what, method, offload = type(model).__module__, config.method_class, config.prompt_eviction == "offload"
    tapped = query_tap_reaches(model)
    layers = getattr(model, "layers", None)
    if offload and layers is not None and len(base) > len(layers):
        return (f"{what} keeps {len(base)} caches for {len(layers)} layers (a layer attends through more than one "
                "of them), which prompt_eviction='offload' cannot page: use prompt_eviction='end'")
    if offload and not tapped:
        return ("prompt_eviction='offload' computes each prompt chunk's attention over the page file itself, "
                f"through the query tap, and {what} does not call mlx-lm's scaled_dot_product_attention: "
                "use prompt_eviction='end'")
    if config.kv_bits is not None and not tapped:
        return (f"kv_bits={config.kv_bits} needs a model whose attention calls mlx-lm's scaled_dot_product_attention "
                f"(its quantized path reads the packed rows); {what} does not: use kv_bits=None")
    evicting = [i for i, c in enumerate(base) if any(map(_evictable, c.caches if type(c) is CacheList else [c]))]
    start, n = layer_span(model, len(base))
    try:  # per-layer budgets (PyramidKV's refuse a budget too small for a layer)
        budgets = {method(config, start + i, n).layer_budget() for i in evicting}
    except ValueError as e:
        return str(e)
    if method.needs.model_pass and any(type(c) is CacheList for c in base):
        # the model pass finds the caches that deferred work among the model's top-level layer caches
        return (f"{config.method} runs a model pass at the prompt's end, which does not reach the attention caches "
                f"inside {what}'s CacheList layers: use another method")
    mla = mla_layers(model, set(evicting).__contains__)
    for attn in mla:
        refusal = latent_refusal(model, attn, quantized=config.kv_bits is not None)
        if refusal:
            return refusal
    if mla and offload:
        return (f"{what} (MLA) reads its prompt in the latent's space, which prompt_eviction='offload' does not "
                "page: use prompt_eviction='end'")
    if mla and len(budgets) > 1:
        # the model folds one mask, built for the first layer's rows, into every layer's rotary logits
        return (f"{what} (MLA) builds one mask for every layer's rows: {config.method}'s per-layer budgets are not "
                "supported; use a method that keeps one budget in every layer")
    return None


class KVCacheBuilder:
    """Registry front door: ``KVCacheBuilder.for_model(model, config)`` -> one fresh cache per layer."""

    register = staticmethod(register)
    methods = staticmethod(methods)

    @staticmethod
    def for_model(model, config: KVCacheConfig, group=None, tokenizer=None) -> list:
        """Fresh caches for every layer of ``model``.

        Full-attention layers (those for which the model builds a plain ``KVCache``, alone or as the
        attention part of a ``CacheList``) get ``config``'s eviction cache, seeded ``config.seed + layer``;
        every other layer (sliding window, SSM, ...) keeps the model's own cache. Also installs the query
        tap (MLA layers: queries in the latent's space, ``tap.bind_latent_queries``). A model where nothing
        can evict is refused in one ValueError line before anything is installed (docs/architectures.md).

        Distributed (see veloxquant_mlx.distributed): on a tensor-parallel model the caches hold this
        rank's KV heads and combine head-wide selections over ``group`` (default: the group the model
        was sharded over; ``False``: behave as a lone process); on a pipeline rank the layer indices
        (seeds, per-layer budgets) stay those of the whole model.
        """
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        base = _model_layer_caches(model)
        refusal = _refusal(model, config, base)
        if refusal:  # before anything is installed on the model
            raise ValueError(refusal)
        method = config.method_class
        tapped = _install_glue(model, [method], tokenizer)
        if not tapped and method.needs.queries and id(model) not in _warned_no_tap:
            _warned_no_tap.add(id(model))
            warnings.warn(
                f"{type(model).__module__} does not call mlx-lm's scaled_dot_product_attention, so "
                f"{config.method!r} cannot see real queries: falling back to keys as stand-in queries "
                "(measurably worse; see docs/architecture.md)", stacklevel=2)
        start, n = layer_span(model, len(base))
        group = resolve_group(model, group)
        ours = []

        def evicting(c, i):
            if not _evictable(c):
                return c  # sliding window, SSM, ...: the model's own cache
            ev = EvictionCache(config, layer_idx=start + i, n_layers=n)
            ev.dist = HeadShard(group) if group is not None else None
            ev.queries_from_keys = not tapped
            ev.tap_active = tapped
            ours.append(ev)
            return ev

        # A CacheList layer (an SSM state beside the attention's KVCache: falcon_h1, baichuan_m1) keeps its
        # other parts and gets an eviction cache for its attention part.
        caches = [CacheList(*(evicting(x, i) for x in c.caches)) if type(c) is CacheList else evicting(c, i)
                  for i, c in enumerate(base)]
        bind_latent_queries(model, caches)  # MLA: latent-space queries
        method.attach(model, [c.method for c in ours])  # declared: the model itself
        return caches

    @staticmethod
    def refusal(model, config: KVCacheConfig) -> str | None:
        """The one line :meth:`for_model` would refuse ``config`` on ``model`` with, or None where it builds
        (e.g. whether this model can page a prompt: ``config.replace(prompt_eviction="offload")``). Installs
        nothing on the model and builds no cache; a method's own checks when it attaches to the model
        (kvzap's fitted scorer) are not asked."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        return _refusal(model, config, _model_layer_caches(model))

    @staticmethod
    def attach(model, caches: list, tokenizer=None, group=None) -> list:
        """Make caches built elsewhere (a loaded file, another process) ready to run on ``model``, as
        :meth:`for_model` makes fresh ones: the query tap, the model pass and the hidden-state tap their
        method needs, and this rank's head shard (``group``: as in for_model). A cache that was built with
        the query tap on a model that cannot take it is refused. Returns ``caches``."""
        ours = [c for c in caches if isinstance(c, EvictionCache)]
        if not _install_glue(model, {type(c.method) for c in ours}, tokenizer) and any(c.tap_active for c in ours):
            raise ValueError(f"these caches were built with the query tap, and {type(model).__module__} does not "
                             "call mlx-lm's scaled_dot_product_attention: they cannot run on this model")
        bind_latent_queries(model, caches)
        return attach_group(caches, resolve_group(model, group))

    @staticmethod
    def install(model, config: KVCacheConfig, group=None, tokenizer=None) -> None:
        """Make ``model.make_cache()`` (hence ``mlx_lm.generate``) build fresh eviction caches on
        every call. Reversible with :meth:`uninstall`; installing again replaces the config."""
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if _ORIGINAL_MAKE_CACHE not in model.__dict__:
            # Remember the instance-level make_cache if the user set one, else the class method.
            inst = model.__dict__.get("make_cache")
            cls_fn = getattr(type(model), "make_cache", None)
            if inst is not None:
                original = inst
            else:
                original = cls_fn.__get__(model) if cls_fn is not None else None
            object.__setattr__(model, _ORIGINAL_MAKE_CACHE, original)
            object.__setattr__(model, "_veloxquant_had_instance_make_cache", inst is not None)
        object.__setattr__(model, "make_cache", lambda *a, **k: KVCacheBuilder.for_model(model, config, group))
        _install_glue(model, [config.method_class], tokenizer)

    @staticmethod
    def uninstall(model) -> None:
        """Undo :meth:`install` (and remove the query tap and the model-pass wrapper)."""
        if _ORIGINAL_MAKE_CACHE in model.__dict__:
            original = model.__dict__[_ORIGINAL_MAKE_CACHE]
            had_instance = model.__dict__.get("_veloxquant_had_instance_make_cache", False)
            for name in (_ORIGINAL_MAKE_CACHE, "_veloxquant_had_instance_make_cache", "make_cache"):
                if name in model.__dict__:
                    object.__delattr__(model, name)
            if had_instance:
                object.__setattr__(model, "make_cache", original)
        remove_query_tap(model)
        remove_model_pass(model)

    @staticmethod
    def installed(model) -> bool:
        return _ORIGINAL_MAKE_CACHE in getattr(model, "__dict__", {})


def load_prompt_cache(path, return_metadata: bool = False, model=None, tokenizer=None):
    """``veloxquant_mlx.load_prompt_cache``: the caches a :func:`save_prompt_cache` file holds
    (``veloxquant_mlx.prompt_cache``: checksum, model identity), attached to ``model`` when it is given
    (:meth:`KVCacheBuilder.attach`), so they continue exactly as the caches that were saved."""
    loaded = read_prompt_cache(path, return_metadata=return_metadata, model=model)
    if model is not None:
        KVCacheBuilder.attach(model, loaded[0] if return_metadata else loaded, tokenizer)
    return loaded
