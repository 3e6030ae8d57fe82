"""Save / load of prompt caches holding our classes and mlx-lm's, in one ``.safetensors`` file.

Loaded caches are rebuilt from their state (``EvictionCache.from_state``); only registered methods
and classes of this package or ``mlx_lm.models.cache`` are loaded.
"""

from __future__ import annotations

import importlib
import json

import mlx.core as mx

from .caches.base import EvictionCache
from .registry import get_method, methods

_FILE_FORMAT = "veloxquant-prompt-cache/1"


def _cache_class(qualname: str):
    """The class a file names: a registered method's (wherever it was defined), one of this package
    or of ``mlx_lm.models.cache``; nothing else is imported."""
    for name in methods():
        cls = get_method(name)
        if f"{cls.__module__}.{cls.__qualname__}" == qualname:
            return cls
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
        if issubclass(cls, EvictionCache):
            caches.append(cls.from_state(state, layer["meta_state"]))
        else:
            obj = cls.__new__(cls)
            obj.state = state
            if layer["meta_state"]:
                obj.meta_state = layer["meta_state"]
            caches.append(obj)
    return (caches, user) if return_metadata else caches

