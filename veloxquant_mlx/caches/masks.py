"""What the attention of a step reads of an eviction cache beside its rows: which rows the last fetch
returned (``note_fetched``) and the mask over them. Uniform storage keeps mlx-lm's masks; ragged
per-head storage (Ada-KV, NestedKV) needs a per-head mask that hides its padding rows, built once per
buffer in decode (``decode_mask``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .storage import PAD_POSITION



def is_additive(mask) -> bool:
    """A floating mask holds additive scores, not positions (MLA adds its rotary logits there)."""
    return isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating)


def keep_additive(layer_mask, mask: mx.array, queries: mx.array) -> mx.array:
    """An additive ``mask`` kept as it is, with only the padding rows that ``layer_mask`` (a cache's
    ``attention_mask``) hides for this layer set to the dtype's minimum."""
    hide = layer_mask("causal" if queries.shape[2] > 1 else None, queries)
    if not isinstance(hide, mx.array):
        return mask
    return mx.where(hide, mask, mx.array(mx.finfo(mask.dtype).min, mask.dtype))

class AttentionMasks:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: the fetched rows and their mask."""

    def note_fetched(self, positions: mx.array | None = None) -> None:
        """Record the rows this step attends to (the tap's mask describes them): the stored rows, or
        ``positions`` when the step attends to more (rows it will not store)."""
        self._fetched_store = self.positions if positions is None else None
        self._fetched_given, self._fetched_rows = positions, self._rows
        self._fetched_ragged = self.is_ragged

    @property
    def fetched_positions(self):
        """(B, H, rows) positions of the rows the last ``update_and_fetch`` returned (PAD_POSITION for
        padding), or None before the first one: a mask for this step must describe these rows even
        when an eviction ran right after the fetch."""
        if self._fetched_store is not None:
            return self._fetched_store[:, :, :self._fetched_rows]
        return self._fetched_given

    @property
    def fetched_ragged(self) -> bool:
        """Whether the rows the last ``update_and_fetch`` returned held padding (ragged heads)."""
        return self._fetched_ragged

    def attention_mask(self, mask, queries: mx.array):
        """The mask this layer's attention should use, given the one mlx-lm built from cache[0].

        Uniform storage keeps the string/None masks (they are right for every layer). An array mask
        was built for cache[0]'s row count, so it is rebuilt for ours; ragged storage needs a
        per-head mask that hides padding rows. A floating mask holds additive scores, not positions
        (MLA adds its rotary logits there): it is kept, with only this layer's padding rows hidden.
        """
        if is_additive(mask):
            return keep_additive(self.attention_mask, mask, queries)
        pos = self.fetched_positions  # the rows this step attends to (before any eviction after it)
        if pos is None:
            pos, ragged = self.positions[..., :self._rows], self.is_ragged
        else:
            ragged = self._fetched_ragged
        if not ragged and not isinstance(mask, mx.array):
            return mask
        rows, n_queries = pos.shape[-1], queries.shape[2]
        if not ragged:
            return create_causal_mask(n_queries, offset=rows - n_queries)
        if n_queries == 1 and self._fetched_store is not None:
            return self.decode_mask(self._fetched_store, rows, queries)
        q_start = self.offset if self._reading else self.offset - n_queries  # a reading pass stores nothing
        return self.ragged_mask(pos, mx.arange(q_start, q_start + n_queries), queries)

    def decode_mask(self, store: mx.array, rows: int, queries: mx.array) -> mx.array:
        """A decode step's ragged mask: ``ragged_mask`` for one query over the first ``rows`` rows of the
        positions buffer ``store``, built once per buffer and sliced after that.

        An eviction, a growth, a recall or a load gives ``positions`` a new buffer; between them a decode
        step only writes real rows after the stored ones (``_append``), and a single query sees every real
        row. So the mask is the padding of the rows stored when it was built, then all visible: nothing to
        recompute per token (a GPU decode step is bound by the operations the host builds; docs/gpu.md).
        The mask (B x H_q x capacity booleans, about 1 % of the layer's K/V bytes) is attention scratch, like
        the per-step mask it replaces: it is not in ``nbytes``, which counts the stored rows and their state."""
        group = queries.shape[1] // store.shape[1]
        per_kv_head = group == 1 or self.kv_bits is not None
        cached = self._decode_mask
        if cached is None or cached[0] is not store or cached[1:3] != (group, per_kv_head):
            real = store[..., :rows] != PAD_POSITION  # rows after these are appended, all real
            extra = mx.ones((*real.shape[:2], store.shape[-1] - rows), mx.bool_)
            visible = mx.concatenate([real, extra], axis=-1)
            visible = mx.expand_dims(visible, 2)  # (B, H_kv, 1, capacity)
            cached = (store, group, per_kv_head, visible if per_kv_head else mx.repeat(visible, group, axis=1))
            self._decode_mask = cached
        return cached[3][..., :rows]

    def ragged_mask(self, pos: mx.array, q_pos: mx.array, queries: mx.array) -> mx.array:
        """Per-head mask: row positions ``pos`` (B, H_kv, rows) visible to query positions ``q_pos``."""
        visible = mx.expand_dims(pos, 2) <= q_pos[:, None]  # (B, H_kv, N, rows)
        group = queries.shape[1] // pos.shape[1]
        # mlx-lm's quantized attention scores GQA as (B, H_kv, group, N, rows) and broadcasts a 4-D mask
        # over the group axis, so it takes the per-KV-head mask as is; the fp path wants one per query head.
        if group == 1 or self.kv_bits is not None:
            return visible
        return mx.repeat(visible, group, axis=1)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise NotImplementedError(
                "eviction caches serve full-attention layers only; sliding-window layers keep "
                "mlx-lm's RotatingKVCache (KVCacheBuilder.for_model does this)")
        if N == 1:  # as mlx-lm's KVCache, even with return_array (phi3small adds the mask it gets to its scores)
            return None
        if return_array:
            return create_causal_mask(N, offset=self._rows)
        return "causal"
