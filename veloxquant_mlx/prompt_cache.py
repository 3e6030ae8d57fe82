"""Save / load of prompt caches holding our classes and mlx-lm's, in one ``.safetensors`` file.

Loaded caches are rebuilt from their state (``EvictionCache.from_state``); only registered methods
and classes of this package or ``mlx_lm.models.cache`` are loaded.

The header says what the file holds (``contents``: method, options, budget, kv bits / group, token
count, layer count, model identity) and carries a sha256 over the tensor data (``checksum``), so a
corrupted file or one made for another model is refused instead of producing garbage. Files are
written to a temporary name beside the target and renamed: a failed save leaves nothing half-written.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import uuid
import warnings

import mlx.core as mx

from .caches.cache import EvictionCache
from .registry import get_method, methods

_FILE_FORMAT = "veloxquant-prompt-cache/1"


def _cache_class(qualname: str, meta_state: str = ""):
    """The class a file names: a registered method's own EvictionCache subclass, ``EvictionCache`` (also
    under the per-method class names files saved before methods left the cache, e.g.
    ``...methods.nexus.cache.NexusKVCache``, or a method added outside the package, which the layer's
    metadata names), or one of ``mlx_lm.models.cache``; nothing else is imported."""
    for name in methods():
        sub = getattr(get_method(name), "cache_class", None)
        if sub is not None and f"{sub.__module__}.{sub.__qualname__}" == qualname:
            return sub
    module, _, name = qualname.rpartition(".")
    if name == "EvictionCache" or module.startswith("veloxquant_mlx.methods.") or _names_a_method(meta_state):
        return EvictionCache
    if not module.startswith(("veloxquant_mlx.", "mlx_lm.models.cache")):
        raise ValueError(f"refusing to load cache class {qualname!r} from an unknown module")
    return getattr(importlib.import_module(module), name)


def _names_a_method(meta_state: str) -> bool:
    """The layer's metadata is an eviction cache's of a registered method."""
    try:
        method = json.loads(meta_state)["config"]["method"]
    except (TypeError, ValueError, KeyError):
        return False
    return method in methods()


def model_identity(model) -> dict:
    """``{"model_type", "sha256"}``: a hash of the model's config (``model.args``) and its parameter names
    and dtypes. Same architecture and config -> same identity (weights are not read); head sharding
    under ``mlx.launch`` keeps it."""
    from mlx.utils import tree_flatten

    args = getattr(model, "args", None)
    config = dict(sorted(vars(args).items())) if args is not None else {"class": type(model).__qualname__}
    params = sorted((k, str(v.dtype)) for k, v in tree_flatten(model.parameters()))
    blob = json.dumps({"config": config, "params": params}, sort_keys=True, default=str)
    return {"model_type": str(config.get("model_type", type(model).__module__)),
            "sha256": hashlib.sha256(blob.encode()).hexdigest()[:16]}


def _checksum(arrays: dict) -> str:
    """sha256 over every array's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}|{a.dtype}|{tuple(a.shape)}|".encode())
        h.update(bytes(memoryview(a)))  # a host copy: fine at save/load time
    return h.hexdigest()


def _contents(caches: list, model) -> dict:
    """What the file holds: the eviction config (or None: mlx-lm's caches only), tokens, layers, model."""
    cfg = next((c.config for c in caches if isinstance(c, EvictionCache)), None)
    d = cfg.to_dict() if cfg is not None else {"method": "full"}
    offsets = [int(getattr(c, "offset", 0) or 0) for c in caches]
    return {**d, "tokens": max(offsets, default=0), "layers": len(caches),
            "model": model_identity(model) if model is not None else None}


