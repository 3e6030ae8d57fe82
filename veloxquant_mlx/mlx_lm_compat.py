"""Glue to mlx-lm: the query tap, and save/load of prompt caches holding our classes.

The query tap: almost every mlx-lm model module does
``from .base import scaled_dot_product_attention`` and calls it with ``cache=``. We rebind that name,
in the model's own modules only, to a thin wrapper that hands the post-RoPE queries to
``cache.observe_queries`` (when the cache has it), lets the cache replace the mask for its own layer
(ragged per-head storage), then calls the original. Other caches pass straight through.
"""

from __future__ import annotations

import importlib
import json
import sys

import mlx.core as mx
from mlx_lm.models import base as mlx_base
from mlx_lm.models import cache as mlx_cache

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


# -- save / load ---------------------------------------------------------------------------------

_FILE_FORMAT = "veloxquant-prompt-cache/1"


def _cache_class(qualname: str):
    module, _, name = qualname.rpartition(".")
    if not module.startswith(("veloxquant_mlx.", "mlx_lm.models.cache")):
        raise ValueError(f"refusing to load cache class {qualname!r} from an unknown module")
    return getattr(importlib.import_module(module), name)


def save_prompt_cache(path: str, caches: list, metadata: dict | None = None) -> None:
    """Save a list of per-layer caches (ours and mlx-lm's) to one ``.safetensors`` file."""
    arrays, layers = {}, []
    for i, c in enumerate(caches):
        st = c.state
        if isinstance(st, dict):
            kind = "dict"
            items = st.items()
        else:
            kind = "seq"
            items = ((str(j), v) for j, v in enumerate(st))
        names, scalars = [], {}
        for name, value in items:
            if isinstance(value, mx.array):
                arrays[f"{i}.{name}"] = value
                names.append(name)
            else:
                scalars[name] = value  # mlx-lm's KVCache state carries its int offset
        cls = type(c)
        layers.append({"class": f"{cls.__module__}.{cls.__qualname__}", "kind": kind, "arrays": names,
                       "scalars": scalars, "meta_state": getattr(c, "meta_state", "")})
    header = {"format": _FILE_FORMAT, "layers": json.dumps(layers),
              "user": json.dumps(metadata or {})}
    mx.save_safetensors(str(path), arrays, header)


def load_prompt_cache(path: str, return_metadata: bool = False):
    """Load what :func:`save_prompt_cache` wrote; a corrupted or foreign file raises ValueError."""
    try:
        arrays, header = mx.load(str(path), return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError for unreadable files
        raise ValueError(f"cannot read prompt cache {path!r}: {e}") from None
    if header.get("format") != _FILE_FORMAT:
        raise ValueError(f"{path!r} is not a veloxquant prompt cache (format={header.get('format')!r})")
    try:
        layers = json.loads(header["layers"])
        user = json.loads(header.get("user", "{}"))
    except (KeyError, ValueError) as e:
        raise ValueError(f"corrupted prompt cache header in {path!r}: {e}") from None
    caches = []
    for i, layer in enumerate(layers):
        try:
            data = {name: arrays[f"{i}.{name}"] for name in layer["arrays"]}
        except KeyError as e:
            raise ValueError(f"prompt cache {path!r} is missing array {e} of layer {i}") from None
        data.update(layer["scalars"])
        cls = _cache_class(layer["class"])
        if layer["kind"] == "dict":
            state = data
        else:
            state = [data[str(j)] for j in range(len(data))]
        if hasattr(cls, "from_state") and "veloxquant_mlx" in cls.__module__:
            caches.append(cls.from_state(state, layer["meta_state"]))
        else:
            obj = cls.__new__(cls)
            obj.state = state
            if layer["meta_state"]:
                obj.meta_state = layer["meta_state"]
            caches.append(obj)
    return (caches, user) if return_metadata else caches

