"""The caches' side of tensor parallelism: a rank's slice of the KV heads and the collectives over it.

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

Finding a model's groups, pipeline layer spans and the ``mlx.launch`` launcher are mlx-lm glue:
``veloxquant_mlx.distributed``.

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


def shard_of(cache) -> HeadShard | None:
    """The cache's :class:`HeadShard`, or None for a single process (or a group of one)."""
    return getattr(cache, "dist", None)


def group_max(shard, x: mx.array) -> int:
    """``int(x.item())`` for one process (``shard`` None); the maximum over the tensor group when sharded."""
    return int(x.item()) if shard is None else shard.all_max_int(x)
