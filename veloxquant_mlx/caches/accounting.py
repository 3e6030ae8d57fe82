"""Byte accounting of an eviction cache: what it allocates, keeps, and would hold uncompressed."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .quant import buf_dtype, buf_nbytes, buf_shape, bytes_per_row, row_dim
from .storage import PAD_POSITION


class Accounting:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: allocated / kept / full bytes."""

    @property
    def nbytes(self) -> int:
        """Bytes this cache really holds: the allocated capacity (not just the kept rows) of the
        key/value buffers plus everything kept beside them (positions, per-row method state, the
        observed-query window, method state arrays). Quantized keys/values count their packed
        words, scales and biases. A paged prompt adds what its pages hold in memory (per-row state, rows
        held for the file); the file itself is ``page_disk_bytes`` in :meth:`byte_report`."""
        paged = 0 if self.pages is None else self.pages.resident_bytes
        if self.keys is None:
            return paged + (0 if self._window_q is None else self._window_q.nbytes)
        held = [self.positions, *self.row_extras.values(), self._window_q, *self.extra_state().values()]
        cold = 0 if self.cold is None else self.cold.resident_bytes + self.cold.summary_bytes
        return (buf_nbytes(self.keys) + buf_nbytes(self.values)
                + sum(a.nbytes for a in held if isinstance(a, mx.array)) + cold + paged)

    # Reporting only, never called from update_and_fetch: with ragged storage the kept counts are
    # data, so tokens_kept / kept_bytes read them back from the device (a host sync).
    def _row_bytes(self) -> int:
        """Stored bytes of one kept row (K and V of one head): packed words + scales + biases when
        quantized."""
        return bytes_per_row(self.keys) + bytes_per_row(self.values)

    def _full_row_bytes(self) -> int:
        """Bytes of one row of the uncompressed cache the model would hold (mlx-lm's KVCache: K and V
        in the model's dtype), the reference of ``full_seq_bytes`` whether or not rows are quantized."""
        bits = self.kv_bits
        return (row_dim(self.keys, bits) * buf_dtype(self.keys).size
                + row_dim(self.values, bits) * buf_dtype(self.values).size)

    def kept_per_head(self) -> mx.array:
        """(B, H) number of real kept rows per batch row and KV head."""
        if self.keys is None:
            return mx.zeros((0, 0), mx.int32)
        return (self.stored("positions") != PAD_POSITION).sum(axis=-1)

    def kept_positions(self) -> mx.array:
        """(B, H, rows) absolute positions of the kept rows, -1 for padding."""
        if self.keys is None:
            return mx.zeros((0, 0, 0), mx.int32)
        pos = self.stored("positions")
        return mx.where(pos == PAD_POSITION, -1, pos)

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> float:
        """Kept rows per KV head (mean over batch rows and heads when ragged)."""
        if self.keys is None:
            return 0
        if not self.is_ragged:
            return self._rows
        return self.kept_per_head().astype(mx.float32).mean().item()

    @property
    def kept_bytes(self) -> int:
        if self.keys is None:
            return 0
        B, H = self.positions.shape[:2]
        n = B * H * self._rows if not self.is_ragged else int(self.kept_per_head().sum().item())
        return n * self._row_bytes()

    @property
    def full_seq_bytes(self) -> int:
        if self.keys is None:
            return 0
        B, H = self.positions.shape[:2]
        return B * H * self.offset * self._full_row_bytes()

    @property
    def compression_ratio(self) -> float:
        kept = self.kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0

    def byte_report(self) -> dict:
        """Allocated bytes (what the process holds for this layer), the bytes of the kept rows and
        of the full sequence; ``allocated_fraction`` = allocated / full is the memory a user sees."""
        full, alloc = self.full_seq_bytes, self.nbytes
        # With a cold tier (config.recall), allocated_bytes includes its resident part; the split:
        # hot_bytes + cold_resident_bytes + summary_bytes = allocated_bytes; cold_disk_bytes is on disk.
        cold = {} if self.cold is None else {"hot_bytes": alloc - self.cold.resident_bytes - self.cold.summary_bytes,
                                              **self.cold.report()}
        if self.pages is not None:
            cold.update(self.pages.report())
        return {**cold, "method": self.method, "layer": self.layer_idx, "tokens_seen": self.tokens_seen,
                "tokens_kept": self.tokens_kept, "allocated_bytes": alloc, "kept_bytes": self.kept_bytes,
                "full_seq_bytes": full, "allocated_fraction": alloc / full if full else 0.0,
                "compression_ratio": self.compression_ratio, "evictions": self.evictions}


