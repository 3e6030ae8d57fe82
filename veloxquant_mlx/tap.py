"""The query tap, mlx-lm glue: almost every mlx-lm model module does
``from .base import scaled_dot_product_attention`` and calls it with ``cache=``. We rebind that name,
in the model's own modules only, to a thin wrapper that hands the post-RoPE queries to
``cache.observe_queries`` (when the cache has it), lets the cache replace the mask for its own layer
(ragged per-head storage), then calls the original. Other caches pass straight through.

The hidden-state tap (below) hands each attention module's input ``x`` to its cache, for methods that
score rows from the layer's hidden states.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base

from .caches.masks import is_additive, keep_additive

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_TAP_NAME = "scaled_dot_product_attention"


def tapped_scaled_dot_product_attention(queries, keys, values, cache=None, scale=None, mask=None, **kwargs):
    step = getattr(cache, "tap_step", None)
    if step is not None:  # an eviction cache: one call observes, and says the output, mask and dependencies
        if cache.latent_query is not None:  # MLA: which of the module's two attention calls this is (LatentQuery)
            cache.latent_query.reads_latent = keys is values
        out, mask, deps = step(queries, scale, mask, kwargs, keys)
        if out is None:
            out = _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
        return out if deps is None else mx.depends(out, deps)
    to_rows = getattr(cache, "latent_query", None)
    if to_rows is not None:
        to_rows.reads_latent = keys is values
    observe = getattr(cache, "observe_queries", None)
    if observe is None:
        return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    out = None
    attend = getattr(cache, "observe_and_attend", None)
    seen = queries if to_rows is None else to_rows(queries)
    plain = all(v is None for v in kwargs.values()) and not hasattr(cache, "bits")
    if attend is not None and plain and to_rows is None and (mask is None or isinstance(mask, str)):
        # One pass: a method whose scoring computes the attention weights returns the output too (the
        # positional causal mask it applies is the "causal"/None mask mlx-lm built, per layer).
        out = attend(queries, scale)
    else:
        observe(seen, scale)
    if out is None:
        mask = (keep_additive(cache.attention_mask, mask, seen) if is_additive(mask)
                else cache.attention_mask(mask, seen))
        out = _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    # The state this step updated (scores, query window, positions) is consumed by no output, and
    # mlx_lm.generate evaluates only the tokens in decode: tie it to this layer's output so it is
    # computed now, instead of a lazy graph that pins every earlier buffer until the next eviction.
    step_state = getattr(cache, "step_state", None)
    deps = step_state() if step_state is not None else None
    return mx.depends(out, deps) if deps else out


tapped_scaled_dot_product_attention.__veloxquant_tap__ = True




# -- multi-head latent attention (MLA: deepseek_v3, kimi_linear, glm4_moe_lite, mistral4, ...) ----------
# The cache stores one latent row per token (keys: the compressed KV, values: the rotary key part), shared
# by every head. An MLA module attends in one of two ways. Decode hands attention the absorbed query
# ``embed_q(q_nope)`` against the latent rows themselves, passed as both keys and values; prefill hands it
# the per-head ``q_nope`` (or ``[q_nope, q_rope]``) against keys and values decompressed from the latent
# (two different arrays). The tap tells the two calls apart by that, per call (``reads_latent``), never by
# the query's width, which coincides when ``kv_lora_rank`` equals ``qk_nope_head_dim`` (+ the rope part).
# It maps the prefill query into the latent's space the same way (``embed_q`` of its no-rope part), so a
# method scores rows against the latent it evicts, with the query that decode attention uses. The rotary
# part of the logits (in the mask) is not part of the score.
class LatentQuery:
    """``queries`` (B, H, S, any width) -> the absorbed query (B, H, S, kv_lora_rank) of an MLA module.

    ``reads_latent``: whether the attention call being tapped reads the latent rows themselves (its query
    is already absorbed); the tap sets it before every call."""

    def __init__(self, attn):
        self.attn = attn
        self.rank, self.nope = int(attn.kv_lora_rank), int(attn.qk_nope_head_dim)
        self.reads_latent = False

    def __deepcopy__(self, memo):  # a scratch copy of the cache shares the model's module
        return self

    def __call__(self, queries):
        if self.reads_latent:  # decode: already absorbed
            return queries
        return self.attn.embed_q(queries[..., :self.nope])


def _is_mla(attn) -> bool:
    return attn is not None and hasattr(attn, "embed_q") and hasattr(attn, "kv_lora_rank")


def latent_refusal(model, attn, quantized: bool) -> str | None:
    """Why an MLA layer (``attn``) cannot evict its latent's rows (stored quantized or not), or None."""
    if quantized:
        return f"{type(model).__module__} caches MLA latents, which mlx-lm attends to unquantized: use kv_bits=None"
    if not int(getattr(attn, "qk_nope_head_dim", 0) or 0):
        return (f"{type(model).__module__}: MLA with qk_nope_head_dim=0 has no query part in the latent's space to "
                "score its rows with")
    return None


