"""Key/value storage of a batch of eviction rows: one (B, H, capacity, D) buffer per layer.

Row ``i``'s ``n[i]`` kept rows lie right-aligned at a column ``end`` that every row shares:
columns ``[end - n[i], end)``. So

* a decode step writes every row's new token at column ``end`` with one slice assignment (mlx-lm's
  ``BatchKVCache`` writes the same way), and ``fetch`` returns the view ``[end - max(n), end)``: the
  batch's keys are read once and nothing proportional to B x rows is copied;
* a row's eviction rewrites that row's slice only (``put_row``): its kept rows move to
  ``[end - kept, end)``, and the columns in front of them become stale rows the mask hides (they hold
  old finite values, so masked weights of exactly 0 keep the output exact);
* when ``end`` reaches the capacity, or the rows keep far fewer rows than the buffer holds (a prompt
  was compressed), one copy of the last ``max(n)`` columns starts a new buffer with ``headroom`` free
  columns (``compact``): amortized, and the same for any batch size.

Quantized rows (``kv_bits``) are the ``(words, scales, biases)`` tuple of ``caches.quant``; every
operation maps over the three parts alike.
"""

from __future__ import annotations

import mlx.core as mx

from .quant import buf_nbytes, rows_map, rows_zip
from .rows import with_headroom


def _first(buf):
    return buf[0] if isinstance(buf, tuple) else buf


def _blank_like(buf, B: int, width: int):
    """Zero rows as stored, (B, H, width, ...) shaped like ``buf``'s parts."""
    return rows_map(lambda a: mx.zeros((B, a.shape[1], width, a.shape[3]), a.dtype), buf)


def _write(buf, index, rows) -> None:
    """``buf[index] = rows`` part by part (a plain buffer or a quantized tuple), in place."""
    for part, r in zip(*((buf, rows) if isinstance(buf, tuple) else ((buf,), (rows,))), strict=True):
        part[index] = r