def save_prompt_cache(path: str, caches: list, metadata: dict | None = None, model=None) -> None:
    """Save a list of per-layer caches (ours and mlx-lm's) to one ``.safetensors`` file. ``model``: the
    model the caches belong to, recorded so :func:`load_prompt_cache` can refuse another model's file."""
    arrays, layers = {}, []
    for i, c in enumerate(caches):
        if isinstance(getattr(c, "caches", None), (list, tuple)):  # CacheList: states of several caches
            raise ValueError(f"layer {i} holds a {type(c).__name__} ({', '.join(type(x).__name__ for x in c.caches)}): "
                             "saving such layers is not supported")
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
    header = {"format": _FILE_FORMAT, "layers": json.dumps(layers), "user": json.dumps(metadata or {}),
              "contents": json.dumps(_contents(caches, model), default=str), "checksum": _checksum(arrays)}
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    # mlx appends ".safetensors" to a name without it: the temporary name ends with it
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex[:8]}.tmp.safetensors")
    try:
        mx.save_safetensors(tmp, arrays, header)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_prompt_cache_metadata(path: str) -> dict:
    """The user metadata of a file :func:`save_prompt_cache` wrote, read from its header alone (no
    tensor data), so a command can check its flags against the file before loading a model."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= 100 * 2**20:
                raise ValueError("no safetensors header")
            header = json.loads(f.read(n)).get("__metadata__") or {}
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read prompt cache {path!r}: {e}") from None
    if header.get("format") != _FILE_FORMAT:
        raise ValueError(f"{path!r} is not a veloxquant prompt cache (format={header.get('format')!r})")
    try:
        return json.loads(header.get("user", "{}"))
    except ValueError as e:
        raise ValueError(f"corrupted prompt cache header in {path!r}: {e}") from None


def load_prompt_cache(path: str, return_metadata: bool = False, model=None):
    """Load what :func:`save_prompt_cache` wrote; a corrupted or foreign file raises ValueError, and so
    does a file made for another model than ``model`` (when given). Files written before checksums
    load with a warning (their data cannot be verified)."""
    path = os.fspath(path)
    try:
        arrays, header = mx.load(path, format="safetensors", return_metadata=True)  # whatever the file's name
    except Exception as e:  # MLX raises RuntimeError/ValueError for unreadable files
        raise ValueError(f"cannot read prompt cache {path!r}: {e}") from None
    if header.get("format") != _FILE_FORMAT:
        raise ValueError(f"{path!r} is not a veloxquant prompt cache (format={header.get('format')!r})")
    try:
        layers = json.loads(header["layers"])
        user = json.loads(header.get("user", "{}"))
        contents = json.loads(header["contents"]) if "contents" in header else None
    except (KeyError, ValueError) as e:
        raise ValueError(f"corrupted prompt cache header in {path!r}: {e}") from None
    for i, layer in enumerate(layers):  # a missing array is named before the checksum says "corrupted"
        for name in layer.get("arrays", ()):
            if f"{i}.{name}" not in arrays:
                raise ValueError(f"prompt cache {path!r} is missing array '{i}.{name}' of layer {i}")
    if "checksum" not in header:
        warnings.warn(f"{path!r} was written before checksums and model identities: its data cannot be "
                      "verified (save it again to add them)", UserWarning, stacklevel=2)
    elif _checksum(arrays) != header["checksum"]:
        raise ValueError(f"prompt cache {path!r} is corrupted: its tensor data does not match the checksum "
                         "in its header")
    held = (contents or {}).get("model")
    if model is not None and held is not None and held != model_identity(model):
        now = model_identity(model)
        raise ValueError(f"prompt cache {path!r} was made for another model ({held['model_type']} "
                         f"{held['sha256']}; this model is {now['model_type']} {now['sha256']})")
    caches = []
    for i, layer in enumerate(layers):
        try:
            data = {name: arrays[f"{i}.{name}"] for name in layer["arrays"]}
        except KeyError as e:
            raise ValueError(f"prompt cache {path!r} is missing array {e} of layer {i}") from None
        data.update(layer["scalars"])
        cls = _cache_class(layer["class"], layer.get("meta_state", ""))
        if layer["kind"] == "dict":
            state = data
        else:
            state = [data[str(j)] for j in range(len(data))]
        if issubclass(cls, EvictionCache):
            cache = cls.from_state(state, layer["meta_state"])
            cache.continue_on_purpose()  # a loaded file is continued deliberately: no reuse warning
            caches.append(cache)
        else:
            obj = cls.__new__(cls)
            obj.state = state
            if layer["meta_state"]:
                obj.meta_state = layer["meta_state"]
            caches.append(obj)
    return (caches, user) if return_metadata else caches