def kv_report(caches) -> dict:
    """KV memory over all layers, ours and mlx-lm's caches alike: ``allocated_bytes`` (``c.nbytes``:
    what the buffers really hold, capacity included), ``kept_bytes`` (the kept rows' K/V) and
    ``full_bytes`` (K/V of every token seen). ``fraction`` = allocated / full.
    ``kvcache_bytes``: what mlx-lm's ``KVCache`` allocates for the same tokens (a KVCache layer's own
    bytes; for any other cache every token's K/V in the model's dtype, in KVCache's steps of 256 rows),
    the like-for-like reference of ``allocated_bytes`` (a short prompt's KVCache holds 256 rows).
    ``other_allocated_bytes``: the part held by the model's own caches (e.g. the RotatingKVCache of
    sliding-window layers, which preallocate up to their window whatever the prompt length)."""
    alloc = kept = full = other = kvcache = 0
    for c in caches:
        held = c.nbytes if getattr(c, "keys", None) is not None else 0
        alloc += held
        if hasattr(c, "kept_bytes"):
            kept += c.kept_bytes
            layer_full = c.full_seq_bytes
        elif getattr(c, "keys", None) is not None:
            # mlx-lm's QuantizedKVCache holds (words, scales, biases): a tuple, or the list mx.quantize returns
            # when KVCache.to_quantized made it (mlx_lm.generate's --quantized-kv-start)
            k, v = (tuple(b) if isinstance(b, list) else b for b in (c.keys, c.values))
            bits = getattr(c, "bits", None)
            B, H, cap = buf_shape(k, bits)[:3]
            kept += B * H * (bytes_per_row(k) + bytes_per_row(v)) * min(c.offset, cap)
            layer_full = B * H * (row_dim(k, bits) * buf_dtype(k).size + row_dim(v, bits) * buf_dtype(v).size) * c.offset
            other += held
        else:
            continue
        full += layer_full
        kvcache += held if type(c) is KVCache else _kvcache_bytes(layer_full, c.offset)
    return {"allocated_bytes": alloc, "kept_bytes": kept, "full_bytes": full,
            "fraction": alloc / full if full else 0.0, "kvcache_bytes": kvcache,
            "other_allocated_bytes": other, **cold_split(caches)}


def _kvcache_bytes(full_bytes: int, tokens: int) -> int:
    """What a KVCache holding ``tokens`` tokens (``full_bytes`` of K/V) allocates: rows in steps of 256."""
    if not tokens:
        return 0
    return full_bytes // tokens * (-(-tokens // KVCache.step) * KVCache.step)


COLD_KEYS = ("hot_bytes", "cold_resident_bytes", "cold_disk_bytes", "summary_bytes")


def cold_split(caches) -> dict:
    """The byte split of the caches with a cold tier (config.recall), summed over layers; {} when none
    has one. ``hot_bytes`` + ``cold_resident_bytes`` + ``summary_bytes`` is those caches' part of
    ``allocated_bytes``; ``cold_disk_bytes`` is in their files, not in memory."""
    out = dict.fromkeys(COLD_KEYS, 0)
    cold = [c for c in caches if getattr(c, "cold", None) is not None]
    for c in cold:
        t = c.cold
        out["hot_bytes"] += c.nbytes - t.resident_bytes - t.summary_bytes
        out["cold_resident_bytes"] += t.resident_bytes
        out["cold_disk_bytes"] += t.disk_bytes
        out["summary_bytes"] += t.summary_bytes
    return out if cold else {}
