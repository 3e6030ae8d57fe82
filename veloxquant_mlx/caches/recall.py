"""The cold tier of recallable eviction (``KVCacheConfig(recall="memory" | "disk")``, docs/recall.md).

The hot tier is the cache as every method keeps it. The rows an eviction step drops come here instead
of being discarded: in pages of ``recall_page`` rows per KV head, each row with its absolute position
(keys are stored already rotated, so a recalled row needs no re-rotation), and per page and KV head
the elementwise min and max of its keys (Quest's summaries) in memory.

When a new multi-token input arrives on a cache that has evicted (a follow-up turn), its last
``recall_window`` queries bound every page's attention (Quest's upper bound, ``ops.recall.quest_bounds``)
and the best ``recall_pages`` pages per KV head are read back and join the hot rows in position order:
on the input's first chunk when the query tap lets the cache hand the layer's output back (fp rows:
that chunk then attends to the recalled rows too, so the new input's own hidden states see them), else
on its last token. The compression every method runs when an input ends then scores hot and recalled
rows alike, exactly, with the method's own rule and the new input's queries, and returns the hot tier
to ``budget`` rows; the rows it evicts refill the pages that were read (then new pages). So a cold row
comes back exactly when it beats a hot row by the method's own measure, and nothing is ever dropped.

* ``"memory"``: cold rows quantized at ``recall_bits`` (mlx-lm's layout, groups of 32); every step is
  lazy MLX work, no host sync anywhere.
* ``"disk"``: cold rows at full precision in a file this tier owns (removed when the cache is freed or
  the process exits). Writing needs materialized arrays, so evicted pages wait in memory ("pending")
  and are written at the end of a prompt's one-shot compression and at each recall: one host sync per
  layer there, never per decode token (decode-time evictions stay pending until the next of those).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..ops.select import flat_rows, gather_rows_of
from ..ops.recall import gather_evicted, join_in_order, page_rows, page_summaries, pick_pages, summarize_pages
from .quant import buf_dtype, buf_nbytes, buf_parts, dequantize_rows, from_parts, quantize_rows, rows_map
from .rows import with_headroom

COLD_GROUP = 32  # cold rows' quantization group along head_dim ("memory" tier)


def summary_dtype(dtype):
    """Page summaries are kept in 16 bits (float16 for float32 keys): half the bytes, and a bound
    only ranks pages."""
    return mx.float16 if dtype == mx.float32 else dtype


def _put_flat(buf: mx.array, flat: mx.array, rows: mx.array) -> mx.array:
    B, H, N = buf.shape[:3]
    rest = buf.shape[3:]
    f = buf.reshape(B * H * N, *rest)
    f[flat] = rows.reshape(-1, *rest)
    return f.reshape(buf.shape)


def put_rows_of(bufs: list, idx: mx.array, rows: list) -> list:
    """Every buffer of ``bufs`` (each (B, H, N, ...), one (B, H, N)) with ``buf[b, h, idx[b, h, i]] =
    rows[b, h, i]`` (new arrays), through one shared index (ops.select.flat_rows)."""
    lead = bufs[0].shape[:3]
    if any(b.shape[:3] != lead for b in bufs):
        raise ValueError(f"put_rows_of needs buffers of one (B, H, rows), got {[b.shape[:3] for b in bufs]}")
    flat = flat_rows(idx, bufs[0])
    return [_put_flat(b, flat, r) for b, r in zip(bufs, rows, strict=True)]


@functools.lru_cache(maxsize=8)
def _refiller(page: int):
    """The summaries of refilled pages written into theirs (kmin, kmax), as one compiled graph."""
    def refill(kmin, kmax, holes, keys, pos):
        return tuple(put_rows_of([kmin, kmax], holes, list(page_summaries(keys, pos, page, kmin.dtype))))
    return mx.compile(refill)


@functools.lru_cache(maxsize=8)
def _cold_writer(bits: int):
    """Cold rows quantized and written at ``rows`` of every buffer, as one compiled graph."""
    def write(rows, k, v, pos, keys, values, positions):
        new = [*quantize_rows(keys, bits, COLD_GROUP), *quantize_rows(values, bits, COLD_GROUP), positions]
        out = put_rows_of([*k, *v, pos], rows, new)
        return out[:len(k)], out[len(k):-1], out[-1]
    return mx.compile(write)


@functools.lru_cache(maxsize=8)
def _cold_reader(bits: int):
    """Gather + dequantize of cold rows (keys and values) as one compiled graph."""
    def read(rows, k, v, pos):
        got = gather_rows_of([*k, *v, pos], rows)
        deq = lambda parts: mx.dequantize(*parts, group_size=COLD_GROUP, bits=bits)
        return deq(got[:len(k)]), deq(got[len(k):-1]), got[-1]
    return mx.compile(read)


def _grown(buf, need: int):
    """``buf`` (or each part) with room for ``need`` rows along axis 2 (a new array when it grows)."""
    def grow(a):
        cap = a.shape[2]
        if need <= cap:
            return a
        return with_headroom(a, need + need // 8 - cap)  # 1/8 headroom: amortized, little waste
    return rows_map(grow, buf)


class ColdTier:
    """What both tiers share: evicted rows in pages, summaries, the recall step."""

    def __init__(self, config):
        self.page, self.pages, self.window = config.recall_page, config.recall_pages, config.recall_window
        self.kmin = self.kmax = None  # (B, H, page capacity, D) summaries in the keys' dtype
        self.n_pages = 0
        self.armed = False  # a new multi-token input arrived: recall with its queries when it ends
        self.q = None  # the last ``window`` queries of that input
        self.holes = None  # (B, H, m) pages read back by the last recall, refilled by the next eviction
        self.carry = None  # [keys, values, positions] of evicted rows short of a whole page
        self.recalls = 0
        self.every, self.steps = config.recall_every, 0  # recall every N decode steps (None: never)
        self.hold = config.recall_hold
        self.turn = False  # the armed recall is a new input's (not a recall_every decode step's)

    # -- hooks of EvictionCache ---------------------------------------------------------------
    def check_head_dim(self, head_dim: int) -> None:
        """Called with the first keys a cache receives (before anything is stored or dropped)."""

    def arm(self, turn: bool = False, queries: mx.array | None = None) -> None:
        """Recall at the end of the input that starts now; ``queries``: ones it already saw (a streamed
        prompt's last chunk), joined by the ones still to come."""
        self.armed, self.q, self.turn = self.n_pages > 0, queries, turn

    def turn_recalled(self) -> bool:
        """A new input recalled pages that no eviction has refilled yet (what recall_hold holds)."""
        return self.turn and self.holes is not None

    @property
    def held(self) -> bool:
        """recall_hold: the hot tier holds a turn's recalled rows, the compression still to run."""
        return self.hold and self.turn_recalled()

    def decode_step(self) -> None:
        """A decode step (one token after the prompt ended): with ``recall_every=N`` the Nth arms a
        recall with this step's query. It runs on the input's-last-token path (the compression after
        it picks), so it is lazy MLX work like every other "memory" recall. Not while the pages a
        recall read are still unfilled (their rows would come back twice)."""
        if self.every is None:
            return
        self.steps += 1
        if self.steps % self.every == 0 and self.holes is None:
            self.arm()

    def evicted(self, cache, kept: mx.array, real) -> None:
        """Called by ``EvictionCache.evict`` before the hot buffers change: ``kept`` (B, H, K) are the row
        indices the method keeps, so every other stored row comes here: first into the pages a recall just
        emptied, then into new pages; fewer than a page's rows wait in ``carry``."""
        if real is not None:
            raise ValueError("recall needs uniform per-head storage, and this eviction step keeps ragged "
                             "heads: nothing was evicted (use allocation='uniform')")
        store = cache.store
        rows, K = store.rows, kept.shape[-1]
        if rows - K <= 0:
            return
        bits, gs = store.bits, store.group_size
        k_raw, v_raw = store.raw("keys"), store.raw("values")
        pos, gone = gather_evicted(kept, store.raw("positions"), buf_parts(k_raw) + buf_parts(v_raw))
        nk = len(buf_parts(k_raw))
        keys = dequantize_rows(from_parts(gone[:nk], k_raw), bits, gs)
        values = dequantize_rows(from_parts(gone[nk:], v_raw), bits, gs)
        parts = [keys, values, pos]
        if self.holes is not None:  # refill the pages the recall read back (whole pages: E >= their rows)
            holes, self.holes = self.holes, None
            n = holes.shape[-1] * self.page
            fill = [a[:, :, :n] for a in parts]
            self.kmin, self.kmax = _refiller(self.page)(self.kmin, self.kmax, holes, fill[0], fill[2])
            self.write(holes, page_rows(holes, self.page), *fill)
            parts = [a[:, :, n:] for a in parts]
        if self.carry is not None:
            parts = [mx.concatenate([c, a], axis=2) for c, a in zip(self.carry, parts, strict=True)]
        n = parts[2].shape[2] // self.page * self.page
        self.carry = [mx.contiguous(a[:, :, n:]) for a in parts] if parts[2].shape[2] > n else None
        if n:
            whole = [a[:, :, :n] for a in parts]
            self._add_summaries(*summarize_pages(whole[0], whole[2], self.page, summary_dtype(whole[0].dtype)))
            self.store(*whole)
        if cache.schedule.compressing or cache.schedule.open:  # (open: a streamed prompt's chunk)
            self.flush()  # the disk tier writes now, so a streamed prompt holds no pending rows

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

    def recall(self, cache) -> bool:
        """On a new input (its first chunk where the layer's attention can include them, else its last
        token): the pages its queries may attend to most (Quest's bound) join the hot rows, in position
        order, so the compression at the input's end scores them with the method's own rule; what it
        evicts goes back into those pages. False: nothing to recall."""
        q, self.q, self.armed = self.q, None, False
        self.flush()
        n = self.n_pages
        if n == 0 or q is None:
            return False
        pages = pick_pages(q, self.kmin[:, :, :n], self.kmax[:, :, :n], self.pages)
        ck, cv, cpos = self.read(pages, page_rows(pages, self.page))
        self.holes = pages
        store = cache.store
        bits, gs = store.bits, store.group_size
        k_raw, v_raw = store.raw("keys"), store.raw("values")
        dtype = buf_dtype(k_raw)  # the candidates converted once to the hot rows' storage
        hot, cold = buf_parts(k_raw) + buf_parts(v_raw), buf_parts(quantize_rows(ck.astype(dtype), bits, gs)) + \
            buf_parts(quantize_rows(cv.astype(dtype), bits, gs))
        fills = store.fills  # recalled rows start from the method's fill
        hot += [store.raw(name) for name in fills]
        cold += [mx.full(cpos.shape, fill, mx.float32) for fill in fills.values()]
        pos, joined = join_in_order(store.raw("positions"), cpos, hot, cold)  # rows stay in position order
        nk, nv = len(buf_parts(k_raw)), len(buf_parts(v_raw))
        store.replace(from_parts(joined[:nk], k_raw), from_parts(joined[nk:nk + nv], v_raw), pos,
                      dict(zip(fills, joined[nk + nv:], strict=True)), ragged=False)
        self.recalls += 1
        return True

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

    @property
    def resident_bytes(self) -> int:
        """Cold rows held in memory: the tier's own (``rows_bytes``) and the carry short of a page."""
        return self.rows_bytes + sum(buf_nbytes(a) for a in self.carry or ())

    rows_bytes = 0
    disk_bytes = 0

    @property
    def cold_rows(self) -> int:
        """Cold slots per (batch row, KV head), padding included."""
        return self.n_pages * self.page

    def report(self) -> dict:
        return {"cold_resident_bytes": self.resident_bytes, "cold_disk_bytes": self.disk_bytes,
                "summary_bytes": self.summary_bytes, "cold_pages": self.n_pages, "recalls": self.recalls}

    def state(self) -> dict:
        st = {} if self.carry is None else dict(zip(("recall.carry.k", "recall.carry.v", "recall.carry.pos"),
                                                    self.carry, strict=True))
        if self.q is not None:
            st["recall.q"] = self.q
        if self.holes is not None:  # saved mid-input: the next eviction still refills these pages
            st["recall.holes"] = self.holes
        if self.kmin is None:
            return st
        n = self.n_pages
        return {**st, "recall.kmin": self.kmin[:, :, :n], "recall.kmax": self.kmax[:, :, :n], **self.rows_state()}

    def set_state(self, st: dict) -> None:
        self.carry = ([st[f"recall.carry.{k}"] for k in ("k", "v", "pos")] if "recall.carry.pos" in st else None)
        self.q = st.get("recall.q")
        self.holes = st.get("recall.holes")
        if "recall.kmin" not in st:
            return
        self.kmin, self.kmax = st["recall.kmin"], st["recall.kmax"]
        self.n_pages = self.kmin.shape[2]
        self.set_rows_state(st)

    def meta(self) -> dict:
        return {"armed": self.armed, "recalls": self.recalls, **({"steps": self.steps} if self.every else {}),
                **({"turn": self.turn} if self.hold else {})}

    def set_meta(self, meta: dict) -> None:
        self.armed, self.recalls = meta.get("armed", False), meta.get("recalls", 0)
        self.steps = meta.get("steps", 0)
        self.turn = meta.get("turn", False)


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
        return _cold_reader(self.bits)(rows, list(self.k), list(self.v), self.pos)

    def write(self, pages, rows, keys, values, pos) -> None:
        k, v, self.pos = _cold_writer(self.bits)(rows, list(self.k), list(self.v), self.pos, keys, values, pos)
        self.k, self.v = tuple(k), tuple(v)

    @property
    def rows_bytes(self) -> int:
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
