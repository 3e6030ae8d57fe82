"""The cold tier of recallable eviction (``KVCacheConfig(recall="memory" | "disk")``, docs/recall.md).

The hot tier is the cache as every method keeps it. The rows an eviction step drops come here instead
of being discarded: in pages of ``recall_page`` rows per KV head, each row with its absolute position
(keys are stored already rotated, so a recalled row needs no re-rotation), and per page and KV head
the elementwise min and max of its keys (Quest's summaries) in memory.

When a new multi-token input arrives on a cache that has evicted (a follow-up turn), its queries
bound every page's attention (``ops.recall.quest_bounds``), the best ``recall_pages`` pages per head
are read back and scored exactly together with the hot rows, and the hot rows that lose to a cold row
trade places with it: the hot tier keeps its row count, the cold pages take the displaced rows.

* ``"memory"``: cold rows quantized at ``recall_bits`` (mlx-lm's layout, groups of 32); every step is
  lazy MLX work, no host sync anywhere.
* ``"disk"``: cold rows at full precision in a file this tier owns (removed when the cache is freed or
  the process exits). Writing needs materialized arrays, so evicted pages wait in memory ("pending")
  and are written at the end of a prompt's one-shot compression and at each recall: one host sync per
  layer there, never per decode token (decode-time evictions stay pending until the next of those).
"""

from __future__ import annotations

import mlx.core as mx

from ..ops import gather_rows
from ..ops.recall import (evicted_rows, exact_row_scores, page_rows, page_summaries, quest_bounds,
                          swap_selection, top_pages)
from .quant import buf_nbytes, dequantize_rows, quantize_rows, rows_map, rows_zip
from .storage import PAD_POSITION, with_headroom

COLD_GROUP = 32  # cold rows' quantization group along head_dim ("memory" tier)


def put_rows(buf: mx.array, idx: mx.array, rows: mx.array) -> mx.array:
    """``buf`` with ``buf[b, h, idx[b, h, i]] = rows[b, h, i]`` (a new array; buf (B, H, N, ...))."""
    B, H, N = buf.shape[:3]
    rest = buf.shape[3:]
    offsets = (mx.arange(B * H, dtype=mx.int32) * N).reshape(B, H, 1)
    flat = buf.reshape(B * H * N, *rest)
    flat[(idx.astype(mx.int32) + offsets).reshape(-1)] = rows.reshape(-1, *rest)
    return flat.reshape(buf.shape)


def _grown(buf, need: int):
    """``buf`` (or each part) with room for ``need`` rows along axis 2, doubling (a new array)."""
    def grow(a):
        cap = a.shape[2]
        if need <= cap:
            return a
        return with_headroom(a, max(need, 2 * cap) - cap)
    return rows_map(grow, buf)


