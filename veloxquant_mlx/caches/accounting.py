"""KV memory over a model's caches, ours and mlx-lm's alike (each eviction cache reports its own layer:
``EvictionCache.byte_report``)."""

from __future__ import annotations

from .quant import buf_dtype, bytes_per_row, buf_shape, row_dim


def kv_report(caches) -> dict:
    """KV memory over all layers, ours and mlx-lm's caches alike: ``allocated_bytes`` (``c.nbytes``:
    what the buffers really hold, capacity included), ``kept_bytes`` (the kept rows' K/V) and
    ``full_bytes`` (K/V of every token seen). ``fraction`` = allocated / full is what a user sees.
    ``other_allocated_bytes``: the part held by the model's own caches (e.g. the RotatingKVCache of
    sliding-window layers, which preallocate up to their window whatever the prompt length)."""
    alloc = kept = full = other = 0
    for c in caches:
        held = c.nbytes if getattr(c, "keys", None) is not None else 0
        alloc += held
        if hasattr(c, "kept_bytes"):
            kept += c.kept_bytes
            full += c.full_seq_bytes
        elif getattr(c, "keys", None) is not None:
            k, v = c.keys, c.values  # mlx-lm's QuantizedKVCache holds (words, scales, biases) tuples
            bits = getattr(c, "bits", None)
            B, H, cap = buf_shape(k, bits)[:3]
            kept += B * H * (bytes_per_row(k) + bytes_per_row(v)) * min(c.offset, cap)
            full += B * H * (row_dim(k, bits) * buf_dtype(k).size + row_dim(v, bits) * buf_dtype(v).size) * c.offset
            other += held
    return {"allocated_bytes": alloc, "kept_bytes": kept, "full_bytes": full,
            "fraction": alloc / full if full else 0.0, "other_allocated_bytes": other, **cold_split(caches)}


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
