"""KV memory over a model's caches, ours and mlx-lm's alike (each eviction cache reports its own layer:
``EvictionCache.byte_report``)."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache

from .quant import buf_dtype, bytes_per_row, buf_shape, row_dim


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
