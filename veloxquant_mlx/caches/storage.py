"""Row storage of an eviction cache: buffers that hold the kept rows plus exact headroom.

Every buffer change builds a NEW contiguous array (``with_headroom``), so a buffer never pins a larger
one and the allocated bytes follow the kept rows. Prompt text held until the prompt ends grows in
steps like mlx-lm's KVCache; ragged per-head storage is cut to the widest head actually kept.
"""

from __future__ import annotations

import mlx.core as mx

from ..ops import gather_rows
from ..ops.select import gather_rows_of
from .quant import (buf_dtype, buf_parts, buf_shape, check_group, dequantize_rows, from_parts, quantize_rows,
                    row_dim, rows_map, rows_zip)
from .shard import group_max

# Position stored for padding rows (ragged per-head storage); larger than any real position so a
# causal "key position <= query position" test hides it.
PAD_POSITION = 2**31 - 1


def with_headroom(rows, extra: int, fill=0) -> mx.array:
    """A NEW contiguous buffer: ``rows`` (an array, or a list of arrays joined along axis 2) followed by
    ``extra`` rows of ``fill`` along axis 2, in one copy.

    Storage changes go through here (or, for gathered rows, through one gather that includes the
    headroom), so a buffer is never a view that pins a larger array and its capacity is exactly what
    the caller asked for (allocation follows the kept rows)."""
    parts = list(rows) if isinstance(rows, list) else [rows]  # a list joins (not the caller's); a tuple never
    if extra > 0:
        shape = list(parts[0].shape)
        shape[2] = extra
        parts.append(mx.full(shape, fill, parts[0].dtype) if fill else mx.zeros(shape, parts[0].dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.contiguous(parts[0])


class RowStorage:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: append, fetch and size the rows."""

    kv_external = False  # True while the cache is a row of a BatchEvictionCache, which holds its keys/values
    # The positions buffer whose rows past the stored ones already hold the positions they will get (row
    # ``_rows + j`` is appended at ``offset + j``: rows and offset grow together until storage is rebuilt),
    # so an append writes no positions. Growth and eviction build such buffers; a loaded or recalled one
    # is written row by row.
    prefilled = None

    @property
    def is_ragged(self) -> bool:
        """True when heads keep different numbers of rows (padding present)."""
        return bool(getattr(self, "_ragged", False))

    def size(self) -> int:
        return self._rows

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n):
        raise NotImplementedError("eviction caches cannot be trimmed: evicted rows are gone")

    def _check_kv(self, keys, values):
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError("keys and values must be mx.array")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(f"keys/values must be 4-D (B, H_kv, S, D), got {keys.shape} and {values.shape}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on (B, H_kv, S)")
        if keys.shape[2] == 0:
            raise ValueError("update_and_fetch needs at least one new token")
        if not (mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(values.dtype, mx.floating)):
            raise TypeError(f"keys/values must be floating point, got {keys.dtype} and {values.dtype}")
        hd = self.config.head_dim
        if hd is not None and keys.shape[-1] != hd:
            raise ValueError(f"config.head_dim={hd} but the model sends keys with head_dim={keys.shape[-1]}")
        bits = self.kv_bits
        if self.keys is None:
            check_group(keys.shape[-1], bits, self.kv_group_size)
            check_group(values.shape[-1], bits, self.kv_group_size)
        else:
            B, H, _, Dk = buf_shape(self.keys, bits)
            Dv = row_dim(self.values, bits)
            if (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) != (B, H, Dk, Dv):
                raise ValueError(f"new keys {keys.shape}/values {values.shape} do not match the stored "
                                 f"(B={B}, H_kv={H}, D_k={Dk}, D_v={Dv})")
            kd, vd = buf_dtype(self.keys), buf_dtype(self.values)
            if keys.dtype != kd or values.dtype != vd:
                raise TypeError(f"dtype changed: stored {kd}/{vd}, new {keys.dtype}/{values.dtype}")

    def _append(self, keys, values):
        B, H, S, _ = keys.shape
        prev, need = self._rows, self._rows + S
        fields = self.extra_row_fields()
        # A row of a batch (kv_external): the batch stores its keys/values (caches.batch_storage); the
        # row keeps its positions and per-row state only.
        kv = not self.kv_external
        if kv:
            # Quantized storage (config.kv_bits): each new row is quantized once, here, exactly as mlx-lm's
            # QuantizedKVCache does it; later steps only move packed rows.
            keys = quantize_rows(keys, self.kv_bits, self.kv_group_size)
            values = quantize_rows(values, self.kv_bits, self.kv_group_size)
        if self.positions is None or need > self.positions.shape[2]:
            # Prompt text held to the end of the prompt grows like mlx-lm's KVCache (steps of ``step``);
            # a chunk evicted right after this step gets exactly its rows; a single token that does not
            # fit (unbounded decode) adds ``decode_step`` rows. New buffers, never views.
            if S == 1:
                cap = need + self.decode_step
            elif self._evicts_during(S):
                cap = need
            else:
                cap = -(-need // self.step) * self.step
            extra = cap - need

            def grown(old, new, fill):  # one copy of the old rows, the new ones and the headroom
                return with_headroom(new if old is None or not prev else [old[:, :, :prev], new], extra, fill)

            def grown_kv(old, new):
                if old is None or not prev:
                    return rows_map(lambda n: with_headroom(n, extra), new)
                return rows_zip(lambda o, n: grown(o, n, 0), old, new)

            if kv:
                self.keys = grown_kv(self.keys, keys)
                self.values = grown_kv(self.values, values)
            # The headroom already holds the positions its rows will get (see ``prefilled``).
            pos = mx.broadcast_to(mx.arange(self.offset, self.offset + S + extra, dtype=mx.int32), (B, H, S + extra))
            self.positions = self.prefilled = mx.contiguous(pos) if self.positions is None or not prev else \
                mx.concatenate([self.positions[:, :, :prev], pos], axis=2)
            for name, fill in fields.items():
                self.row_extras[name] = grown(self.row_extras.get(name), mx.full((B, H, S), fill, mx.float32), fill)
        else:
            for buf, new in ((self.keys, keys), (self.values, values)) if kv else ():
                parts, rows = (buf, new) if isinstance(buf, tuple) else ((buf,), (new,))
                for part, r in zip(parts, rows, strict=True):
                    part[:, :, prev:need] = r
            if self.prefilled is not self.positions:  # a buffer given (loaded, recalled): write the positions
                self.positions[:, :, prev:need] = (self.offset if S == 1 else
                                                   mx.arange(self.offset, self.offset + S, dtype=mx.int32))
            for name, fill in fields.items():
                if name not in self.rows_written_on_append:
                    self.row_extras[name][:, :, prev:need] = fill
        self._rows = need
        self.offset += S

    def future_positions(self, kept: mx.array, extra: int) -> mx.array:
        """A NEW positions buffer: the ``kept`` rows' positions, then ``extra`` headroom rows holding the
        positions the next appends will get (``prefilled``)."""
        if extra <= 0 or self.dist is not None:  # tensor parallel: padding headroom (see adapter.refresh_light)
            self.prefilled = None  # (and no reference to an old buffer)
            return with_headroom(kept, extra, PAD_POSITION)
        B, H = kept.shape[:2]
        ahead = mx.broadcast_to(mx.arange(self.offset, self.offset + extra, dtype=mx.int32), (B, H, extra))
        self.prefilled = mx.concatenate([kept, ahead], axis=2)
        return self.prefilled

    def _fetch(self):
        r = self._rows
        if r == self.positions.shape[2]:
            return self.keys, self.values
        return rows_map(lambda a: a[:, :, :r], self.keys), rows_map(lambda a: a[:, :, :r], self.values)

    def stored_raw(self, name: str = "keys"):
        """The stored rows of a buffer as held: quantized keys/values stay (words, scales, biases)."""
        if self.keys is None and self.pages is not None and self.pages.closed:
            return self.pages.stored(name)  # every row is in the page file (caches.pages)
        arr = {"keys": self.keys, "values": self.values, "positions": self.positions}.get(name)
        load = getattr(arr, "load", None)
        if load is not None:  # a paged prompt's rows, read back from its file on first use
            arr = load()
            setattr(self, name, arr)
        if arr is None:
            arr = self.row_extras[name]
        r = self._rows
        return rows_map(lambda a: a[:, :, :r], arr)

    def stored(self, name: str = "keys") -> mx.array:
        """The stored rows of ``keys``, ``values``, ``positions`` or a row extra (no padding trim).

        Quantized keys/values come back dequantized: a score that reads key values reads exactly
        the values attention reads (one dequantization of the stored rows per call)."""
        return dequantize_rows(self.stored_raw(name), self.kv_bits, self.kv_group_size)

    def drop_rows(self) -> None:
        """Forget every stored row (they are in the page file: caches.pages)."""
        self.keys = self.values = self.positions = self.prefilled = None
        self.row_extras = {}
        self._rows, self._ragged, self._decode_mask = 0, False, None
        self._fetched_store = self._fetched_given = None

    def close_rows(self, n: int) -> None:
        """An input read against the page file ended: its ``n`` rows are all there (``stored`` reads them)."""
        self._rows = n

    def restore_rows(self, keys, values, positions: mx.array, extras: dict, ragged: bool) -> None:
        """Rows read back from the page file become the stored rows (no headroom: the next append grows)."""
        self.keys, self.values = keys, values
        self.positions, self.prefilled = mx.contiguous(positions), None
        self.row_extras = extras
        self._rows, self._ragged, self._decode_mask, self._light_rows = positions.shape[2], ragged, None, 0

    @property
    def kv_shape(self) -> tuple:
        """Logical (B, H_kv, capacity, D_k) of the key buffer (quantized or not)."""
        return buf_shape(self.keys, self.kv_bits)

    def compact(self, idx: mx.array, real: mx.array | None) -> mx.array:
        """Keep the stored rows ``idx`` (B, H, K) (ragged: ``real`` marks the real ones, the others become
        padding) in new buffers with the headroom until the next eviction. Returns the kept row indices
        (ragged storage: cut to the widest head)."""
        if real is not None:
            idx, real = self.trim_ragged(idx, real)
        K = idx.shape[-1]
        # The kept rows go into NEW buffers of exactly K + headroom rows (allocation follows the budget).
        # Never an in-place `buf[:, :, :K] = ...`: this step's attention still holds the slice
        # update_and_fetch returned, and an in-place write made that slice read the compacted rows
        # (measured: a chunk that triggered eviction attended to wrong keys). Gathering from the whole
        # buffers (row indices are < rows) keeps the flattening free.
        extra = self.headroom_after_eviction(K)
        # Keys/values with their headroom in ONE gather (headroom rows repeat row 0; they are overwritten
        # before anything reads them): a gather then a concatenate with zeros copied the kept rows twice,
        # and MLX's CPU concatenate cost ~3x the gather (measured at 442 x 8 x 128 fp32 rows).
        # Quantized rows: packed words, scales and biases are gathered alike (never requantized).
        k_idx = idx if extra <= 0 else mx.concatenate([idx, mx.zeros((*idx.shape[:-1], extra), idx.dtype)], -1)
        # A paged prompt's rows not read back yet (caches.pages.PagedRows): only the kept ones are read.
        paged = {name: getattr(buf, "gather", None) for name, buf in (("keys", self.keys), ("values", self.values))}
        bufs = [buf for name, buf in (("keys", self.keys), ("values", self.values)) if paged[name] is None]
        parts = [buf_parts(b) for b in bufs]
        kept = gather_rows_of([p for ps in parts for p in ps], k_idx)  # one shared row index for all of them
        for name in ("keys", "values"):
            if paged[name] is not None:
                setattr(self, name, paged[name](k_idx))
            else:
                ps = parts.pop(0)
                setattr(self, name, from_parts(kept[:len(ps)], getattr(self, name)))
                kept = kept[len(ps):]
        pos = gather_rows(self.positions, idx)
        if real is not None:
            pos = mx.where(real, pos, PAD_POSITION)
        self._ragged = real is not None
        self.positions = self.future_positions(pos, extra)
        for name in self.row_extras:
            self.row_extras[name] = with_headroom(gather_rows(self.row_extras[name], idx), extra)
        self._rows = K
        return idx

    def headroom_after_eviction(self, kept: int) -> int:
        """Rows allocated beyond the ``kept`` ones: what the method needs before its next eviction
        step (decode-bounded: up to the threshold plus the one token that crosses it, so sized by the
        rows this step keeps, ``keep_rows``, as the threshold is), or one ``decode_step`` for
        prefill-only methods, whose decode appends."""
        if self.prefill_only:
            return self.decode_step
        return max(self.keep_rows(), kept) + self.slack + 1 - kept

    def trim_ragged(self, idx: mx.array, real: mx.array):
        """Cut ragged storage to the largest head actually kept (real rows first in every head).

        The width is data: reading it back is a host sync, paid once per ragged eviction step (once
        per prompt for NestedKV, once per ``slack`` decode tokens for Ada-KV), never per token."""
        width = max(self.ragged_width(real.sum(axis=-1)), 1)
        return idx[..., :width], real[..., :width]

    def ragged_width(self, counts: mx.array) -> int:
        """The largest of the (B, H) per-head kept counts, read back to size ragged storage (the one
        host sync of ragged storage; under tensor parallelism the widest head of the whole group)."""
        return group_max(self, counts.max())
