"""Continuous batching with eviction caches: mlx-lm's ``BatchGenerator``, ``batch_generate`` and
``mlx_lm.server``.

mlx-lm batches sequences by merging their per-layer caches (``type(c).merge([...])``), runs every
layer once over the batch, filters finished rows out and extends the batch with new ones. Eviction
state (kept positions, scores, reservoir RNG, query window, counters) belongs to one sequence, and
sequences of different lengths evict at different times, so :class:`BatchEvictionCache` keeps one
single-row :class:`~veloxquant_mlx.caches.cache.EvictionCache` per sequence for that state, while the
keys and values of every row live in one (B, H, capacity, D) buffer per layer
(``caches.batch_storage.BatchRows``):

* ``update_and_fetch`` runs each row's own step on its real new tokens (dropping the padding mlx-lm adds
  to prompts of different lengths): its policy, positions and per-row fields (the row's store holds no
  keys or values of its own, ``RowStore.external``); in decode the batch
  writes every row's token into the buffer with one slice assignment and returns a view of it, left
  padded to the row that keeps most (no per-step copy of the batch's rows);
* each row reads its kept rows as a view of the buffer (``row.keys``), so it scores and evicts exactly
  as it would alone; an eviction gives the row its own buffer of kept rows, which the next step writes
  back into that row's slice of the batch buffer (that row only);
* the query tap (``veloxquant_mlx.tap``) gives each row its own queries and asks this cache for the
  layer's mask, which hides every row's padding and is causal by each row's own positions.

So every row holds exactly what it would hold generating alone, and greedy tokens match a
stand-alone run (tests/test_batching.py). The loops are over batch rows only (never heads or tokens),
with Python-int bookkeeping and no host synchronization in ``update_and_fetch``.

A cache can batch when the query tap reaches it (per-layer masks need it) and it holds a single
sequence. Where it cannot, the cache has no ``merge`` attribute at all, which is how mlx-lm's server
decides to serve requests one at a time instead of batching (``hasattr(c, "merge")``).

Imports: ``caches.cache`` imports this module (``EvictionCache.merge = BatchMerge()``); this module never
imports ``caches.cache``, so there is no cycle: a row is recognized by the ``BatchMerge`` its class declares.
"""

from __future__ import annotations

import copy
import inspect

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import _BaseCache

from .batch_storage import BatchRows
from .quant import buf_nbytes, quantize_rows, rows_map
from .rows import PAD_POSITION, with_headroom

# Free columns a new batch buffer gets (EvictionCache.decode_step): a copy of the batch's rows every
# HEADROOM decode steps, whatever the batch size.
HEADROOM = 64


def unbatchable_reason(cache):
    """None when ``cache`` (a single-sequence EvictionCache) can join a batch, else why not."""
    if not getattr(cache, "tap_active", False):
        return ("the query tap is not active for this model, so per-layer masks cannot reach "
                "attention (a batch of rows with different kept counts needs them)")
    if getattr(cache, "pages", None) is not None:
        return ("prompt_eviction='offload' reads each sequence's prompt against its own page file, in an "
                "attention step of its own that a batch's shared buffers do not take")
    if getattr(cache, "cold", None) is not None:
        return (f"recall={cache.config.recall!r} keeps a cold tier per sequence, and a batch row's recall "
                "is not wired into the batch's shared buffers")
    pos = getattr(cache, "positions", None)
    if pos is not None and pos.shape[0] != 1:
        return f"it already holds a batch of {pos.shape[0]} sequences (merge takes one per cache)"
    return None


class BatchMerge:
    """``EvictionCache.merge``: present only on caches that can batch.

    ``cache.merge(caches)`` / ``Cls.merge(caches)`` returns a :class:`BatchEvictionCache`. On an
    instance that cannot batch, reading the attribute raises ``AttributeError``, so
    ``hasattr(cache, "merge")`` is False and mlx-lm serves its sequences one at a time."""

    def __get__(self, obj, owner=None):
        if obj is not None:
            reason = unbatchable_reason(obj)
            if reason is not None:
                raise AttributeError(f"{type(obj).__name__} cannot batch: {reason}")
        return BatchEvictionCache.merge


