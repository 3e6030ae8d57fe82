"""What a method may read of its cache: the :class:`View` (read-only) and the :class:`Step` it is handed.

A View reads the cache's stored rows when asked, so a method that needs no keys never loads them: keys
and values come back dequantized where the rows are stored quantized, and every array is a new array
object (writing into it never reaches the cache). Setting an attribute raises.
"""

from __future__ import annotations

import weakref

import mlx.core as mx

from ..ops.attention import blocked_window_probs, window_attention_probs


class View:
    """A read-only view of one cache for its method (module docstring)."""

    __slots__ = ("_cache", "_of", "n_sink", "recent", "budget")

    def __init__(self, cache):
        # a proxy: the cache holds its view, and a cycle would keep a freed cache (and its files) alive
        object.__setattr__(self, "_cache", weakref.proxy(cache))
        object.__setattr__(self, "_of", id(cache))
        # the sinks and the recent window every eviction keeps, and the rows per KV head this layer keeps
        # (Method.layer_budget): fixed for the cache's life
        for name in ("n_sink", "recent", "budget"):
            object.__setattr__(self, name, getattr(cache, name))

    def __setattr__(self, name, value):
        raise AttributeError(f"a View is read-only (set {name!r})")

    def __delattr__(self, name):
        raise AttributeError(f"a View is read-only (delete {name!r})")

    def __deepcopy__(self, memo):  # a copied cache (batching, prompt-cache reuse) gets a view of the copy
        new, cache = View.__new__(View), memo[self._of]  # (the copy's attributes are not all set yet)
        for name, value in (("_cache", weakref.proxy(cache)), ("_of", id(cache)), ("n_sink", self.n_sink),
                            ("recent", self.recent), ("budget", self.budget)):
            object.__setattr__(new, name, value)
        return new

    @property
    def keys(self) -> mx.array:
        """(B, H, rows, D) the stored keys (post-RoPE), as attention reads them."""
        st = self._cache.store
        k = st.keys
        return k[:, :, :st.rows] if st.bits is None and isinstance(k, mx.array) else self._cache.stored("keys")

    @property
    def values(self) -> mx.array:
        """(B, H, rows, D_v) the stored values."""
        st = self._cache.store
        v = st.values
        return v[:, :, :st.rows] if st.bits is None and isinstance(v, mx.array) else self._cache.stored("values")

    @property
    def positions(self) -> mx.array:
        """(B, H, rows) int32 absolute positions of the stored rows (``PAD_POSITION`` on padding)."""
        return self._cache.stored("positions")

    def field(self, name: str) -> mx.array:
        """(B, H, rows) float32 per-row state the method declared (``Method.row_fields``)."""
        if self._cache.holds:
            self._cache.fold_held()
        st = self._cache.store
        f = st.fields.get(name)
        return f[:, :, :st.rows] if f is not None and st.keys is not None else self._cache.stored(name)

    def window(self):
        """(queries (B, H_q, W, D), their positions (W,), scale) of the last W queries; where none was seen
        yet (no query tap, an eviction before the first query) the newest W keys stand in, scaled 1/sqrt(D)."""
        return self._cache.observed_window()

    def window_attention(self, reduce, align: int = 1) -> mx.array:
        """``reduce(p)`` of the observation window's softmax attention ``p`` (B, H, G, W, rows) over every
        stored row (GQA group G; the rows on the last axis of what ``reduce`` returns). At a paged prompt's
        end (:attr:`paged`) the rows come from its file a block at a time (a multiple of ``align`` rows but
        the last), each block reduced before the next is read, so the window's attention over a long prompt
        never is in memory whole; else all at once."""
        q, q_pos, scale = self.window()
        blocks = self._cache.key_blocks(align)
        if blocks is None:
            return reduce(window_attention_probs(q, self.keys, q_pos, self.positions, scale))
        return blocked_window_probs(q, q_pos, scale, blocks, reduce)

    @property
    def paged(self) -> bool:
        """The stored rows are a paged prompt's, still in its file (``prompt_eviction="offload"``, at the
        prompt's end): :meth:`window_attention` reads them a block at a time, :attr:`keys` all at once."""
        return self._cache.key_blocks(1) is not None

    def key(self) -> mx.array:
        """A fresh PRNG key (the cache's key for ``config.seed`` and the layer, split at every call)."""
        return self._cache.next_key()

    rows = property(lambda self: self._cache.store.rows, doc="stored rows per head (padding included)")
    offset = property(lambda self: self._cache.offset, doc="tokens seen (the position the next row gets)")
    shard = property(lambda self: self._cache.dist, doc="this rank's caches.shard.HeadShard (tensor parallel), or None")
    ragged = property(lambda self: self._cache.store.ragged, doc="heads keep different numbers of rows (padding)")
    compressing = property(lambda self: self._cache.schedule.compressing,
                           doc="inside the one-shot compression when a prompt ends (not a decode-time eviction)")


class Step:
    """One step's new rows, as ``Method.on_rows`` receives them."""

    __slots__ = ("rows", "queries", "scale", "all_visible", "hidden", "ids", "attend", "keys", "values")

    def __init__(self):
        self.rows = 0  # S, the number of new rows (the newest S stored rows)
        self.queries = None  # (B, H_q, S, D) their post-RoPE queries (None: none arrived, no query tap)
        self.scale = None  # the queries' softmax scale
        self.all_visible = False  # every stored row is visible to the step's query (one query, no padding)
        self.hidden = None  # (B, S, d_model) the step's attention input (Needs.hidden_states), or None
        self.ids = None  # (B, S) token ids of the step (Needs.model_pass), or None
        self.attend = False  # the method may return the layer's attention output over the stored rows
        # (B, H, rows, D) the rows the step attends to, as attention reads them: the stored ones (and, in a
        # reading model pass, the forward's own after them, never stored)
        self.keys = self.values = None
