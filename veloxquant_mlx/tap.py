"""The query tap, mlx-lm glue: almost every mlx-lm model module does
``from .base import scaled_dot_product_attention`` and calls it with ``cache=``. We rebind that name,
in the model's own modules only, to a thin wrapper that hands the post-RoPE queries to
``cache.observe_queries`` (when the cache has it), lets the cache replace the mask for its own layer
(ragged per-head storage), then calls the original. Other caches pass straight through.
"""

from __future__ import annotations

import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base

_ORIGINAL_SDPA = mlx_base.scaled_dot_product_attention
_TAP_NAME = "scaled_dot_product_attention"


def tapped_scaled_dot_product_attention(queries, keys, values, cache=None, scale=None, mask=None, **kwargs):
    observe = getattr(cache, "observe_queries", None)
    if observe is None:
        return _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    observe(queries, scale)
    mask = cache.attention_mask(mask, queries)
    out = _ORIGINAL_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)
    # The state this step updated (scores, query window, positions) is consumed by no output, and
    # mlx_lm.generate evaluates only the tokens in decode: tie it to this layer's output so it is
    # computed now, instead of a lazy graph that pins every earlier buffer until the next eviction.
    step_state = getattr(cache, "step_state", None)
    deps = step_state() if step_state is not None else None
    return mx.depends(out, deps) if deps else out


tapped_scaled_dot_product_attention.__veloxquant_tap__ = True


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
    return tapped


def remove_query_tap(model) -> list:
    """Restore the original function in the model's modules. Returns the modules restored."""
    restored = []
    for name in _model_module_names(model):
        mod = sys.modules.get(name)
        if getattr(getattr(mod, _TAP_NAME, None), "__veloxquant_tap__", False):
            setattr(mod, _TAP_NAME, _ORIGINAL_SDPA)
            restored.append(name)
    return restored


def query_tap_installed(model) -> bool:
    return any(getattr(getattr(sys.modules.get(n), _TAP_NAME, None), "__veloxquant_tap__", False)
               for n in _model_module_names(model))