class ColdTier:
    """What both tiers share: evicted rows in pages, summaries, the recall step."""

    def __init__(self, config):
        self.page, self.pages, self.window = config.recall_page, config.recall_pages, config.recall_window
        self.kmin = self.kmax = None  # (B, H, page capacity, D) summaries in the keys' dtype
        self.n_pages = 0
        self.armed = False  # a new multi-token input arrived: recall with its queries when it ends
        self.q = None  # the last ``window`` queries of that input
        self.recalls = 0

    # -- hooks of EvictionCache ---------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Called with the first keys a cache receives (before anything is stored or dropped)."""

    def arm(self) -> None:
        self.armed, self.q = self.n_pages > 0, None

    def evicted(self, cache, kept: mx.array, real) -> None:
        """Called by ``EvictionCache._evict`` before it replaces the hot buffers: ``kept`` (B, H, K) are
        the row indices the method keeps, so every other stored row comes here."""
        if real is not None:
            raise ValueError("recall needs uniform per-head storage, and this eviction step keeps ragged "
                             "heads: nothing was evicted (use allocation='uniform')")
        rows, K = cache.size(), kept.shape[-1]
        E = rows - K
        if E <= 0:
            return
        gone = evicted_rows(kept, rows)
        keys = dequantize_rows(rows_map(lambda a: gather_rows(a, gone), cache.keys), cache.kv_bits,
                               cache.kv_group_size)
        values = dequantize_rows(rows_map(lambda a: gather_rows(a, gone), cache.values), cache.kv_bits,
                                 cache.kv_group_size)
        pos = gather_rows(cache.positions, gone)
        pad = -E % self.page  # whole pages; padding rows carry PAD_POSITION and never count
        if pad:
            keys, values = with_headroom(keys, pad), with_headroom(values, pad)
            pos = with_headroom(pos, pad, PAD_POSITION)
        self._add_summaries(*page_summaries(keys, pos, self.page))
        self.store(keys, values, pos)
        if cache.compressing_prompt:
            self.flush()

    def _add_summaries(self, lo, hi):
        n = lo.shape[2]
        if self.kmin is None:
            self.kmin, self.kmax = lo, hi
        else:
            need = self.n_pages + n
            self.kmin, self.kmax = _grown(self.kmin, need), _grown(self.kmax, need)
            self.kmin[:, :, self.n_pages:need] = lo
            self.kmax[:, :, self.n_pages:need] = hi
        self.n_pages += n

    def note_queries(self, queries: mx.array) -> None:
        """Keep the new input's last ``window`` queries (a copy: a view would pin the whole chunk's)."""
        W = self.window
        if self.q is not None and queries.shape[2] < W:
            queries = mx.concatenate([self.q, queries], axis=2)
        self.q = mx.contiguous(queries[:, :, -W:])

    def recall(self, cache, scale: float) -> None:
        """At the end of a new input (right after its one-shot compression): swap the cold rows that
        its queries attend to more than to hot rows into the hot tier."""
        q, self.q, self.armed = self.q, None, False
        self.flush()
        n = self.n_pages
        if n == 0 or q is None:
            return
        pages = top_pages(quest_bounds(q, self.kmin[:, :, :n], self.kmax[:, :, :n]), min(self.pages, n))
        rows = page_rows(pages, self.page)
        ck, cv, cpos = self.read(pages, rows)
        R = cache.size()
        hot_pos = cache.stored("positions")
        all_k = mx.concatenate([cache.stored("keys").astype(ck.dtype), ck], axis=2)
        all_pos = mx.concatenate([hot_pos, cpos], axis=2)
        # sinks and the recent window stay, as in every method; everything else competes
        forced = (all_pos < cache.n_sink) | ((all_pos >= cache.offset - cache.recent) & (all_pos != PAD_POSITION))
        forced = forced & (mx.arange(all_pos.shape[-1]) < R)  # only hot rows are forced
        hot, cold = swap_selection(exact_row_scores(q, all_k, scale), all_pos, forced, R)
        # The hot tier in its own format: its rows as held (exact), the candidates converted once.
        bits, gs = cache.kv_bits, cache.kv_group_size
        cap = cache.positions.shape[2]

        def rebuilt(held, cand):
            joined = rows_zip(lambda h, c: mx.concatenate([h, c], axis=2), held, quantize_rows(cand, bits, gs))
            return rows_map(lambda a: with_headroom(gather_rows(a, hot), cap - R), joined)

        all_v = mx.concatenate([cache.stored("values").astype(cv.dtype), cv], axis=2)
        new_keys = rebuilt(cache.stored_raw("keys"), ck.astype(cache.stored("keys").dtype))
        new_values = rebuilt(cache.stored_raw("values"), cv.astype(cache.stored("values").dtype))
        fields = cache.extra_row_fields()
        for name, fill in fields.items():  # recalled rows start from the method's fill value
            joined = mx.concatenate([cache.stored(name), mx.full(cpos.shape, fill, mx.float32)], axis=2)
            cache.row_extras[name] = with_headroom(gather_rows(joined, hot), cap - R, fill)
        cache.keys, cache.values = new_keys, new_values
        cache.positions = with_headroom(gather_rows(all_pos, hot), cap - R, PAD_POSITION)
        # The displaced rows (and the candidates that stay cold) refill the pages that were read.
        dk, dv, dpos = gather_rows(all_k, cold), gather_rows(all_v, cold), gather_rows(all_pos, cold)
        lo, hi = page_summaries(dk, dpos, self.page, self.kmin.dtype)
        self.kmin = put_rows(self.kmin, pages, lo)
        self.kmax = put_rows(self.kmax, pages, hi)
        self.write(pages, rows, dk, dv, dpos)
        self.recalls += 1

    # -- storage (per tier) -------------------------------------------------------------------
    def store(self, keys, values, pos) -> None:
        raise NotImplementedError

    def read(self, pages, rows):
        """(keys, values, positions) of the given pages: (B, H, m*page, ...), full precision."""
        raise NotImplementedError

    def write(self, pages, rows, keys, values, pos) -> None:
        raise NotImplementedError

    def flush(self) -> None:
        """Write pending rows where they belong (the disk tier)."""

    # -- accounting and state -----------------------------------------------------------------
    @property
    def summary_bytes(self) -> int:
        return buf_nbytes(self.kmin) + buf_nbytes(self.kmax) + buf_nbytes(self.q)

    resident_bytes = 0
    disk_bytes = 0

    @property
    def cold_rows(self) -> int:
        """Cold slots per (batch row, KV head), padding included."""
        return self.n_pages * self.page

    def report(self) -> dict:
        return {"cold_resident_bytes": self.resident_bytes, "cold_disk_bytes": self.disk_bytes,
                "summary_bytes": self.summary_bytes, "cold_pages": self.n_pages, "recalls": self.recalls}

    def state(self) -> dict:
        if self.kmin is None:
            return {}
        n = self.n_pages
        return {"recall.kmin": self.kmin[:, :, :n], "recall.kmax": self.kmax[:, :, :n], **self.rows_state()}

    def set_state(self, st: dict) -> None:
        if "recall.kmin" not in st:
            return
        self.kmin, self.kmax = st["recall.kmin"], st["recall.kmax"]
        self.n_pages = self.kmin.shape[2]
        self.set_rows_state(st)

    def meta(self) -> dict:
        return {"armed": self.armed, "recalls": self.recalls}

    def set_meta(self, meta: dict) -> None:
        self.armed, self.recalls = meta.get("armed", False), meta.get("recalls", 0)