class BatchEvictionCache(_BaseCache):
    """One layer's cache for a batch of sequences: a single-row EvictionCache per sequence (its eviction
    state) and one key/value buffer for the batch (module docstring).

    Built by ``EvictionCache.merge``; mlx-lm drives it through ``prepare`` / ``finalize`` (padding
    of prompts of different lengths), ``filter`` / ``extend`` (rows leaving and joining) and
    ``extract`` (one row's cache, e.g. for the server's prompt cache).
    """

    def __init__(self, rows=()):
        self.rows = list(rows)
        for r in self.rows:
            self._check_row(r)
        # Padding of the prompt mlx-lm is about to feed, per row: real tokens still to come after
        # prepare(right_padding=...) (None: every token is real) and left padding still to skip.
        self._todo = [None] * len(self.rows)
        self._skip = [0] * len(self.rows)
        self._rpad = None  # right padding announced without lengths: resolved at the next update
        self._step = None  # (spans, fetched row counts, ragged) of the last update_and_fetch
        self._kv = BatchRows(self.rows, HEADROOM)  # every row's keys and values (caches.batch_storage)
        # the hidden-state tap's attention input (B, S, hidden) and the model-pass wrapper's token ids of the
        # next step: update_and_fetch hands each row its own slice
        self.attention_input = self._ids = None
        self._sync_bits()

    def _sync_bits(self):
        """Quantized rows (config.kv_bits): expose ``bits`` / ``group_size`` so mlx-lm's attention takes
        its quantized path for the whole batch; unquantized batches must not have them."""
        bits = self.rows[0].kv_bits if self.rows else None
        if any(r.kv_bits != bits or r.kv_group_size != self.rows[0].kv_group_size for r in self.rows):
            raise ValueError("a batch mixes rows stored with different kv_bits / kv_group_size")
        if bits is not None:
            self.bits, self.group_size = bits, self.rows[0].kv_group_size
        else:
            self.__dict__.pop("bits", None)
            self.__dict__.pop("group_size", None)

    @staticmethod
    def _check_row(row):
        # An EvictionCache (or subclass): the only classes that declare BatchMerge as their merge.
        if not isinstance(inspect.getattr_static(type(row), "merge", None), BatchMerge):
            raise TypeError(f"BatchEvictionCache holds EvictionCache rows, got {type(row).__name__}")
        reason = unbatchable_reason(row)
        if reason is not None:
            raise ValueError(f"{type(row).__name__} cannot batch: {reason}")

    # -- building and reshaping the batch (mlx-lm's BatchGenerator calls these) ----------------
    @classmethod
    def merge(cls, caches):
        """One batch cache from per-sequence caches (fresh or holding an earlier turn).

        The rows are copies (like mlx-lm's merge, the caches passed in are left as they were;
        MLX arrays are copy-on-write, so this costs no memory until a row changes)."""
        rows = []
        for c in caches:
            if isinstance(c, BatchEvictionCache):
                rows.extend(c.extract(i) for i in range(len(c.rows)))
                continue
            cls._check_row(c)
            row = copy.deepcopy(c)
            # Merging is an explicit continuation (the server's multi-turn reuse), not the
            # "one shared cache list for every generate()" mistake the base class warns about.
            row.continue_on_purpose()
            rows.append(row)
        return cls(rows)

    def filter(self, batch_indices):
        """Keep only the rows at ``batch_indices`` (in that order)."""
        idx = batch_indices.tolist() if isinstance(batch_indices, mx.array) else list(batch_indices)
        self.rows = [self.rows[i] for i in idx]
        self._kv.filter(idx, self.rows)
        self._todo = [self._todo[i] for i in idx]
        self._skip = [self._skip[i] for i in idx]
        self._step = None

    def extend(self, other):
        """Append ``other``'s rows (another BatchEvictionCache) after ours."""
        if not isinstance(other, BatchEvictionCache):
            raise TypeError(f"cannot extend a BatchEvictionCache with {type(other).__name__}")
        self.rows = self.rows + other.rows
        self._kv.extend(other._kv, self.rows)
        self._todo.extend(other._todo)
        self._skip.extend(other._skip)
        self._step = None
        self._sync_bits()

    def extract(self, idx: int):
        """An independent copy of row ``idx``'s cache with its own storage (the batch keeps its own)."""
        row = self.rows[idx]
        if not self._kv.synced(idx) or row.positions is None:
            out = copy.deepcopy(row)
        else:
            held = row.keys, row.values
            extra = row.positions.shape[2] - row.size()  # a lone row's buffers match its positions' capacity
            row.store.bind(*(rows_map(lambda a: with_headroom(a, extra), buf) for buf in held))
            try:
                out = copy.deepcopy(row)
            finally:
                row.store.bind(*held)
        out.store.external = False
        return out

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        """Announce the padding of the next prompt: ``right_padding`` (with each row's real
        ``lengths``, what BatchGenerator passes) or ``left_padding`` (tokens to skip in front)."""
        if left_padding is not None:
            self._skip = [s + int(p) for s, p in zip(self._skip, left_padding, strict=True)]
        if right_padding is not None and max(right_padding, default=0) > 0:
            if lengths is None:
                # Without lengths, the padded prompt must arrive in one call (real = S - padding).
                self._rpad = [int(p) for p in right_padding]
            else:
                self._todo = [int(n) for n in lengths]

    def finalize(self):
        """The padded prompt is done: later tokens are all real."""
        self._todo = [None] * len(self.rows)
        self._skip = [0] * len(self.rows)
        self._rpad = None

    def _spans(self, S: int):
        """Per row, (start, count) of its real tokens among the S new ones; consumes the padding."""
        if self._rpad is not None:
            self._todo = [max(S - p, 0) for p in self._rpad]
            self._rpad = None
        spans = []
        for i in range(len(self.rows)):
            a = min(self._skip[i], S)
            self._skip[i] -= a
            n = S - a
            todo = self._todo[i]
            if todo is not None:
                n = max(min(todo, n), 0)
                self._todo[i] = todo - n
            spans.append((a, n))
        return spans

    # -- the mlx-lm cache protocol -------------------------------------------------------------
    @property
    def offset(self) -> mx.array:
        """(B,) position of each row's first new token (what RoPE rotates at): tokens seen, minus
        left padding still to come (padding in front shifts the real tokens right)."""
        return mx.array([r.offset - s for r, s in zip(self.rows, self._skip)], dtype=mx.int32)

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, H, S = keys.shape[:3]
        if B != len(self.rows):
            raise ValueError(f"keys hold {B} sequences but the batch cache has {len(self.rows)} rows")
        spans = self._spans(S)
        hidden, fed, self.attention_input, self._ids = self.attention_input, self._ids, None, None
        held = []  # per row: rows stored before this step's tokens
        for i, (row, (a, n)) in enumerate(zip(self.rows, spans)):
            if n:  # the row's own step, exactly as alone (its keys / values are stored below, in the batch's)
                whole = B == 1 and n == S
                k, v = (keys, values) if whole else (keys[i:i + 1, :, a:a + n], values[i:i + 1, :, a:a + n])
                if hidden is not None:  # the row's own hidden states and token ids
                    row.attention_input = hidden if whole else hidden[i:i + 1, a:a + n]
                if fed is not None:
                    row.input_ids = fed if whole else fed[i:i + 1, a:a + n]
                row.update_and_fetch(k, v)
            held.append(row.size() - n)
        bits, gs = self.rows[0].kv_bits, self.rows[0].kv_group_size
        # every row's tokens quantized at once: the same as row by row (groups lie along head_dim)
        self._kv.store(spans, held, quantize_rows(keys, bits, gs), quantize_rows(values, bits, gs))
        ragged = False
        for row in self.rows:
            if row.positions is not None:
                row.note_fetched()
                ragged = ragged or row.fetched.ragged
        self._step = (spans, list(self._kv.n), ragged)
        return self._kv.fetch()

    @property
    def input_ids(self):
        return self._ids

    @input_ids.setter
    def input_ids(self, ids) -> None:
        """The model-pass wrapper's token ids of the next forward (B, S): each row gets its own slice."""
        self._ids = ids

    @property
    def needs_ids(self) -> bool:
        return bool(self.rows) and self.rows[0].needs_ids

    @property
    def needs_hidden(self) -> bool:
        return bool(self.rows) and self.rows[0].needs_hidden

    @property
    def pass_driven(self) -> bool:
        return any(r.pass_driven for r in self.rows)

    @pass_driven.setter
    def pass_driven(self, on: bool) -> None:
        for r in self.rows:
            r.pass_driven = on

    @property
    def pass_due(self) -> bool:
        """Some row's compression waits for the model pass."""
        return any(r.pass_due for r in self.rows)

    def observe_queries(self, queries: mx.array, scale=None) -> None:
        """The query tap: each row's real queries go to that row's cache."""
        if self._step is None:
            raise RuntimeError("observe_queries called before update_and_fetch")
        spans = self._step[0]
        if queries.shape[0] != len(self.rows):
            raise ValueError(f"queries hold {queries.shape[0]} sequences, the batch has {len(self.rows)}")
        S = queries.shape[2]
        for i, (row, (a, n)) in enumerate(zip(self.rows, spans)):
            if n:
                q = queries if (len(self.rows) == 1 and n == S) else queries[i:i + 1, :, a:a + n]
                row.observe_queries(q, scale)

    def step_state(self) -> list:
        """Every row's step state (EvictionCache.step_state), tied to the layer's output by the tap."""
        return [a for row in self.rows for a in row.step_state()]

    def attention_mask(self, mask, queries: mx.array):
        """This layer's mask: each row sees its own kept rows (not the left padding that lines the
        rows up), causally by its own positions; padded queries see all their row's keys."""
        spans, counts, ragged = self._step
        S = queries.shape[2]
        R = max(counts)
        uniform = all(c == R for c in counts) and all(a == 0 and n == S for a, n in spans)
        if uniform and not ragged and not isinstance(mask, mx.array):
            return None if S == 1 else "causal"  # every row: kept rows then its S new ones
        if ragged:
            return self._positions_mask(spans, counts, queries)
        j = mx.arange(S)[None, :, None]
        k = mx.arange(R)[None, None, :]
        start = mx.array([R - c for c in counts])[:, None, None]
        first = mx.array([a for a, _ in spans])[:, None, None]
        n_new = mx.array([n for _, n in spans])[:, None, None]
        t = j - first  # index of the query among the row's real new tokens
        pad_q = (t < 0) | (t >= n_new)
        last = mx.where(pad_q, R, R - n_new + t)  # last visible key column
        return mx.expand_dims((k >= start) & (k <= last), 1)  # (B, 1, S, R)

    def _positions_mask(self, spans, counts, queries):
        """Per-head mask from absolute positions (ragged rows: per-head budgets, padding inside)."""
        S, R = queries.shape[2], max(counts)
        H = next(r.fetched.positions.shape[1] for r, c in zip(self.rows, counts) if c)
        pos = []
        for row, c in zip(self.rows, counts):
            p = row.fetched.positions if c else mx.zeros((1, H, 0), mx.int32)
            if c < R:
                p = mx.concatenate([mx.full((1, H, R - c), PAD_POSITION, mx.int32), p], axis=2)
            pos.append(p)
        pos = mx.concatenate(pos, axis=0)  # (B, H, R)
        j = mx.arange(S)[None, :]
        first = mx.array([a for a, _ in spans])[:, None]
        n_new = mx.array([n for _, n in spans])[:, None]
        base = mx.array([r.offset - n for r, (_, n) in zip(self.rows, spans)])[:, None]
        t = j - first
        q_pos = mx.where((t < 0) | (t >= n_new), PAD_POSITION - 1, base + t)  # (B, S)
        visible = mx.expand_dims(pos, 2) <= q_pos[:, None, :, None]  # (B, H, S, R)
        group = queries.shape[1] // H
        # quantized attention broadcasts a per-KV-head mask over the GQA group (EvictionCache.attention_mask)
        if group == 1 or getattr(self, "bits", None) is not None:
            return visible
        return mx.repeat(visible, group, axis=1)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise NotImplementedError("eviction caches serve full-attention layers only")
        # The layer's real mask comes from attention_mask (the query tap); this is the mask mlx-lm
        # builds from cache[0] and passes to every layer.
        if N == 1 and not return_array:
            return None
        if return_array:
            return create_causal_mask(N, offset=max((r.size() for r in self.rows), default=0))
        return "causal"

    # -- introspection --------------------------------------------------------------------------
    @property
    def state(self):
        """Every row's state (what mlx-lm evaluates after each prompt chunk)."""
        return [r.state for r in self.rows]

    @state.setter
    def state(self, v):
        raise NotImplementedError("a BatchEvictionCache is rebuilt with merge(), not from a state")

    def size(self) -> int:
        return max((r.size() for r in self.rows), default=0)

    def empty(self) -> bool:
        return all(r.empty() for r in self.rows)

    @property
    def nbytes(self) -> int:
        """Bytes the batch buffers and every row's own state hold (allocated, not just kept)."""
        return self._kv.nbytes + sum(r.nbytes - buf_nbytes(r.store.keys) - buf_nbytes(r.store.values) for r in self.rows)

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n):
        raise NotImplementedError("eviction caches cannot be trimmed: evicted rows are gone")

    def __repr__(self):
        kinds = sorted({type(r).__name__ for r in self.rows})
        return f"BatchEvictionCache({len(self.rows)} rows of {', '.join(kinds) or 'nothing'})"