def mla_layers(model, evictable) -> list:
    """The attention modules of ``model``'s MLA layers whose own cache (``evictable(i)``) would evict."""
    return [a for i, a in enumerate(attention_modules(model)) if _is_mla(a) and evictable(i)]


def bind_latent_queries(model, caches: list) -> int:
    """Give the query-observing caches of ``model``'s MLA layers their :class:`LatentQuery`. Refuses, in
    one line, what MLA cannot take: quantized rows, and a query without a no-rope part. Returns how many
    caches were bound."""
    n = 0
    for attn, c in zip(attention_modules(model), caches):
        inner = [x for x in getattr(c, "caches", (c,)) if hasattr(x, "observe_queries")]
        if not inner or not _is_mla(attn):
            continue
        refusal = latent_refusal(model, attn, quantized=any(hasattr(x, "bits") for x in inner))
        if refusal:
            raise ValueError(refusal)
        for x in inner:
            x.latent_query = LatentQuery(attn)
        n += len(inner)
    return n


# -- KV shared across layers (gemma4_text's small checkpoints) ----------------------------------------------
# The last layers of such a model compute no keys or values and get no cache (None): each reads the rows an
# earlier layer of its kind (its source) returned from update_and_fetch, which the model passes along the
# forward (``shared_kv``). An eviction cache evicts in its source layer's step, after that layer's
# attention: the rows it returned are what that step attends to, so the sharers of that forward read them
# too, and need the mask that describes them (ragged per-head storage hides its padding rows there). So the
# layers are given a subclass (per instance, as the hidden-state tap does) whose source layers name their
# cache beside the rows they pass along (SourceRows), and whose sharer layers, given such rows, get a
# SharedRows in place of None: its update_and_fetch returns the rows as they came, and its tap step gives
# the source's mask (and, by its ``bits``, mlx-lm's quantized attention for quantized rows). The sharers'
# queries are not scored: the source scores with its own (docs/architecture.md says why).


class SourceRows(tuple):
    """(keys, values) a source layer's cache returned from ``update_and_fetch``, and that cache."""

    def __new__(cls, rows, cache):
        self = super().__new__(cls, rows)
        self.cache = cache
        return self


class SharedRows:
    """The cache a KV-shared layer's attention gets: the rows its source's cache returned this step."""

    latent_query = None  # (no MLA model shares KV across layers)

    def __init__(self, source):
        self.source = source
        if hasattr(source, "bits"):  # mlx-lm's attention takes its quantized path by this attribute
            self.bits, self.group_size = source.bits, source.group_size

    def update_and_fetch(self, keys, values):
        return keys, values  # the source's rows, handed on by the model

    def tap_step(self, queries, scale, mask, kwargs, keys=None):
        src = self.source
        paged = getattr(src, "shared_output", None)
        out = None if paged is None else paged(queries, scale, kwargs)
        if out is not None:  # the source read this step from its page file
            return out, mask, None
        # one cache's uniform rows under mlx-lm's string mask: that mask is right as it is (as for the source)
        fetched = getattr(src, "fetched", None)  # (a batch's rows always take the batch's mask)
        if isinstance(mask, mx.array) or fetched is None or fetched.ragged:
            mask = src.attention_mask(mask, queries)
        return None, mask, None


def kv_sources(model) -> dict:
    """{sharer layer: source layer} of a model whose later layers read the rows an earlier layer returned
    (gemma4_text's ``previous_kvs``); empty for every other model."""
    for m in model.modules():
        prev = getattr(m, "previous_kvs", None)
        if isinstance(prev, list) and len(prev) == len(getattr(m, "layers", ())):
            return {j: i for j, i in enumerate(prev) if i != j}
    return {}


def _sharing_call(cls):
    def __call__(self, x, mask=None, cache=None, *args, **kwargs):
        rows = kwargs.get("shared_kv", args[1] if len(args) > 1 else None)
        if cache is None and isinstance(rows, SourceRows):  # a sharer of an eviction cache's rows
            return cls.__call__(self, x, mask, SharedRows(rows.cache), *args, **kwargs)
        out = cls.__call__(self, x, mask, cache, *args, **kwargs)
        if hasattr(cache, "attention_mask"):  # a source whose cache is ours: its rows name it
            out = (out[0], SourceRows(out[1], cache), *out[2:])
        return out
    return __call__


def install_shared_rows(model) -> int:
    """Let the KV-shared layers of ``model`` read their source's rows with its mask. Idempotent; returns
    how many layers (sources and sharers) carry the link."""
    links = kv_sources(model)
    return _wrap([model.layers[i] for i in sorted(set(links) | set(links.values()))], "sharing", _sharing_call)


def remove_shared_rows(model) -> int:
    """Give every layer its own class back. Returns how many were restored."""
    return _unwrap(getattr(model, "layers", None) or [], "sharing")


# -- module classes swapped per instance (the shared-rows link, the hidden-state tap) -------------------
_WRAPPED: dict = {}  # (class, kind) -> its subclass


