"""Eviction caches under mlx-lm's distributed generation (``mx.distributed``, ``mlx.launch``): the glue.

This module finds a loaded model's tensor group and pipeline layer span (what
``KVCacheBuilder.for_model`` hands each cache), attaches a :class:`~veloxquant_mlx.caches.shard.HeadShard`
to caches built elsewhere, and shards a model over ``mlx.launch``'s world for the command line. The
collectives the caches run live in the core, :mod:`veloxquant_mlx.caches.shard`.

Pipeline parallel (``model.model.pipeline(group)``): a rank holds a contiguous slice of the layers;
caches carry the GLOBAL layer index (seed ``config.seed + layer``, PyramidKV's per-layer budget), so
the kept rows are the ones one process keeps; nothing is exchanged.
"""

from __future__ import annotations

import mlx.core as mx

from .caches.shard import HeadShard, shard_of
from .model_dims import layer_count


# -- finding the groups of a loaded model ---------------------------------------------------------

def tensor_group(model):
    """The tensor-parallel group that splits the model's attention heads (``model.shard(group)``:
    mlx-lm's ``shard_linear`` layers carry it), or None when no attention projection is sharded
    (a model whose ``shard`` splits only its MLP keeps every head on every rank) or the group has
    one rank."""
    from mlx.nn.layers.distributed import AllToShardedLinear, QuantizedAllToShardedLinear

    sharded = (AllToShardedLinear, QuantizedAllToShardedLinear)
    for layer in getattr(model, "layers", None) or []:
        if layer is None:  # pipeline ranks keep None for the layers they do not hold
            continue
        for name, child in layer.children().items():
            if "attn" not in name and "attention" not in name:
                continue
            for m in (child.modules() if hasattr(child, "modules") else []):
                if isinstance(m, sharded):
                    return m.group if m.group.size() > 1 else None
    return None


def _pipelined(model):
    for m in (getattr(model, "model", None), model):
        if m is not None and getattr(m, "pipeline_size", 1) > 1:
            return m
    return None


def layer_span(model, n_local: int):
    """(index of the first local layer, total layers) in the whole model.

    A pipeline-parallel rank (mlx-lm's ``PipelineMixin``) holds layers ``start_idx .. end_idx`` of
    the model; layer numbers stay global so seeds and per-layer budgets agree with one process."""
    inner = _pipelined(model)
    if inner is None:
        return 0, n_local
    start = int(inner.start_idx)
    total = layer_count(model)  # every spelling of the layer count, nested text_config too
    if not isinstance(total, int) or total < start + n_local:
        total = len(getattr(inner, "layers", [])) or start + n_local  # rank 0 (last layers): end_idx
    return start, total


def resolve_group(model, group):
    """The tensor group the builder uses: ``group`` if given, else the model's (``False``: none)."""
    if group is False:
        return None
    if group is None:
        return tensor_group(model)
    return group if group.size() > 1 else None


def attach(caches, group) -> list:
    """Give eviction caches built outside :meth:`KVCacheBuilder.for_model` (or loaded with
    ``load_prompt_cache``) this rank's :class:`HeadShard`. Returns ``caches``."""
    for c in caches:
        if hasattr(c, "method") and hasattr(c, "dist"):  # an eviction cache
            c.dist = HeadShard(group) if group is not None and group.size() > 1 else None
    return caches


def traffic(caches) -> dict:
    """Bytes and collectives the caches exchanged so far (0 for a single process)."""
    shards = [shard_of(c) for c in caches if shard_of(c) is not None]
    return {"bytes": sum(s.bytes_reduced for s in shards), "collectives": sum(s.collectives for s in shards)}


# -- the command line -----------------------------------------------------------------------------

def world():
    """(group, rank, size) of ``mx.distributed.init()`` (a single process: size 1)."""
    if not mx.distributed.is_available():
        return None, 0, 1
    g = mx.distributed.init()
    return g, g.rank(), g.size()


def shard_for_world(model, group=None):
    """Shard a loaded model over the world (``mlx.launch``): tensor parallel when the model has
    ``shard`` and its KV heads split evenly, else pipeline parallel when it has ``pipeline``.
    Returns a short description ("single process", "tensor parallel over 2 ranks", ...)."""
    if group is None:
        group, _, size = world()
    else:
        size = group.size()
    if size <= 1:
        return "single process"
    n_kv = _kv_heads(model)
    inner = getattr(model, "model", None)
    if hasattr(model, "shard") and (n_kv is None or n_kv % size == 0):
        model.shard(group)
        kind = "tensor parallel"
    elif inner is not None and hasattr(inner, "pipeline"):
        inner.pipeline(group)
        kind = "pipeline parallel"
    else:
        raise ValueError(f"{type(model).__module__} cannot be split over {size} ranks: "
                         + (f"its {n_kv} KV heads do not divide by {size} and it has no pipeline mode"
                            if hasattr(model, "shard") else "it has neither shard() nor pipeline()"))
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))  # everyone is ready
    return f"{kind} over {size} ranks"


def setup_cli(model):
    """``python -m veloxquant_mlx generate`` under ``mlx.launch``: shard the loaded model over the
    world and silence stdout on every rank but 0 (each rank generates the same tokens). A single
    process is left untouched. Returns the group (None alone)."""
    import os
    import sys

    group, rank, size = world()
    if size <= 1:
        return None
    how = shard_for_world(model, group)
    if rank > 0:
        sys.stdout = open(os.devnull, "w")
    print(f"distributed: {how}; rank 0 prints; the KV figures below are rank 0's caches "
          f"(its share of the KV heads or layers)", flush=True)
    return group


def _kv_heads(model):
    args = getattr(model, "args", None)
    for name in ("num_key_value_heads", "n_kv_heads", "num_attention_heads"):
        v = getattr(args, name, None)
        if isinstance(v, int):
            return v
    return None
