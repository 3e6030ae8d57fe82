"""Top-k row selection with forced sinks / recent rows, and the row gather that applies it."""

from __future__ import annotations

import functools

import mlx.core as mx

# Position stored for padding rows (ragged per-head storage); larger than any real position so a
# causal "key position <= query position" test hides it.
PAD_POSITION = 2**31 - 1


@functools.partial(mx.compile, shapeless=False)
def _forced_top(scores: mx.array, forced: mx.array, k: int) -> mx.array:
    # Forced rows get +inf so they always win; NaN scores lose to everything.
    s = mx.where(mx.isnan(scores), -mx.inf, scores.astype(mx.float32))
    s = mx.where(forced, mx.inf, s)
    top = mx.argpartition(-s, kth=k - 1, axis=-1)[..., :k]
    return mx.sort(top, axis=-1)


def keep_top_rows(scores: mx.array, k: int, n_sink: int, n_recent: int) -> mx.array:
    """Indices (ascending) of the ``k`` rows to keep along the last axis of ``scores``.

    The first ``n_sink`` and last ``n_recent`` rows are always kept (stored rows are in position
    order, so these are the attention sinks and the recent window); the rest are the highest
    scores. ``scores`` is (..., rows); returns int32 (..., k).
    """
    rows = scores.shape[-1]
    if k >= rows:
        return mx.broadcast_to(mx.arange(rows, dtype=mx.int32), scores.shape)
    idx = mx.arange(rows)
    forced = (idx < n_sink) | (idx >= rows - n_recent)
    return _forced_top(scores, forced, k).astype(mx.int32)


def flat_rows(idx: mx.array, like: mx.array) -> mx.array:
    """Row indices ``idx`` (B, H, k; or broadcast to it) of buffers shaped like ``like`` (B, H, rows, ...), as
    indices into them flattened to (B * H * rows, ...): one index for every buffer moved alike.

    The offsets are an arange with a step, not ``arange * rows``: inside mx.compile a Python scalar
    becomes a literal of the fused kernel, so every new row count recompiled it (~1 s on the CPU)."""
    B, H, rows = like.shape[:3]
    offsets = mx.arange(0, B * H * rows, rows, dtype=mx.int32).reshape(B, H, 1)
    return (idx.astype(mx.int32) + offsets).reshape(-1)


def take_rows(x: mx.array, flat: mx.array, k: int) -> mx.array:
    """The rows ``flat`` (from :func:`flat_rows`) of ``x`` (B, H, rows, ...): (B, H, k, ...)."""
    B, H, rows = x.shape[:3]
    rest = x.shape[3:]
    return mx.take(x.reshape(B * H * rows, *rest), flat, axis=0).reshape(B, H, k, *rest)


def gather_rows(x: mx.array, idx: mx.array) -> mx.array:
    """``x[b, h, idx[b, h, i], ...]`` for x of shape (B, H, rows, ...) and idx (B, H, k).

    One ``mx.take`` of whole rows from the flattened array: on MLX's CPU backend
    ``take_along_axis`` gathers element by element and measured 10-20x slower at 8K rows (it
    dominated the eviction step). Pass the whole contiguous buffer, not a sliced view, so the
    reshape is free.
    """
    return take_rows(x, flat_rows(idx, x), idx.shape[-1])


def gather_rows_of(buffers, idx: mx.array) -> list:
    """:func:`gather_rows` of every buffer (each (B, H, rows, ...), the same rows) with one shared index:
    each further buffer costs its gather only (MLX's compile does not merge the index arithmetic)."""
    buffers = list(buffers)
    if not buffers:
        return []
    lead = buffers[0].shape[:3]
    if any(b.shape[:3] != lead for b in buffers):
        raise ValueError(f"gather_rows_of needs buffers of one (B, H, rows), got {[b.shape[:3] for b in buffers]}")
    flat = flat_rows(idx, buffers[0])
    return [take_rows(b, flat, idx.shape[-1]) for b in buffers]