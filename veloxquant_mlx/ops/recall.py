"""Recall scoring: Quest's page bound, page summaries, the rows of chosen pages and the rows an
eviction step drops. Pure MLX, no state, no Python loops over heads, pages or rows.

Shapes: B batch rows, H KV heads, G query heads per KV head, W queries, D head_dim, P rows per page.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from .attention import group_queries
from .select import gather_rows_of

PAD = 2**31 - 1  # position of padding rows (same sentinel as ops.select.PAD_POSITION)
_KEPT_LAST = 2**30  # sorts kept rows after evicted ones (one constant for every row count: compiled once)


def page_summaries(keys: mx.array, positions: mx.array, page: int, dtype=None):
    """Elementwise (min, max) of each page's real keys: keys (B, H, n*page, D), positions
    (B, H, n*page) -> two (B, H, n, D). Padding rows are left out (a page of padding only keeps
    +inf / -inf, so its bound is -inf and it is never read back)."""
    B, H, N, D = keys.shape
    real = mx.expand_dims(positions != PAD, -1)
    k = keys.astype(mx.float32)
    lo = mx.where(real, k, mx.inf).reshape(B, H, N // page, page, D).min(axis=3)
    hi = mx.where(real, k, -mx.inf).reshape(B, H, N // page, page, D).max(axis=3)
    dtype = dtype or keys.dtype
    if dtype == mx.float16:  # finite in 16 bits (keys beyond its range are clipped, the bound only ranks)
        lo, hi = mx.clip(lo, -65504, 65504), mx.clip(hi, -65504, 65504)
    return lo.astype(dtype), hi.astype(dtype)


def quest_bounds(queries: mx.array, kmin: mx.array, kmax: mx.array) -> mx.array:
    """Quest's upper bound of q·k over a page, sum_d max(q_d min_d, q_d max_d), taken at its largest
    over the queries and the query heads of each KV head: (B, Hq, W, D) x (B, H, n, D) -> (B, H, n).

    max(q min, q max) = relu(q) max + min(q, 0) min, so the bound is two matmuls."""
    q = group_queries(queries.astype(mx.float32), kmin.shape[1])  # (B, H, G, W, D)
    lo = mx.expand_dims(kmin.astype(mx.float32), 2)
    hi = mx.expand_dims(kmax.astype(mx.float32), 2)
    bound = mx.maximum(q, 0) @ hi.swapaxes(-1, -2) + mx.minimum(q, 0) @ lo.swapaxes(-1, -2)
    bound = bound.max(axis=(2, 3))
    # A page of padding only (min +inf > max -inf) gets -inf; its infinities reach no other page's
    # bound (one column of each product), so no isfinite pass over the summaries (16-bit on the CPU: slow).
    empty = kmin[..., 0] > kmax[..., 0]
    return mx.where(empty, -mx.inf, bound)


def top_pages(bounds: mx.array, m: int) -> mx.array:
    """(B, H, m) indices of the m pages with the largest bound, ascending."""
    n = bounds.shape[-1]
    if m >= n:
        return mx.broadcast_to(mx.arange(n, dtype=mx.int32), bounds.shape)
    return mx.sort(mx.argpartition(-bounds, kth=m - 1, axis=-1)[..., :m], axis=-1).astype(mx.int32)


def page_rows(pages: mx.array, page: int) -> mx.array:
    """(B, H, m) page indices -> (B, H, m*page) row indices of those pages, in page order."""
    rows = mx.expand_dims(pages, -1) * page + mx.arange(page, dtype=mx.int32)
    return rows.reshape(*pages.shape[:-1], -1)


def evicted_rows(kept: mx.array, rows: int) -> mx.array:
    """The rows of ``[0, rows)`` not in ``kept`` (B, H, K), ascending: (B, H, rows - K). The count is
    a Python int (uniform storage), so this is a static-shaped, lazy graph."""
    K = kept.shape[-1]
    gone = mx.ones((*kept.shape[:-1], rows), mx.bool_)
    gone = mx.put_along_axis(gone, kept.astype(mx.int32), mx.array(False), axis=-1)
    r = mx.arange(rows, dtype=mx.int32)
    order = mx.argsort(mx.where(gone, r, r + _KEPT_LAST), axis=-1).astype(mx.int32)
    return order[..., :rows - K]


# -- compiled composites: on MLX's CPU backend every op costs ~0.08 ms however small, and a recall runs
# on the order of 100 per layer (measured: recall and its cold writes added 53-62 % to a follow-up's prefill at 8K).
@functools.lru_cache(maxsize=16)
def _picker(m: int):
    return mx.compile(lambda q, kmin, kmax: top_pages(quest_bounds(q, kmin, kmax), m))


def pick_pages(queries: mx.array, kmin: mx.array, kmax: mx.array, m: int) -> mx.array:
    """``top_pages(quest_bounds(...), m)`` as one compiled graph: (B, H, min(m, n)) page indices."""
    return _picker(min(m, kmin.shape[2]))(queries, kmin, kmax)


@mx.compile
def _ordered(hot_pos, cold_pos, hot, cold):
    pos = mx.concatenate([hot_pos, cold_pos], axis=2)
    order = mx.argsort(pos, axis=-1).astype(mx.int32)
    out = gather_rows_of([pos] + [mx.concatenate([h, c], axis=2) for h, c in zip(hot, cold)], order)
    return out[0], out[1:]


def join_in_order(hot_pos: mx.array, cold_pos: mx.array, hot: list, cold: list):
    """Hot rows and recalled rows as one set in position order: (positions (B, H, R + M), [each hot
    buffer (B, H, R, ...) joined with its cold counterpart (B, H, M, ...)]), one compiled graph."""
    return _ordered(hot_pos, cold_pos, list(hot), list(cold))


@mx.compile
def _gone(kept, positions, buffers):
    rows = positions.shape[-1]
    out = gather_rows_of([positions, *buffers], evicted_rows(kept, rows))
    return out[0], out[1:]


def gather_evicted(kept: mx.array, positions: mx.array, buffers: list):
    """The rows of the stored ``positions`` (B, H, rows) and ``buffers`` (each (B, H, rows, ...)) that
    ``kept`` (B, H, K) leaves out, ascending: (positions, [buffers]), one compiled graph."""
    return _gone(kept, positions, list(buffers))


@functools.lru_cache(maxsize=16)
def _summarizer(page: int, dtype):
    return mx.compile(lambda keys, positions: page_summaries(keys, positions, page, dtype))


def summarize_pages(keys: mx.array, positions: mx.array, page: int, dtype) -> tuple:
    """:func:`page_summaries` as one compiled graph."""
    return _summarizer(page, dtype)(keys, positions)