class MemoryTier(ColdTier):
    """Cold rows quantized at ``recall_bits`` in mlx-lm's (words, scales, biases) layout."""

    def __init__(self, config):
        super().__init__(config)
        self.bits = config.recall_bits
        self.k = self.v = self.pos = None  # (B, H, capacity, ...) cold rows, page p = rows [p*page, (p+1)*page)
        self.filled = 0

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % COLD_GROUP:
            raise ValueError(f"recall='memory' quantizes cold rows in groups of {COLD_GROUP} along head_dim, "
                             f"and head_dim={head_dim} is not a multiple (use recall='disk')")

    def _q(self, x):
        return quantize_rows(x, self.bits, COLD_GROUP)

    def store(self, keys, values, pos) -> None:
        k, v = self._q(keys), self._q(values)
        at, need = self.filled, self.filled + pos.shape[2]
        if self.k is None:
            self.k, self.v, self.pos = k, v, pos
        else:
            self.k, self.v, self.pos = _grown(self.k, need), _grown(self.v, need), _grown(self.pos, need)
            for buf, new in ((self.k, k), (self.v, v)):
                for part, r in zip(buf, new, strict=True):
                    part[:, :, at:need] = r
            self.pos[:, :, at:need] = pos
        self.filled = need

    def read(self, pages, rows):
        deq = lambda buf: mx.dequantize(*(gather_rows(p, rows) for p in buf), group_size=COLD_GROUP, bits=self.bits)
        return deq(self.k), deq(self.v), gather_rows(self.pos, rows)

    def write(self, pages, rows, keys, values, pos) -> None:
        k, v = self._q(keys), self._q(values)
        self.k = tuple(put_rows(p, rows, r) for p, r in zip(self.k, k, strict=True))
        self.v = tuple(put_rows(p, rows, r) for p, r in zip(self.v, v, strict=True))
        self.pos = put_rows(self.pos, rows, pos)

    @property
    def resident_bytes(self) -> int:
        return buf_nbytes(self.k) + buf_nbytes(self.v) + buf_nbytes(self.pos)

    def rows_state(self) -> dict:
        if self.k is None:
            return {}
        r = self.cold_rows
        st = {"recall.pos": self.pos[:, :, :r]}
        for name, buf in (("k", self.k), ("v", self.v)):
            for part, a in zip(("words", "scales", "biases"), buf, strict=True):
                st[f"recall.{name}.{part}"] = a[:, :, :r]
        return st

    def set_rows_state(self, st: dict) -> None:
        self.pos = st["recall.pos"]
        self.filled = self.pos.shape[2]
        self.k = tuple(st[f"recall.k.{p}"] for p in ("words", "scales", "biases"))
        self.v = tuple(st[f"recall.v.{p}"] for p in ("words", "scales", "biases"))
