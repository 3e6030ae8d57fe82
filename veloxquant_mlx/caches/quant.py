"""Quantized row storage in mlx-lm's ``QuantizedKVCache`` layout.

A quantized buffer is the tuple ``(words, scales, biases)`` that ``mx.quantize`` returns for rows of
shape (B, H, rows, D): ``words`` (B, H, rows, D * bits / 32) uint32, ``scales`` and ``biases``
(B, H, rows, D / group_size) in the keys' dtype. mlx-lm's ``scaled_dot_product_attention`` reads
exactly this tuple when the cache has ``bits`` / ``group_size`` (``quantized_scaled_dot_product_
attention``), so no model code changes. Every row op (grow, slice, gather, write) maps over the three
parts alike: an eviction gathers packed rows with their own scales and biases and never requantizes.

A plain ``mx.array`` passes through every helper unchanged, so unquantized storage uses the same
code paths.
"""

from __future__ import annotations

import mlx.core as mx

from ..config import KV_GROUP_SIZES


def rows_map(fn, buf):
    """``fn`` applied to a plain buffer, or to each part of a quantized one (same tuple shape)."""
    if isinstance(buf, tuple):
        return tuple(fn(part) for part in buf)
    return fn(buf)


def quantize_rows(x: mx.array, bits: int | None, group_size: int):
    """New rows as stored: ``x`` itself (bits None) or its (words, scales, biases)."""
    if bits is None:
        return x
    return tuple(mx.quantize(x, group_size=group_size, bits=bits))


def dequantize_rows(buf, bits: int | None, group_size: int) -> mx.array:
    """The values a stored buffer stands for (what attention reads), in the scales' dtype."""
    if not isinstance(buf, tuple):
        return buf
    words, scales, biases = buf
    return mx.dequantize(words, scales, biases, group_size=group_size, bits=bits)


def row_dim(buf, bits: int | None) -> int:
    """Logical head_dim D of a stored buffer."""
    if isinstance(buf, tuple):
        return buf[0].shape[-1] * 32 // bits
    return buf.shape[-1]


def buf_shape(buf, bits: int | None) -> tuple:
    """Logical (B, H, capacity, D) of a stored buffer."""
    first = buf[0] if isinstance(buf, tuple) else buf
    return (*first.shape[:3], row_dim(buf, bits))


def buf_dtype(buf):
    """The dtype the rows stand for (a quantized buffer's scales carry it)."""
    return buf[1].dtype if isinstance(buf, tuple) else buf.dtype


def buf_nbytes(buf) -> int:
    """Allocated bytes of a buffer: packed words + scales + biases when quantized."""
    if buf is None:
        return 0
    if isinstance(buf, tuple):
        return sum(p.nbytes for p in buf)
    return buf.nbytes


def bytes_per_row(buf) -> int:
    """Stored bytes of one row of one head (packed words, scales and biases when quantized)."""
    parts = buf if isinstance(buf, tuple) else (buf,)
    return sum(p.shape[-1] * p.dtype.size for p in parts)


def check_group(head_dim: int, bits: int | None, group_size: int) -> None:
    """A clear error when the model's head_dim cannot be stored in groups of ``group_size``."""
    if bits is not None and head_dim % group_size:
        raise ValueError(f"kv_group_size={group_size} does not divide the model's head_dim={head_dim}: "
                         f"quantized rows need whole groups (pick one of "
                         f"{[g for g in KV_GROUP_SIZES if head_dim % g == 0] or 'none: use kv_bits=None'})")


def buf_parts(buf) -> list:
    """The arrays of a buffer: ``[buf]``, or a quantized one's ``[words, scales, biases]``."""
    return list(buf) if isinstance(buf, tuple) else [buf]


def from_parts(parts: list, like):
    """:func:`buf_parts` undone: a buffer of the same kind as ``like`` from its arrays."""
    return tuple(parts) if isinstance(like, tuple) else parts[0]


def rows_zip(fn, *bufs):
    """``fn`` over matching parts of several buffers of the same kind (plain or quantized)."""
    if isinstance(bufs[0], tuple):
        return tuple(fn(*parts) for parts in zip(*bufs, strict=True))
    return fn(*bufs)


def model_caches(model, kv_bits: int | None = None, kv_group_size: int = 64) -> list:
    """The model's own caches (no eviction); with ``kv_bits``, mlx-lm's ``QuantizedKVCache`` on the
    layers that would hold a plain ``KVCache`` (sliding-window layers keep theirs)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    if kv_bits is None:
        return caches
    return [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c for c in caches]
