"""Eviction caches under mlx-lm's distributed generation (``mx.distributed``, ``mlx.launch``).

Tensor parallel (``model.shard(group)``): every attention layer's query and KV heads are split in
contiguous, equal slices across the ranks of the tensor group, so rank ``r`` of ``n`` holds KV heads
``[r * H_l, (r + 1) * H_l)`` of the layer's ``H = n * H_l`` (and the query heads that read them). A
cache only ever sees its rank's heads. :class:`HeadShard` tells the cache where its heads sit in the
layer and carries the few collectives a selection that combines heads needs:

* per-head selections (StreamingLLM, H2O, SnapKV, PyramidKV, MorphKV, Nexus ``per_head=True``) need
  no traffic at all: a KV head's score reads only that head's keys and its own GQA group's queries;
* random draws (Random, Nexus's reservoir) are drawn for the GLOBAL head layout with the same key
  and sliced to the rank's heads (:meth:`HeadShard.uniform`), so every head gets the number one
  process would give it, again without traffic;
* Nexus's layer-shared selection averages a few rows of block statistics over every head:
  one ``all_sum`` of a (B, 1 + walk_depth, N_k) float32 array per layer and eviction step;
* Ada-KV budgets rank every head's scores layer-wide: ``ops.allocation.ada_keep(..., layer=shard)``
  finds the layer-wide top-k with :meth:`HeadShard.top_k_mask` (a radix select: small histograms,
  never the scores), then gathers the per-head winner counts: ~1.1 KiB per layer and step;
* Ada-Nexus (block priorities) and NestedKV's cross-head pool (once per prompt compression) gather
  the small per-head scores (:meth:`HeadShard.across_heads`), run the single-process selection over
  the whole layer and keep their own heads' rows (exact by construction).

Pipeline parallel (``model.model.pipeline(group)``): a rank holds a contiguous slice of the layers;
caches carry the GLOBAL layer index (seed ``config.seed + layer``, PyramidKV's per-layer budget), so
the kept rows are the ones one process keeps; nothing is exchanged.

Collectives are lazy graph nodes like every other MLX op: nothing here syncs with the host, except
where ragged (Ada-KV / NestedKV) storage is cut to its widest head, where the width is already read
back once per eviction step and becomes the group's widest head (:func:`group_max`).
"""

from __future__ import annotations

import mlx.core as mx


RADIX_BITS = 4  # bits of the float key per radix-select round: 8 rounds of a 16-bin histogram


def _order_key(x: mx.array) -> mx.array:
    """uint32 keys in the order of the float32 values (-0.0 counts as 0.0; NaN must be gone)."""
    bits = mx.view(x.astype(mx.float32) + 0.0, mx.uint32)
    neg = mx.right_shift(bits, 31) == 1
    return mx.where(neg, mx.bitwise_invert(bits), mx.bitwise_or(bits, 0x80000000))


