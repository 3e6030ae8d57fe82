"""The paged prompt (``prompt_eviction="offload"``): every row a cache has seen, in a file it owns.

Eviction during the prompt makes later chunks read a compressed prefix and loses answers; holding the
whole prompt makes the peak the prompt's KV. The paged prompt does neither. While an input is read, each
chunk's rows are attended to and then written to the page file, so memory holds only the chunk, a block
of rows read back, and what the method keeps per row (H2O's accumulated attention, kvzap's predicted
score: ``extras``). Every chunk attends to every earlier row, exactly: the rows come back from the file a
block at a time and are merged by an online softmax (``ops.attention.BlockAttention``), each block
evaluated before the next is read, so no layer ever holds its whole prefix. When the input ends, the
method picks its budget from all rows exactly as under ``"end"``: one layer at a time, the rows are read
back (``unpage``), the method's own eviction runs, and the kept rows are evaluated before the next layer
reads its file.

The file keeps every row, so it is also the cold tier of a conversation: a later input is read against
the whole history again, and its end re-selects from all rows with the new queries. Decode rows join the
file when the next input starts (or, for methods that evict while decoding, at each decode eviction,
held in memory until then).

States of a cache with pages (``reading`` / ``closed``):

* neither: the hot rows are the cache (decode, and before the first input); rows at positions
  ``>= next_pos`` are not in the file yet, and they are the newest hot rows.
* ``reading``: an input is being read; the hot rows are that input's rows not yet paged, at positions
  ``next_pos .. offset - 1``; the query tap's step goes through :meth:`PromptPages.tap`.
* ``closed``: the input ended and every row is in the file; the hot storage is empty and counts the
  paged rows (``RowStore.drop(rows)``), which the cache's ``stored()`` reads from here. Its eviction (or,
  when it keeps everything, its next step) reads them back.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np

from ..ops.attention import BlockAttention
from .quant import buf_parts, dequantize_rows, rows_map
from .scratch_files import RAW_BITS, OwnedFile, host_bits
from .rows import PAD_POSITION

FLUSH_ROWS = 4096  # decode rows held for the file beyond this many are written at the next eviction
# Queries per span of a chunk's attention over the file: a block's scratch is this x query heads x page_block
# floats, whatever the chunk's length (mlx-lm's default prefill step is 2048; a KVzip pass chunk about 2K)
QUERY_BLOCK = 512


def _as_buf(parts: list):
    """A buffer from the parts read for it: a plain array, or quantized rows' (words, scales, biases)."""
    return tuple(parts) if len(parts) > 1 else parts[0]


class PagedRows:
    """A closed paged prompt's keys or values while its eviction runs: they stay in the file. The method's
    scores read them whole only if they need them (:meth:`load`, through ``stored``); the eviction reads
    the kept rows alone (``RowStorage.compact`` calls :meth:`gather`)."""

    nbytes = 0  # nothing in memory

    def __init__(self, pages, which: str):
        self.pages, self.which, self._loaded = pages, which, None

    def load(self):
        if self._loaded is None:
            self._loaded = self.pages.read_part(self.which)
        return self._loaded

    @property
    def loaded(self) -> bool:
        return self._loaded is not None

    def gather(self, idx: mx.array):
        return self.pages.gather_rows(idx, self.which)

    def __getattr__(self, name):  # anything else (shape, dtype, ...) is asked of the rows themselves
        if name.startswith("_") or name in ("pages", "which"):
            raise AttributeError(name)
        return getattr(self.load(), name)


class PassRows:
    """Every paged row then a model pass's own rows (never stored): ``Step.keys`` or ``Step.values`` while the
    pass reads a closed paged prompt. A method takes a slice of the rows axis (``rows[:, :, a:b]``), and only
    those rows are read from the file, dequantized."""

    def __init__(self, pages, which: str, own: mx.array, bits, gs):
        self.pages, self.which, self.own, self.bits, self.gs = pages, which, own, bits, gs
        self.dtype = own.dtype
        self.shape = (*own.shape[:2], pages.written + own.shape[2], own.shape[3])

    def __getitem__(self, index) -> mx.array:
        whole = slice(None)
        if not (isinstance(index, tuple) and len(index) == 3 and index[:2] == (whole, whole)
                and isinstance(index[2], slice)):
            raise TypeError(f"a paged prompt's rows are read by a slice of the rows axis (rows[:, :, a:b]), not {index!r}")
        a, b, stride = index[2].indices(self.shape[2])
        if stride != 1:
            raise TypeError("a paged prompt's rows are read by a contiguous slice")
        n, parts = self.pages.written, []
        if a < min(b, n):
            part = _as_buf(self.pages._read(a, min(b, n), parts=self.pages._part_range(self.which)))
            parts.append(dequantize_rows(part, self.bits, self.gs).astype(self.dtype))
        if b > n:
            parts.append(self.own[:, :, max(a, n) - n:b - n])
        if not parts:
            return self.own[:, :, :0]
        return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


