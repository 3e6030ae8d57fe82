"""KVzap's scorers: the per-layer surrogate files ``fit-kvzap`` writes (weights and what they were fitted on),
the model identity a file is fitted for, and the search for a model's file (``$VELOXQUANT_KVZAP_PATH``,
then the shipped ``scorers/`` folder)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from ...model_dims import model_dims

SCORER_FORMAT = "veloxquant-kvzap-scorer/1"
SHIPPED_DIR = Path(__file__).resolve().parent / "scorers"
# Extra folders searched for fitted scorers by identity (os.pathsep-separated), before the shipped ones.
SCORER_PATH_ENV = "VELOXQUANT_KVZAP_PATH"


# -- model identity ------------------------------------------------------------------------------------
def model_identity(model) -> dict:
    """What a scorer is fitted for: architecture and shapes from ``model.args``, plus a hash of a few
    weight tensors (the embedding's first rows and every norm weight, which tensor parallelism does not
    shard), so two models of the same shape differ."""
    from mlx.utils import tree_flatten

    dims = model_dims(model)  # nested text_config and every field spelling; one-line ValueError otherwise
    ident = {"architecture": dims.model_type, "n_layers": dims.n_layers, "d_model": dims.d_model,
             "n_kv_heads": dims.n_kv_heads, "head_dim": dims.head_dim}
    h = hashlib.sha256()
    for name, w in sorted(tree_flatten(model.parameters())):
        if name.endswith("embed_tokens.weight"):
            w = w[:16]
        elif not name.endswith("norm.weight"):
            continue
        h.update(name.encode())
        h.update(memoryview(_host_bytes(w)))
    ident["weights_sha256"] = h.hexdigest()[:16]
    return ident


def _host_bytes(w):
    import numpy as np

    return np.ascontiguousarray(np.array(w.astype(mx.float32) if w.dtype == mx.bfloat16 else w)).tobytes()


def describe(ident: dict) -> str:
    return (f"{ident.get('architecture')} L={ident.get('n_layers')} d={ident.get('d_model')} "
            f"H_kv={ident.get('n_kv_heads')} head_dim={ident.get('head_dim')} weights={ident.get('weights_sha256')}")


# -- scorer files ----------------------------------------------------------------------------------------
def save_scorer(path, weights: dict, identity: dict, fit: dict, provenance: dict, quality: dict) -> None:
    """Write a scorer: ``weights`` {layer index: (W (d_model, H_kv), b (H_kv,))} for a linear one, or
    (W1 (d_model, hidden), b1 (hidden,), W (hidden, H_kv), b (H_kv,)) for an MLP, plus its metadata.
    The last two are always the output layer (the per-head columns tensor parallelism slices)."""
    arrays = {}
    for i, params in sorted(weights.items()):
        if len(params) not in (2, 4):
            raise ValueError(f"layer {i}: a scorer layer is (W, b) or (W1, b1, W, b), got {len(params)} arrays")
        names = ("W", "b") if len(params) == 2 else ("W1", "b1", "W", "b")
        for name, a in zip(names, params):
            arrays[f"{name}.{i}"] = mx.array(a, dtype=mx.float32)
    meta = {"format": SCORER_FORMAT, "identity": identity, "fit": fit, "provenance": provenance,
            "quality": quality, "layers": sorted(weights)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata={k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    os.replace(tmp, path)


_LOADED: dict = {}


def read_scorer_metadata(path) -> dict:
    """The scorer file's metadata (identity, fit, provenance, quality, layers); raises for other files."""
    return load_scorer(path)[1]


def load_scorer(path):
    """(weights {layer: (W, b)}, metadata, sha256 of the file), cached per (path, mtime, size)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"kvzap scorer {str(path)!r} is not a file")
    st = p.stat()
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        arrays, raw = mx.load(str(p), return_metadata=True)
        if raw.get("format") != json.dumps(SCORER_FORMAT):
            raise ValueError(f"{str(path)!r} is not a kvzap scorer (format {raw.get('format')!r}, "
                             f"expected {SCORER_FORMAT!r}); fit one with `python -m veloxquant_mlx fit-kvzap`")
        meta = {k: json.loads(v) for k, v in raw.items()}
        weights = {int(i): ((arrays[f"W1.{i}"], arrays[f"b1.{i}"]) if f"W1.{i}" in arrays else ())
                   + (arrays[f"W.{i}"], arrays[f"b.{i}"]) for i in meta["layers"]}
        sha = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        _LOADED[key] = (weights, meta, sha)
    return _LOADED[key]


def _search_dirs() -> list:
    extra = [Path(d) for d in os.environ.get(SCORER_PATH_ENV, "").split(os.pathsep) if d]
    return extra + [SHIPPED_DIR]


def find_scorer(identity: dict):
    """The first scorer file in $VELOXQUANT_KVZAP_PATH's folders, then the shipped ones, fitted for a
    model of this identity; None when there is none."""
    for folder in _search_dirs():
        for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            try:
                if load_scorer(f)[1]["identity"] == identity:
                    return f
            except (ValueError, KeyError, OSError):
                continue
    return None
