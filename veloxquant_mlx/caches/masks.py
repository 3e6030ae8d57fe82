"""The mask a layer's attention needs over the rows its cache's last ``update_and_fetch`` returned.

mlx-lm builds one mask from ``cache[0]`` and reuses it for every layer, so uniform storage keeps mlx-lm's
string / None masks (right for every layer), and an array mask is rebuilt for this layer's row count.
Ragged per-head storage (Ada-KV, NestedKV) needs a per-head mask that hides its padding rows; in decode it
is built once per positions buffer and sliced after that (between evictions a decode step only appends
real rows). The query tap asks for it (``EvictionCache.attention_mask``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ..ops.select import PAD_POSITION


def is_additive(mask) -> bool:
    """A floating mask holds additive scores, not positions (MLA adds its rotary logits there)."""
    return isinstance(mask, mx.array) and mx.issubdtype(mask.dtype, mx.floating)


def keep_additive(layer_mask, mask: mx.array, queries: mx.array) -> mx.array:
    """An additive ``mask`` kept as it is, with only the padding rows that ``layer_mask`` (a cache's
    ``attention_mask``) hides for this layer set to the dtype's minimum."""
    hide = layer_mask("causal" if queries.shape[2] > 1 else None, queries)
    if not isinstance(hide, mx.array):
        return mask
    if is_additive(hide):  # a decode step's ragged mask (Fetched._decode_mask)
        return mask + hide.astype(mask.dtype)
    return mx.where(hide, mask, mx.array(mx.finfo(mask.dtype).min, mask.dtype))


class Fetched:
    """The rows the last ``update_and_fetch`` returned: the first ``rows`` rows of the positions buffer
    ``store``, or the positions ``given`` (a step that attends to rows it does not store). A mask for this
    step describes these rows even when an eviction ran right after the fetch."""

    __slots__ = ("store", "given", "rows", "ragged", "decode")

    def __init__(self):
        self.store = self.given = None
        self.rows, self.ragged = 0, False
        self.decode = None  # (positions buffer, GQA group, per KV head?, mask over its capacity)

    def note(self, store, rows: int, ragged: bool, given=None) -> None:
        self.store, self.rows, self.ragged, self.given = (None if given is not None else store), rows, ragged, given

    @property
    def positions(self):
        """(B, H, rows) positions of the fetched rows (PAD_POSITION on padding), None before any fetch."""
        return self.store[:, :, :self.rows] if self.store is not None else self.given

    def mask(self, mask, queries: mx.array, q_start: int, per_kv_head: bool):
        """This layer's mask for ``queries`` at positions ``q_start ..``, given the one mlx-lm built from
        cache[0]; ``per_kv_head``: the attention broadcasts a per-KV-head mask over the GQA group (mlx-lm's
        quantized attention does)."""
        array = isinstance(mask, mx.array)
        if array and mx.issubdtype(mask.dtype, mx.floating):  # additive scores (MLA's rotary logits)
            return keep_additive(lambda m, q: self.mask(m, q, q_start, per_kv_head), mask, queries)
        if not self.ragged and not array:
            return mask
        n, store = queries.shape[2], self.store
        if n == 1 and store is not None and self.ragged:  # a decode step: the mask of this positions buffer
            group = queries.shape[1] // store.shape[1]
            return self._decode_mask(group, per_kv_head or group == 1, queries.dtype)
        pos = self.positions
        if pos is None:
            return mask
        rows = pos.shape[-1]
        if not self.ragged:
            return create_causal_mask(n, offset=rows - n)
        group = queries.shape[1] // pos.shape[1]
        per_kv_head = per_kv_head or group == 1
        visible = mx.expand_dims(pos, 2) <= mx.arange(q_start, q_start + n)[:, None]  # (B, H_kv, n, rows)
        return visible if per_kv_head else mx.repeat(visible, group, axis=1)

    def _decode_mask(self, group: int, per_kv_head: bool, dtype) -> mx.array:
        """A decode step's ragged mask, built once per positions buffer: the padding of the rows stored when
        it was built, every later row visible (a single query sees every real row). Additive (0 / -inf in
        the queries' dtype): attention adds it where a boolean mask would take a select and its fill. It is
        attention scratch (about 1 % of the layer's K/V bytes), not counted in the cache's bytes."""
        store, rows, cached = self.store, self.rows, self.decode
        if cached is None or cached[0] is not store or cached[1:3] != (group, per_kv_head) or cached[3].dtype != dtype:
            real = store[..., :rows] != PAD_POSITION
            extra = mx.ones((*real.shape[:2], store.shape[-1] - rows), mx.bool_)
            visible = mx.expand_dims(mx.concatenate([real, extra], axis=-1), 2)  # (B, H_kv, 1, capacity)
            visible = mx.where(visible, mx.array(0.0, dtype), mx.array(-mx.inf, dtype))
            cached = self.decode = (store, group, per_kv_head, visible if per_kv_head else mx.repeat(visible, group, 1))
        return cached[3][..., :rows]


def layer_array_mask(N: int, rows: int, return_array: bool, window_size=None):
    """``make_mask`` of an eviction cache holding ``rows`` rows (see the module docstring)."""
    if window_size is not None:
        raise NotImplementedError("eviction caches serve full-attention layers only; sliding-window layers keep "
                                  "mlx-lm's RotatingKVCache (KVCacheBuilder.for_model does this)")
    if N == 1:  # as mlx-lm's KVCache, even with return_array (phi3small adds the mask it gets to its scores)
        return None
    return create_causal_mask(N, offset=rows) if return_array else "causal"