class PromptPages:
    """One cache's page file and the per-row state of the rows in it (module docstring)."""

    def __init__(self, config):
        self.block = config.page_block
        self.file = OwnedFile(self, config.page_dir, "pages", "prompt_eviction='offload'")
        self.rows = 0  # rows in the file and pending
        self.written = 0  # rows in the file
        self.next_pos = 0  # hot rows at positions >= next_pos are not paged yet
        self.record = None  # numpy dtype of one row: every part of its keys and values, all (B, H)
        self.parts = None  # (number of key parts, mx dtype of each part): plain rows 1 part, quantized 3
        self.shape = None  # (B, H)
        self.positions = None  # (B, H, rows) int32 once the rows are not 0 .. rows - 1 (a loaded cache)
        self.padded = False  # a paged row is padding (ragged heads): reads hide it
        self.extras: dict = {}  # name -> (B, H, rows) float32: the method's per-row state
        self.pending: list = []  # each: the parts (keys', then values') of rows held for the file, not written yet
        self.reading = self.closed = False
        self.step_rows = None  # rows in the file after the last paged step (None: the last step was not one)
        self.bytes_read = 0

    def __deepcopy__(self, memo):
        # mlx-lm's prompt-cache reuse copies caches: the copy gets a file of its own with the same rows
        new = PromptPages.__new__(PromptPages)
        shared = ("file", "record", "parts")  # immutable, or replaced right below
        new.__dict__.update({k: (v if k in shared else copy.deepcopy(v, memo)) for k, v in self.__dict__.items()})
        new.file = self.file.copy_for(new)
        return new

    @property
    def path(self) -> str:
        return self.file.path

    # -- writing ------------------------------------------------------------------------------------------
    def _layout(self, parts: list, n_key_parts: int) -> None:
        B, H = parts[0].shape[:2]
        self.shape = (B, H)
        self.parts = (n_key_parts, [p.dtype for p in parts])
        self.record = np.dtype([(f"p{i}", RAW_BITS[p.dtype.size][1], (B, H, p.shape[-1])) for i, p in enumerate(parts)])

    def add(self, keys, values, positions: mx.array, extras: dict, in_order: bool, flush: bool = True) -> None:
        """Rows (B, H, n, ...) as the hot storage holds them (quantized rows as their parts), with their
        positions and per-row fields; written now (``flush``) or held until :meth:`flush`. ``in_order``:
        the rows are the positions ``rows .. rows + n - 1`` in every head (the positions stay implicit)."""
        n = positions.shape[2]
        if n == 0:
            return
        parts = buf_parts(keys) + buf_parts(values)
        if self.record is None:
            self._layout(parts, len(buf_parts(keys)))
        if not (in_order and self.positions is None):
            known = self.all_positions()
            self.positions = positions.astype(mx.int32) if known is None else mx.concatenate([known, positions], 2)
            # one host read when rows arrive out of order (a loaded cache's first input), never while decoding
            self.padded = self.padded or (not in_order and bool((positions == PAD_POSITION).any().item()))
        for name, rows in extras.items():
            old = self.extras.get(name)
            self.extras[name] = rows if old is None else mx.concatenate([old, rows], axis=2)
        self.pending.append(parts)
        self.rows += n
        if flush:
            self.flush()

    def flush(self) -> None:
        """Write the held rows to the file (a host read of them: off the decode path)."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        cols = [mx.concatenate(c, axis=2) if len(c) > 1 else c[0] for c in zip(*pending)]
        n = cols[0].shape[2]
        rec = np.empty((n,), self.record)
        for i, a in enumerate(cols):
            rec[f"p{i}"] = np.moveaxis(host_bits(a), 2, 0)
        try:
            with open(self.path, "ab") as f:
                f.write(rec.tobytes())
        except OSError as e:
            self.pending = pending
            raise RuntimeError(f"prompt_eviction='offload' cannot write {rec.nbytes} bytes of rows to {self.path!r}: "
                               f"{e.strerror or e} (free space in {self.file.folder!r}: "
                               f"{self.file.free_bytes() // 2**20} MiB)") from None
        self.written += n

    # -- reading ------------------------------------------------------------------------------------------
    def _map(self):
        """The written rows as a read-only memory map: (rows,) records."""
        import os

        if not os.path.exists(self.path) or os.path.getsize(self.path) < self.disk_bytes:
            raise RuntimeError(f"prompt_eviction='offload' file {self.path!r} holds fewer rows than written "
                               f"({self.written}): was it removed or truncated?")
        return np.memmap(self.path, dtype=self.record, mode="r", shape=(self.written,))

    def _read(self, lo: int, hi: int, parts=None) -> list:
        """Parts (all, or the indices ``parts``) of the written rows lo:hi, each (B, H, n, width) as stored."""
        rec = self._map()[lo:hi]
        out = []
        for i, dtype in enumerate(self.parts[1]):
            if parts is not None and i not in parts:
                continue
            host = np.ascontiguousarray(np.moveaxis(rec[f"p{i}"], 0, 2))
            self.bytes_read += host.nbytes
            a = mx.array(host)
            out.append(a.view(dtype) if a.dtype != dtype else a)
        return out

    def _part_range(self, which: str) -> range:
        n = self.parts[0]
        return range(n) if which == "keys" else range(n, len(self.parts[1]))

    def read_part(self, which: str):
        """Every paged row's keys or values, as the hot storage holds them."""
        self.flush()
        return _as_buf(self._read(0, self.written, parts=self._part_range(which)))

    def gather_rows(self, idx: mx.array, which: str):
        """The keys or values of rows ``idx`` (B, H, K) of every head, read from the file (host-read indices:
        once per layer at a paged prompt's end), as the hot storage holds them."""
        self.flush()
        rows = np.array(idx)
        B, H = self.shape
        b, h = np.arange(B)[:, None, None], np.arange(H)[None, :, None]
        mm, out = self._map(), []
        for i in self._part_range(which):
            dtype = self.parts[1][i]
            host = np.ascontiguousarray(mm[f"p{i}"][rows, b, h])  # (B, H, K, width): only these rows are read
            self.bytes_read += host.nbytes
            a = mx.array(host)
            out.append(a.view(dtype) if a.dtype != dtype else a)
        return _as_buf(out)

    def _kv(self, parts: list):
        """(keys, values) buffers from the parts of a read: quantized rows as their (words, scales, biases)."""
        n = self.parts[0]
        return _as_buf(parts[:n]), _as_buf(parts[n:])

    def all_positions(self):
        """(B, H, rows) int32 positions of the paged rows (None before any row)."""
        if self.positions is not None:
            return self.positions
        if self.shape is None:
            return None
        return mx.broadcast_to(mx.arange(self.rows, dtype=mx.int32), (*self.shape, self.rows))

    def read_all(self):
        """Every paged row's (keys, values) as the hot storage holds them."""
        self.flush()
        return self._kv(self._read(0, self.written))

    def stored(self, name: str, bits, gs):
        """``EvictionCache.stored`` of a closed cache: every paged row's ``name`` (keys / values dequantized)."""
        if name == "positions":
            return self.all_positions()
        if name in ("keys", "values"):
            return dequantize_rows(self.read_part(name), bits, gs)
        return self.extras[name]

    # -- the cache's steps --------------------------------------------------------------------------------
    def begin_input(self, cache) -> None:
        """A new input starts (its first chunk, before it is stored): the history not in the file yet joins
        it, and the hot rows (all of them in the file now) are dropped: this input attends to the file."""
        store = cache.store
        if self.closed:
            self.closed = False
        elif store.keys is not None and self.rows == 0 and cache.offset > store.rows:
            self._add_tail(cache, store.rows, flush=True, in_order=False)  # a loaded cache: its kept rows
        elif store.keys is not None:
            self._add_tail(cache, cache.offset - self.next_pos, flush=True)
        self.flush()
        self.next_pos = cache.offset
        store.drop()
        self.reading = True

    def _add_tail(self, cache, n: int, flush: bool, in_order: bool = True) -> None:
        """The newest ``n`` hot rows into the file (or held for it): the positions ``next_pos ..
        offset - 1``, in order in every head (``in_order`` False: any rows, a loaded cache's)."""
        if n <= 0:
            return
        store = cache.store
        r = store.rows
        take = lambda a: mx.contiguous(a[:, :, r - n:r])  # a copy: a slice would pin the hot buffer
        in_order = in_order and self.next_pos == self.rows
        self.add(rows_map(take, store.raw("keys")), rows_map(take, store.raw("values")),
                 take(store.raw("positions")), {name: take(store.raw(name)) for name in store.fields},
                 in_order=in_order, flush=flush)

    def before_evict(self, cache) -> bool:
        """Called by the cache's eviction before it selects. A closed cache reads every row back (True:
        the caller evaluates the kept rows before the next layer reads); a decoding one hands its rows
        newer than the file to it first, since the eviction may drop them."""
        if self.closed:
            self.unpage(cache, values=False)
            return True
        n = cache.offset - self.next_pos
        if n > 0 and not self.reading:
            self._add_tail(cache, n, flush=False)
            self.next_pos = cache.offset
            if sum(p[0].shape[2] for p in self.pending) >= FLUSH_ROWS:
                self.flush()
        return False

    def unpage(self, cache, values: bool = True) -> None:
        """The closed cache's rows back into its hot storage (one layer's rows: memory of one layer).
        ``values`` False: the keys and values stay in the file (:class:`PagedRows`): the method's scores read
        the keys only if they need them, and the eviction that follows reads only the kept rows."""
        if values:
            keys, values = self.read_all()
        else:
            self.flush()
            keys, values = PagedRows(self, "keys"), PagedRows(self, "values")
        # fresh arrays: the hot storage writes into its per-row fields in place
        cache.store.replace(keys, values, self.all_positions(), {k: mx.array(v) for k, v in self.extras.items()},
                            ragged=self.padded)
        self.closed = False

    def attend(self, cache, queries: mx.array, scale: float, mask, kwargs: dict, keys=None) -> mx.array:
        """A chunk's attention while an input is read: over every paged row and its own (the layer's output),
        and, for a method that keeps each row's attention mass (``attention_mass_field``), the mass every row
        receives from this chunk, added to its field (a second pass over the file). ``keys``: what the model
        hands attention (None: not known)."""
        why = self.unsupported(cache, mask, kwargs, keys)
        if why:
            raise ValueError(f"prompt_eviction='offload' cannot read this model's attention: {why}; "
                             "use prompt_eviction='end'")
        store, bits, gs = cache.store, cache.kv_bits, cache.kv_group_size
        tail_k, tail_v = store.read("keys"), store.read("values")
        field = cache.method.attention_mass_field
        att = self._attention(queries, scale, kwargs, None, (tail_k, tail_v), bits, gs)
        out = att.output()
        mx.eval(out)
        if field is not None:  # the attention mass every row receives from this chunk (a second pass)
            parts = []
            for lo, hi, k, _, vis in self._blocks(bits, gs, values=False):
                parts.append(att.mass(k, vis))
                mx.eval(parts[-1])
            if parts:
                self.extras[field] = self.extras[field] + mx.concatenate(parts, axis=2)
            store.write({field: store.read(field) + att.mass_own(tail_k)})
        return out

    def store_step(self, cache) -> None:
        """After the chunk's step: its rows go to the file, and the hot storage is emptied."""
        self._add_tail(cache, cache.offset - self.next_pos, flush=True)
        self.step_rows = self.written
        # the per-row state and the query window now: left lazy, they would pin this chunk's queries and
        # hidden states (kvzap's scores are computed from them) in every layer until the prompt ends
        mx.eval([*self.extras.values(), *cache.step_state()])
        self.next_pos = cache.offset
        cache.store.drop()

    def close(self, cache) -> None:
        """The input's last token was read: every row is in the file; the method picks (the cache evicts)."""
        self.reading, self.closed = False, True
        cache.store.drop(self.rows)

    def _blocks(self, bits, gs, values: bool = True, stop: int | None = None):
        """(lo, hi, keys, values, visibility) of the written rows (up to ``stop``), a block at a time,
        dequantized."""
        self.flush()
        stop = self.written if stop is None else stop
        for lo in range(0, stop, self.block):
            hi = min(lo + self.block, stop)
            k, v = self._kv(self._read(lo, hi))
            k = dequantize_rows(k, bits, gs)
            v = dequantize_rows(v, bits, gs) if values else None
            vis = None
            if self.padded:
                vis = mx.expand_dims(self.positions[:, :, lo:hi] != PAD_POSITION, 2)  # (B, H, 1, n)
            yield lo, hi, k, v, vis

    def key_blocks(self, align: int, bits, gs):
        """(keys, positions) of every paged row, in blocks of about ``page_block`` rows (a multiple of
        ``align``), dequantized: what a method's window attention reads at the prompt's end (View)."""
        self.flush()
        step = max(self.block // align, 1) * align
        positions = self.all_positions()
        for lo in range(0, self.written, step):
            hi = min(lo + step, self.written)
            keys = _as_buf(self._read(lo, hi, parts=self._part_range("keys")))
            yield dequantize_rows(keys, bits, gs), positions[:, :, lo:hi]

    def attend_shared(self, queries: mx.array, scale, kwargs: dict, bits, gs) -> mx.array:
        """A KV-shared layer's attention in the step its source just paged: the same rows the source
        attended to, all in the file now, the last ``S`` of them the step's own (causal)."""
        S, end = queries.shape[2], self.step_rows
        k, v = self._kv(self._read(end - S, end))
        scale = scale if scale is not None else queries.shape[-1] ** -0.5
        return self.attend_before(queries, scale, kwargs, end - S,
                                  (dequantize_rows(k, bits, gs), dequantize_rows(v, bits, gs)), bits, gs)

    def attend_before(self, queries: mx.array, scale: float, kwargs: dict, stop: int, own: tuple, bits,
                      gs) -> mx.array:
        """Attention over the file's first ``stop`` rows then the rows ``own`` (keys, values), the last ``S``
        of which are the queries' own positions (causal): the layer's output, evaluated."""
        out = self._attention(queries, scale, kwargs, stop, own, bits, gs).output()
        mx.eval(out)
        return out

    def _attention(self, queries, scale: float, kwargs: dict, stop, own: tuple, bits, gs) -> BlockAttention:
        att = BlockAttention(queries, own[0].shape[1], scale, kwargs.get("sinks"), QUERY_BLOCK)
        for lo, hi, k, v, vis in self._blocks(bits, gs, stop=stop):
            att.add(k, v, vis)
            for span in att.state():  # one span's scratch at a time; this block's rows can go before the next
                mx.eval(span)
        att.add_own(*own)
        for span in att.state():
            mx.eval(span)
        return att

    def pass_rows(self, own: tuple, bits, gs) -> tuple:
        """(keys, values) of a model pass over the closed pages, as ``Step.keys`` / ``Step.values``: every
        paged row then the pass's own ``own`` rows (never stored), read from the file by the slice a method takes."""
        self.flush()
        return PassRows(self, "keys", own[0], bits, gs), PassRows(self, "values", own[1], bits, gs)

    def write_fields(self, fields: dict) -> None:
        """Per-row fields of the newest paged rows (a model pass's scores): ``{name: (B, H or 1, n)}``."""
        for name, v in fields.items():
            old = self.extras[name]
            self.extras[name] = mx.concatenate([old[:, :, :old.shape[2] - v.shape[2]],
                                                mx.broadcast_to(v, (*old.shape[:2], v.shape[2]))], axis=2)

    @staticmethod
    def unsupported(cache, mask, kwargs, keys) -> str:
        """Why this attention call cannot be read against the page file ("" where it can); ``keys``: what the
        model hands attention (None: not checked)."""
        if cache.latent_query is not None:
            return "multi-head latent attention (its queries are read in the latent's space)"
        extra = sorted(k for k, v in kwargs.items() if v is not None and k != "sinks")
        if extra:
            return f"its attention takes {', '.join(extra)}"
        if mask is not None and not isinstance(mask, str):
            return "it passes an array mask"
        first = keys[0] if isinstance(keys, tuple) else keys  # quantized rows: their packed words
        if first is not None and tuple(first.shape[1:3]) != (cache.store.positions.shape[1], cache.size()):
            return "it attends to other keys than the rows its cache returned (repeated or transformed heads)"
        return ""

    # -- accounting and state -----------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """What the pages hold in memory: the per-row fields, positions that are not 0 .. rows - 1, and
        rows held for the file."""
        held = [*self.extras.values(), self.positions, *(p for parts in self.pending for p in parts)]
        return sum(a.nbytes for a in held if a is not None)

    @property
    def disk_bytes(self) -> int:
        return 0 if self.record is None else self.written * self.record.itemsize

    def report(self) -> dict:
        return {"paged_rows": self.rows, "page_disk_bytes": self.disk_bytes,
                "page_resident_bytes": self.resident_bytes, "page_bytes_read": self.bytes_read,
                "page_file": self.path}