class HeadShard:
    """This rank's slice of every layer's KV heads, and the collectives over the tensor group.

    ``bytes_reduced`` / ``collectives`` count what this cache exchanged (payload of an ``all_sum``,
    the gathered result of an ``all_gather``), from shapes only (no host sync).
    """

    def __init__(self, group):
        self.group = group
        self.rank = group.rank()
        self.size = group.size()
        self.bytes_reduced = 0
        self.collectives = 0

    def __repr__(self):
        return f"HeadShard(rank={self.rank}, size={self.size})"

    def __deepcopy__(self, memo):
        """Copies (e.g. batching's per-row caches) share the group (a process-wide handle that cannot
        be copied) and start from this one's counts."""
        new = HeadShard.__new__(HeadShard)
        new.__dict__.update(self.__dict__)
        return new

    # -- head layout ------------------------------------------------------------------------------
    def total_heads(self, n_local: int) -> int:
        return n_local * self.size

    def head_offset(self, n_local: int) -> int:
        """Global index of this rank's first head (equal contiguous slices, as ``shard_linear``)."""
        return n_local * self.rank

    def local(self, x: mx.array, n_local: int, axis: int = 1) -> mx.array:
        """This rank's heads of a global-layout array (heads along ``axis``)."""
        start = self.head_offset(n_local)
        sl = [slice(None)] * x.ndim
        sl[axis] = slice(start, start + n_local)
        return x[tuple(sl)]

    # -- collectives ------------------------------------------------------------------------------
    def _count(self, nbytes: int):
        self.bytes_reduced += int(nbytes)
        self.collectives += 1

    def all_sum(self, x: mx.array) -> mx.array:
        self._count(x.nbytes)
        return mx.distributed.all_sum(x, group=self.group)

    def gather_heads(self, x: mx.array, axis: int = 1) -> mx.array:
        """Concatenate every rank's heads along ``axis``: the global layout (rank order = head order)."""
        if x.dtype == mx.bool_:  # ring all_gather of bools: send them as uint8
            return self.gather_heads(x.astype(mx.uint8), axis).astype(mx.bool_)
        moved = mx.moveaxis(x, axis, 0)
        self._count(moved.nbytes * self.size)
        out = mx.distributed.all_gather(mx.contiguous(moved), group=self.group)
        return mx.moveaxis(out, 0, axis)

    def across_heads(self, fn, *arrays):
        """Run ``fn`` (a layer-wide selection over (B, H, ...) arrays) on the whole layer's heads and
        return its output(s) for this rank's heads only. Every rank runs the same computation on the
        same gathered inputs, so all ranks (and one process) agree exactly."""
        n_local = arrays[0].shape[1]
        out = fn(*(self.gather_heads(a) for a in arrays))
        if isinstance(out, tuple):
            return tuple(self.local(o, n_local) for o in out)
        return self.local(out, n_local)

    def top_k_mask(self, s: mx.array, member: mx.array, k) -> mx.array:
        """Which of this rank's (B, H_l, R) entries are among the layer-wide top ``k`` members.

        The same set as ``argsort(-s)`` ranking over every rank's heads flattened (head-major, the
        global head order), ties to the lower flattened index (MLX's argsort is stable), among the
        ``member`` entries; ``k`` an int or a (B,) array. Without gathering the scores: a radix
        select on the float bits, RADIX_BITS per round (one all_sum of a (B, 2^bits) histogram per
        round), then one all_gather of the per-rank tie counts. Every rank derives the same threshold."""
        B = s.shape[0]
        key = _order_key(s)
        k_rem = (mx.full((B,), k, mx.int32) if isinstance(k, int) else k.astype(mx.int32))[:, None]
        nbins = 1 << RADIX_BITS
        bins = mx.arange(nbins, dtype=mx.uint32)
        active, above = member, mx.zeros(member.shape, mx.bool_)
        for shift in range(32 - RADIX_BITS, -1, -RADIX_BITS):
            digit = mx.bitwise_and(mx.right_shift(key, shift), nbins - 1)
            hit = mx.expand_dims(active, -1) & (mx.expand_dims(digit, -1) == bins)  # (B, H, R, nbins)
            hist = self.all_sum(hit.sum(axis=(1, 2)).astype(mx.int32))  # (B, nbins), whole layer
            cum = mx.cumsum(hist[:, ::-1], axis=-1)  # members in bins >= nbins - 1 - j
            j = mx.minimum((cum < k_rem).sum(axis=-1, keepdims=True), nbins - 1)  # first bin reaching k
            cut = (nbins - 1 - j).astype(mx.uint32)  # the threshold's digit
            higher = mx.where(j > 0, mx.take_along_axis(cum, mx.maximum(j - 1, 0), axis=-1), 0)
            above = above | (active & (digit > cut[:, :, None]))
            active = active & (digit == cut[:, :, None])
            k_rem = k_rem - higher
        # Ties at the threshold: the lower global flattened index first (ranks in head order).
        ties = active.reshape(B, -1)
        n_ties = ties.sum(axis=-1).astype(mx.int32)  # (B,)
        every = self.gather_heads(n_ties[:, None], axis=1)  # (B, size)
        before = (every * (mx.arange(self.size) < self.rank)).sum(axis=-1, keepdims=True)
        take = mx.clip(k_rem - before, 0, None)
        order = mx.cumsum(ties.astype(mx.int32), axis=-1) - 1
        won = (ties & (order < take)).reshape(active.shape)
        return above | won

    def all_max_int(self, x: mx.array) -> int:
        """The group's maximum of a scalar, read back (a host sync: only where one is paid anyway)."""
        self._count(4)
        return int(mx.distributed.all_max(x.astype(mx.int32).reshape(1), group=self.group).item())

    # -- randomness -------------------------------------------------------------------------------
    def uniform(self, key: mx.array, shape, axis: int = 1) -> mx.array:
        """U(0, 1) draws for the global head layout, sliced to this rank's heads.

        ``shape`` is the LOCAL shape with this rank's heads along ``axis``."""
        n_local = shape[axis]
        full = list(shape)
        full[axis] = self.total_heads(n_local)
        return self.local(mx.random.uniform(shape=tuple(full), key=key), n_local, axis)


def shared_block_weights(d: HeadShard, s_sum: mx.array, n_local: int, walk_depth: int, lam: float,
                         eps_tie: float) -> mx.array:
    """Nexus's layer-shared block weights w (B, 1, N_k) when the heads are split across ranks.

    ``s_sum`` (B, W, N_k) is this rank's S_hat summed over its ``n_local`` (KV head x GQA) heads. The
    weights read only two things of the head-averaged S_hat: its mean over the W window rows (the
    direct score) and its last ``walk_depth`` rows (the walk), so one all_sum of (B, 1 + h, N_k)
    float32 gives every rank the same w (h = 0 when ``lam = 0``)."""
    from .ops.nexus import nexus_weights_from_parts

    W = s_sum.shape[-2]
    h = min(int(walk_depth), W) if lam != 0.0 else 0
    part = s_sum.sum(axis=-2, keepdims=True)
    if h:
        part = mx.concatenate([part, s_sum[..., W - h:, :]], axis=-2)
    tot = d.all_sum(part) / float(n_local * d.size)  # (B, 1 + h, N_k): sums over every head -> means
    a = tot[:, None, 0] / float(W)
    return nexus_weights_from_parts(a, tot[:, None, 1:] if h else a, lam, eps_tie)


def head_means(d: HeadShard, k_sum: mx.array, q: mx.array, n_kv_local: int):
    """(k_mean (B, 1, N, D), q_mean (B, 1, W, D)) over every rank's heads, in one all_sum; ``k_sum``
    is this rank's keys summed over its KV heads, ``q`` its window queries (B, Hq_l, W, D)."""
    N = k_sum.shape[2]
    both = d.all_sum(mx.concatenate([k_sum, q.astype(k_sum.dtype).sum(axis=1, keepdims=True)], axis=2))
    return both[:, :, :N] / float(n_kv_local * d.size), both[:, :, N:] / float(q.shape[1] * d.size)


def shard_of(cache) -> HeadShard | None:
    """The cache's :class:`HeadShard`, or None for a single process (or a group of one)."""
    return getattr(cache, "dist", None)


def group_max(cache, x: mx.array) -> int:
    """``int(x.item())`` for one process; the maximum over the tensor group when sharded."""
    d = shard_of(cache)
    return int(x.item()) if d is None else d.all_max_int(x)


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
    args = getattr(model, "args", None)
    total = getattr(args, "num_hidden_layers", None)
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
        if hasattr(c, "select_rows"):
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