def _wrap(modules, kind: str, make_call) -> int:
    """Give each module (None: skipped) a subclass of its class whose ``__call__`` is ``make_call(cls)`` (a
    function of ``(self, ...)`` that calls ``cls.__call__``), named and placed as the class itself
    (``isinstance`` and parameters unchanged). Idempotent; returns how many modules carry it."""
    marker, n = f"__veloxquant_{kind}__", 0
    for m in modules:
        if m is None:
            continue
        cls = type(m)
        if not getattr(cls, marker, False):
            sub = _WRAPPED.get((cls, kind))
            if sub is None:
                sub = type(cls.__name__, (cls,), {
                    "__call__": make_call(cls), "__module__": cls.__module__,
                    "__qualname__": cls.__qualname__, marker: True, "__veloxquant_base__": cls})
                _WRAPPED[(cls, kind)] = sub
            m.__class__ = sub
        n += 1
    return n


def _unwrap(modules, kind: str) -> int:
    """Give every module its own class back (:func:`_wrap` undone). Returns how many were restored."""
    marker, n = f"__veloxquant_{kind}__", 0
    for m in modules:
        if m is not None and getattr(type(m), marker, False):
            m.__class__ = type(m).__veloxquant_base__
            n += 1
    return n


def _model_module_names(model) -> list:
    names = {type(model).__module__}
    for m in model.modules():
        names.add(type(m).__module__)
    return sorted(n for n in names if n.startswith("mlx_lm.models."))


def install_query_tap(model) -> list:
    """Route the model's attention calls through the tap. Idempotent. Returns the tapped modules
    (empty when the model does not call mlx-lm's ``scaled_dot_product_attention``)."""
    tapped = []
    for name in _model_module_names(model):
        mod = sys.modules.get(name)
        fn = getattr(mod, _TAP_NAME, None)
        if fn is _ORIGINAL_SDPA:
            setattr(mod, _TAP_NAME, tapped_scaled_dot_product_attention)
            tapped.append(name)
        elif getattr(fn, "__veloxquant_tap__", False):
            tapped.append(name)
    if tapped:
        install_shared_rows(model)
    return tapped


def remove_query_tap(model) -> list:
    """Restore the original function in the model's modules (and remove the hidden-state tap and the
    shared-rows link). Returns the modules restored."""
    remove_hidden_tap(model)
    remove_shared_rows(model)
    restored = []
    for name in _model_module_names(model):
        mod = sys.modules.get(name)
        if getattr(getattr(mod, _TAP_NAME, None), "__veloxquant_tap__", False):
            setattr(mod, _TAP_NAME, _ORIGINAL_SDPA)
            restored.append(name)
    return restored


def query_tap_reaches(model) -> bool:
    """Does the model call mlx-lm's ``scaled_dot_product_attention`` (would :func:`install_query_tap` tap it)?"""
    return any(fn is _ORIGINAL_SDPA or getattr(fn, "__veloxquant_tap__", False)
               for fn in (getattr(sys.modules.get(n), _TAP_NAME, None) for n in _model_module_names(model)))


def query_tap_installed(model) -> bool:
    return any(getattr(getattr(sys.modules.get(n), _TAP_NAME, None), "__veloxquant_tap__", False)
               for n in _model_module_names(model))


# -- the hidden-state tap ----------------------------------------------------------------------------
# A method that scores rows from the layer's input (``Needs.hidden_states``) gets it from each attention
# module: the module's class is swapped, per instance, for a subclass whose ``__call__`` sets ``x`` as the
# ``attention_input`` of the cache passed in (when it has one) before the original runs, so the cache holds
# this step's hidden states when it stores the step's rows.
_ATTENTION_NAMES = ("self_attn", "attention", "attn")


def attention_modules(model) -> list:
    """The attention module of every layer of ``model.layers`` (None where a layer has none)."""
    out = []
    for layer in getattr(model, "layers", None) or []:
        out.append(next((getattr(layer, n) for n in _ATTENTION_NAMES if getattr(layer, n, None) is not None), None))
    return out


def _hidden_call(cls):
    def __call__(self, x, *args, **kwargs):
        try:  # mlx-lm's layers call attention(x, mask, cache)
            cache = args[1]
        except IndexError:
            cache = kwargs.get("cache")
        if getattr(cache, "needs_hidden", False):  # a cache that does not read it must not hold it (memory)
            cache.attention_input = x
        return cls.__call__(self, x, *args, **kwargs)
    return __call__


def install_hidden_tap(model) -> int:
    """Hand every attention module's input to its cache (``cache.attention_input = x``).
    Idempotent; returns how many modules carry the tap."""
    return _wrap(attention_modules(model), "hidden", _hidden_call)


def remove_hidden_tap(model) -> int:
    """Give every attention module its own class back. Returns how many were restored."""
    return _unwrap(attention_modules(model), "hidden")


def hidden_tap_installed(model) -> bool:
    return any(getattr(type(a), "__veloxquant_hidden__", False) for a in attention_modules(model) if a is not None)