class BatchRows:
    """The keys and values of B sequences, right-aligned at a shared end column (module docstring)."""

    def __init__(self, rows: list, headroom: int):
        self.keys = self.values = None
        self.end = 0
        self.rows = rows  # the row caches (EvictionCache), shared with the BatchEvictionCache
        self.n: list[int] = [0] * len(rows)  # kept rows of each sequence held here
        self.headroom = headroom
        # The (keys, values) views handed to each row. A row whose keys are not its view holds its own
        # buffer (it joined with its rows, or evicted since): the next step writes it into the batch.
        self.views: list = [None] * len(rows)
        for r in rows:
            r.store.external = True

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else _first(self.keys).shape[2]

    @property
    def width(self) -> int:
        return max(self.n, default=0)

    # -- the rows' views of the buffers -----------------------------------------------------------
    def synced(self, i: int) -> bool:
        """Row i's keys/values are its view of the buffers (or it holds nothing yet)."""
        view, store = self.views[i], self.rows[i].store
        return store.positions is None if view is None else store.keys is view[0]

    def bind(self, which) -> None:
        """Hand each row in ``which`` fresh views of its rows. Every step rebinds every row, so no view
        of an older buffer outlives the step (a live view makes the next in-place write copy it)."""
        for i in which:
            store = self.rows[i].store
            if store.positions is None:  # nothing stored yet (only padding so far)
                self.views[i] = None
                continue
            self.views[i] = view = self.row(i)
            store.bind(*view)

    def held(self, i: int, n: int):
        """Row i's first n rows (those before this step's tokens) as lists of stored parts: its view
        of the buffers, or its own buffer's first n rows."""
        if n == 0:
            return [], []
        if self.synced(i):
            if self.n[i] != n:
                raise RuntimeError(f"batch row {i} holds {self.n[i]} rows in the batch buffer, its cache {n}")
            k, v = self.row(i)
        else:
            store = self.rows[i].store
            k, v = (rows_map(lambda a: a[:, :, :n], buf) for buf in (store.keys, store.values))
        return [k], [v]

    def store(self, spans: list, held: list, k, v) -> None:
        """Store one step's new rows ``k``/``v`` (B, H, S, D as stored; row i's real ones are
        ``spans[i]`` = (start, count)) after each row's ``held[i]`` earlier rows, then rebind the views."""
        S = _first(k).shape[2]
        if self.keys is not None and all(a == 0 and n == S for a, n in spans) and max(held) <= self.end:
            # Decode (every row one real token): rows that evicted since the last step write their kept
            # rows into their own slice, then one slice assignment stores the batch's new tokens.
            for i in range(len(self.rows)):
                if not self.synced(i):
                    (ki,), (vi,) = self.held(i, held[i]) if held[i] else ((None,), (None,))
                    self.put_row(i, ki, vi, held[i])
            if self.capacity - self.width > 2 * self.headroom + S:
                self.compact(S)  # every row keeps far fewer rows than the buffer holds (a prompt compressed)
            self.append_all(k, v)
        else:  # prompt chunks of different lengths, rows that joined: one copy of the batch
            parts_k, parts_v = [], []
            for i, (a, n) in enumerate(spans):
                pk, pv = self.held(i, held[i])
                if n:
                    pk.append(rows_map(lambda x: x[i:i + 1, :, a:a + n], k))
                    pv.append(rows_map(lambda x: x[i:i + 1, :, a:a + n], v))
                parts_k.append(pk)
                parts_v.append(pv)
            self.rebuild(parts_k, parts_v, k, v)
        self.bind(range(len(self.rows)))

    # -- reads (views, no copies) -----------------------------------------------------------------
    def fetch(self):
        """Every row's kept rows, left-padded to the widest row: views of the buffers."""
        lo, hi = self.end - self.width, self.end
        return rows_map(lambda a: a[:, :, lo:hi], self.keys), rows_map(lambda a: a[:, :, lo:hi], self.values)

    def row(self, i: int):
        """Row ``i``'s kept keys and values, (1, H, n[i], D) views."""
        lo, hi = self.end - self.n[i], self.end
        return (rows_map(lambda a: a[i:i + 1, :, lo:hi], self.keys),
                rows_map(lambda a: a[i:i + 1, :, lo:hi], self.values))

    # -- writes -----------------------------------------------------------------------------------
    def put_row(self, i: int, k, v, n: int) -> None:
        """Row ``i`` now holds the ``n`` rows of ``k``/``v`` (1, H, >= n, D): one slice assignment into
        row ``i``'s columns (an eviction rewrites that row only). Needs ``n <= end``."""
        self.n[i] = n
        if n == 0:
            return
        index = (slice(i, i + 1), slice(None), slice(self.end - n, self.end))
        _write(self.keys, index, rows_map(lambda a: a[:, :, :n], k))
        _write(self.values, index, rows_map(lambda a: a[:, :, :n], v))

    def append_all(self, k, v) -> None:
        """Every row gets the m new rows of ``k``/``v`` (B, H, m, D): one slice assignment per buffer."""
        m = _first(k).shape[2]
        if self.end + m > self.capacity:
            self.compact(m)
        index = (slice(None), slice(None), slice(self.end, self.end + m))
        _write(self.keys, index, k)
        _write(self.values, index, v)
        self.end += m
        self.n = [c + m for c in self.n]

    def compact(self, room: int) -> None:
        """A new buffer: the last ``width`` columns (one copy) plus ``max(headroom, room)`` free ones."""
        W, extra = self.width, max(self.headroom, room)
        lo, hi = self.end - W, self.end
        self.keys = rows_map(lambda a: with_headroom(a[:, :, lo:hi], extra), self.keys)
        self.values = rows_map(lambda a: with_headroom(a[:, :, lo:hi], extra), self.values)
        self.end = W

    def rebuild(self, parts_k: list, parts_v: list, template_k, template_v) -> None:
        """New buffers from each row's list of stored parts (1, H, r, D), joined in order (prompt chunks
        of different lengths, rows that hold their own storage): one copy of the whole batch, so only
        for steps that are not plain decode. ``template_*``: any stored rows (dtype and shape)."""
        counts = [sum(_first(p).shape[2] for p in ps) for ps in parts_k]
        W = max(counts, default=0)
        C = W + self.headroom

        def build(parts, template):
            rows = [([_blank_like(template, 1, W - c)] if c < W else []) + list(ps) + [_blank_like(template, 1, C - W)]
                    for ps, c in zip(parts, counts, strict=True)]

            def join(pick):  # one part (plain, or words / scales / biases) of every row
                return mx.concatenate([mx.concatenate([pick(p) for p in r], axis=2) for r in rows], axis=0)

            if isinstance(template, tuple):
                return tuple(join(lambda p, j=j: p[j]) for j in range(len(template)))
            return join(lambda p: p)

        self.keys = build(parts_k, template_k)
        self.values = build(parts_v, template_v)
        self.end = W
        self.n = counts

    # -- the batch changes (rows leaving and joining) ---------------------------------------------
    def filter(self, idx: list, rows: list) -> None:
        """Keep the rows at ``idx`` (one gather along the batch axis, as mlx-lm's batch caches do);
        ``rows``: the row caches kept, in that order."""
        synced = [self.synced(i) for i in idx]
        self.n = [self.n[i] for i in idx]
        self.views = [self.views[i] for i in idx]
        self.rows = rows
        if self.keys is not None and not idx:
            self.keys = self.values = None
            self.end = 0
        elif self.keys is not None:
            sel = mx.array(idx, dtype=mx.int32)
            self.keys = rows_map(lambda a: a[sel], self.keys)
            self.values = rows_map(lambda a: a[sel], self.values)
        self.bind([i for i, ok in enumerate(synced) if ok])

    def _aligned(self, buf, template, W: int, C: int):
        """This store's buffer with its last W columns at [0, W) of C (zeros where it holds fewer)."""
        B = len(self.n)
        if buf is None:
            return _blank_like(template, B, C)
        lo = self.end - W

        def one(a):
            pre = [mx.zeros((B, a.shape[1], -lo, a.shape[3]), a.dtype)] if lo < 0 else []
            return with_headroom(pre + [a[:, :, max(lo, 0):self.end]], C - W)

        return rows_map(one, buf)

    def extend(self, other: BatchRows, rows: list) -> None:
        """Append ``other``'s rows: both aligned at the wider end, one copy of each (a join is rare);
        ``rows``: every row cache, ours then other's."""
        synced = [self.synced(i) for i in range(len(self.n))] + [other.synced(i) for i in range(len(other.n))]
        if other.keys is not None or self.keys is not None:
            W = max(self.width, other.width)
            C = W + self.headroom
            ref = self if self.keys is not None else other
            for name in ("keys", "values"):
                t = getattr(ref, name)
                a = self._aligned(getattr(self, name), t, W, C)
                b = other._aligned(getattr(other, name), t, W, C)
                setattr(self, name, rows_zip(lambda x, y: mx.concatenate([x, y], axis=0), a, b))
            self.end = W
        self.n = self.n + other.n
        self.views = self.views + other.views
        self.rows = rows
        self.bind([i for i, ok in enumerate(synced) if ok])

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers, plus the rows' own buffers not written back yet."""
        own = sum(buf_nbytes(r.store.keys) + buf_nbytes(r.store.values) for i, r in enumerate(self.rows)
                  if not self.synced(i))
        return buf_nbytes(self.keys) + buf_nbytes(self.values) + own
