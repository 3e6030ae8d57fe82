"""EvictionCache: the machinery every eviction method shares.

A subclass supplies ``scores()`` (higher = keep) or, where its selection is special,
``select_rows()``. Everything else is shared: this file holds what a method declares and may override,
the observed-query window and amortized eviction; its mixins hold mlx-lm's contract and the light
decode step (``adapter.py``), the fetched rows' masks (``masks.py``), the prompt-time policy
(``policy.py``), the row storage (``storage.py``: buffers with exact headroom, kept absolute
positions per (batch, head), ragged width), byte accounting (``accounting.py``) and state round trips
(``state.py``).

Contract with mlx-lm (see docs/architecture.md): models call ``update_and_fetch`` with keys already
rotated at ``offset``; we return the kept rows followed by the new rows, so the string mask
``"causal"`` stays right. Nothing in ``update_and_fetch`` / ``observe_queries`` forces a host sync:
all sizes are Python ints derived from shapes, all data work is lazy MLX.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..config import KVCacheConfig
from ..options import NoOptions
from ..ops import keep_top_rows
from ..ops.allocation import ada_keep
from ..ops.attention import fused_scoring_default
from .accounting import Accounting
from .adapter import MlxLmAdapter
from .masks import AttentionMasks
from .batch import BatchMerge
from .pages import PromptPages
from .policy import OnePass, PromptPolicy, PromptState
from .recall_disk import make_cold_tier
from .state import StateRoundTrip
from .storage import PAD_POSITION, RowStorage

_warned_ada_no_tap: set = set()


class EvictionCache(MlxLmAdapter, AttentionMasks, PromptPolicy, RowStorage, Accounting, StateRoundTrip, _BaseCache):
    """Base class of every eviction cache (not registered itself)."""

    Options = NoOptions
    method: str = ""
    step = 256  # prompt chunks grow storage in steps of this many rows, like mlx-lm's KVCache
    decode_step = 64  # single-token appends that outgrow the buffer add this many rows (unbounded decode)
    query_window = 0  # how many recent queries the method scores with (0: none kept)
    prefill_only = False  # True: compress once when the prompt ends, then only append
    # Allocation axis: does scores() rank rows per head comparably across heads, so that Ada-KV can
    # move budget between heads? None = decide automatically (yes when the method supplies scores()
    # and keeps the base select_rows, which is where the allocation is applied).
    supports_ada: bool | None = None
    dist = None  # HeadShard of this rank under tensor parallelism (caches.shard); None: alone
    # Can the method store its kept rows quantized (config.kv_bits)? A method whose state cannot live
    # in packed rows sets this False and says why in kv_bits_unsupported_reason.
    supports_kv_bits = True

    # -- construction -----------------------------------------------------------------------
    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, n_layers: int = 1):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if not isinstance(self, config.cache_class):
            raise ValueError(f"config.method={config.method!r} builds {config.cache_class.__name__}, "
                             f"not {type(self).__name__}")
        if not (isinstance(layer_idx, int) and isinstance(n_layers, int) and 0 <= layer_idx < n_layers):
            raise ValueError(f"need 0 <= layer_idx < n_layers, got layer_idx={layer_idx}, n_layers={n_layers}")
        self.config = config
        self.options = config.options
        self.kv_bits, self.kv_group_size = config.kv_bits, config.kv_group_size
        if config.kv_bits is not None:
            # mlx-lm's scaled_dot_product_attention picks its quantized path by hasattr(cache, "bits"):
            # the attributes exist only on quantized caches (an unquantized cache must not have them).
            self.bits, self.group_size = config.kv_bits, config.kv_group_size
        self.layer_idx = layer_idx
        self.n_layers = n_layers
        self.n_sink = config.n_sink
        self.recent = config.recent
        self.budget = self.layer_budget()
        self.slack = self.eviction_slack()
        self.keys = self.values = self.positions = None
        self.row_extras: dict = {}  # per-row method state, grown/appended/gathered with the keys
        self.offset = 0
        self._rows = 0
        self.evictions = 0
        self.queries_observed = 0
        self.queries_from_keys = False  # set by the builder when the model has no query tap
        self.tap_active = False  # set by the builder when per-layer masks reach this cache
        # A loaded cache that expects the tap checks that its first step's queries arrive (missing_tap_error).
        self._tap_unproven = self._awaiting_queries = False
        self.scale = None
        self._window_q = None
        self._window_at = 0  # a full window is a ring: the row the next query overwrites (its oldest)
        self._light_rows = 0  # see refresh_light: a decode step appending below this many rows is light
        self._light_now = False  # this step's append was light: its queries take the light path too
        self.prompt = PromptState()  # prompt-time policy: prompt open, ending, compressing (caches.policy)
        self._rng = mx.random.key(config.seed + layer_idx)
        self._evict_floor = 0  # rows right after the last eviction (> budget only for ragged storage)
        # The rows the last update_and_fetch returned (and whether any was padding): the tap's mask must
        # describe those rows even if observe_queries evicted right after the fetch. Either the first
        # ``_fetched_rows`` rows of the positions buffer ``_fetched_store``, or given positions.
        self._fetched_store = self._fetched_given = None
        self._fetched_rows = 0
        self._fetched_ragged = False
        # Ragged decode: (positions buffer, group, per-KV-head?, mask over its capacity), reused while the
        # buffer is the same object: between evictions a decode step only appends real rows (see decode_mask)
        self._decode_mask = None
        self.attend = OnePass()  # the tap's one-pass attention: an output a scoring pass hands back
        self.cold = make_cold_tier(config)  # recallable eviction (config.recall; caches.recall), or None
        # prompt_eviction="offload": the page file every row goes to while an input is read (caches.pages)
        self.pages = PromptPages(config) if config.prompt_eviction == "offload" else None

    # What a method needs, declared (the builder and the config read these; nothing is probed) --------
    needs_queries = True  # the query tap's post-RoPE queries (False: key-only / position-only methods)
    needs_hidden_states = False  # each attention module's input: the builder installs the hidden-state tap
    needs_model_pass = False  # True: the builder wraps the model so run_model_pass can run (model_pass.py)
    compresses_in_model_pass = False  # the prompt-end compression runs in that pass (recall_hold refuses it)
    # The per-row field this method adds every query's attention mass to (H2O): the paged prompt computes it
    # over the rows in its file too, in a second pass over them, instead of the method's on_queries.
    attention_mass_field: str | None = None
    model_pass_note = ""  # what runs in that pass, for a progress bar

    @classmethod
    def attach_model(cls, model, caches: list) -> None:
        """The model itself, once the builder made its caches of this class (kvzap: its identity picks the scorer)."""

    # Hooks a method may override -------------------------------------------------------------

    @classmethod
    def run_model_pass(cls, driver, seq) -> None:
        """Work this method deferred (``caches.forward.defer``) to after the model's forward, with the
        model at hand: ``seq`` is one sequence's per-layer (cache, batch index or None) pairs, ``driver``
        the glue's ``model_pass.ModelPassDriver`` (``forward(inputs, cache)``, ``scratch``, ``tokenizer``)."""
        raise NotImplementedError(f"{cls.__name__} deferred work to a model pass but has no run_model_pass")

    # KVCacheConfig fields this method defaults differently from HEAD_BUDGET_DEFAULTS (allocation,
    # floor_alpha, max_head_factor), used where the config leaves them unset.
    config_defaults: dict = {}

    @classmethod
    def default_recent(cls, budget: int, options) -> int:
        """Recent window used when the config leaves ``recent`` unset."""
        return min(32, max(budget // 8, 1))

    @classmethod
    def check_config(cls, config: KVCacheConfig) -> None:
        """Extra cross-field validation for a method (raise ValueError)."""

    @classmethod
    def kv_bits_unsupported_reason(cls):
        """None when this method can store its kept rows quantized, else why not."""
        return None if cls.supports_kv_bits else f"{cls.__name__} cannot store quantized rows"

    @classmethod
    def allocation_unsupported_reason(cls, allocation: str):
        """None when this method supports ``allocation`` ("uniform" / "ada"), else why not."""
        if allocation != "ada":
            return None
        if cls.supports_ada is not None:
            return None if cls.supports_ada else f"{cls.__name__} has no per-head importance score"
        if cls.select_rows is not EvictionCache.select_rows:
            return (f"{cls.__name__} overrides select_rows (its own selection rule), and the Ada-KV "
                    "allocation lives in the base select_rows; the method must call "
                    "self.ada_select(scores) itself and set supports_ada = True")
        if cls.scores is EvictionCache.scores:
            return f"{cls.__name__} has no per-head scores() to allocate with"
        return None

    @classmethod
    def supports_allocation(cls, allocation: str) -> bool:
        return cls.allocation_unsupported_reason(allocation) is None

    def layer_budget(self) -> int:
        """Tokens kept per KV head in this layer (PyramidKV varies it by layer)."""
        return self.config.budget

    def eviction_slack(self) -> int:
        """Rows allowed above the budget before an eviction step runs (amortizes the cost): the
        method's ``evict_every`` option when it has one, else 32. A method with its own unit overrides."""
        return getattr(self.options, "evict_every", None) or 32

    def extra_row_fields(self) -> dict:
        """Per-row state to keep aligned with the rows: name -> fill value for new rows."""
        return {}

    # Row fields the method's own ``_append`` writes for every new row: the storage skips their fill write
    # in an existing buffer (one operation per layer and decode step fewer; new buffers are still filled).
    rows_written_on_append: tuple = ()

    def on_queries(self, queries: mx.array) -> None:
        """Receive the post-RoPE queries (B, Hq, S, D) of the newest S positions."""
        self.note_window(queries)

    def note_window(self, queries: mx.array) -> None:
        """Keep the newest ``query_window`` queries (the observation window)."""
        W, S, q = self.query_window, queries.shape[2], self._window_q
        if not W:
            return
        if q is not None and S == 1 and q.shape[2] == W:  # a full window: one query overwrites the oldest
            i = self._window_at
            q[:, :, i:i + 1] = queries
            self._window_at = i + 1 if i + 1 < W else 0
        elif q is None or S >= W:
            # A copy, not a slice: a view of the last W rows would pin the whole chunk's queries.
            self._window_q, self._window_at = mx.contiguous(queries[:, :, -W:, :]), 0
        else:  # one concatenate (a new array) of the rows still in the window and the new ones
            q = self.window_queries()[0]
            self._window_q, self._window_at = mx.concatenate([q[:, :, max(q.shape[2] + S - W, 0):], queries], 2), 0

    def scores(self) -> mx.array:
        """(B, H, rows) importance of every stored row; higher is kept."""
        raise NotImplementedError

    def select_rows(self):
        """Row indices (B, H, K) to keep, ascending; optionally also a (B, H, K) bool mask of rows
        that are real (False rows become padding: ragged per-head budgets)."""
        if self.use_ada():
            return self.ada_select(self.scores())
        return keep_top_rows(self.scores(), self.keep_rows(), self.n_sink, self.recent)

    def use_ada(self) -> bool:
        """True when this eviction step should use Ada-KV head-adaptive budgets.

        Ragged storage is only safe when the per-layer mask reaches attention (the query tap):
        without it, fall back to uniform budgets with a one-time warning."""
        if self.config.allocation != "ada":
            return False
        if not self.tap_active:
            if self.method not in _warned_ada_no_tap:
                _warned_ada_no_tap.add(self.method)
                warnings.warn(f"allocation='ada' needs the query tap's per-layer mask (ragged per-head "
                              f"storage); it is not active for {type(self).__name__}, so uniform "
                              "per-head budgets are used instead", stacklevel=3)
            return False
        return True

    def ada_select(self, scores: mx.array):
        """(idx, real): Ada-KV allocation of this layer's H x budget rows over (B, H, rows) scores."""
        # Tensor parallel (self.dist): the layer-wide steps combine every rank's heads (radix top-k).
        keep = self.keep_rows()
        return ada_keep(scores, self.stored("positions"), self.offset, keep, self.n_sink,
                        self.recent, self.config.floor_alpha, PAD_POSITION, layer=self.dist,
                        cap=self.config.head_cap_rows(keep))

    def keep_rows(self) -> int:
        """Rows per head this eviction step keeps: the budget, or the target of a compression that
        asks for another (``PromptState.compressing_to``); the budget itself never changes."""
        t = self.prompt.target
        return self.budget if t is None else t

    def evict_threshold(self) -> int:
        """Stored rows above which a (decode-bounded) method runs an eviction step: the rows it keeps
        (``keep_rows``; kvzap's layer share) or the last eviction's, plus the slack."""
        return max(self.keep_rows(), self._evict_floor) + self.slack

    def one_pass(self, mode: str, on: str = "fused") -> bool:
        """Inside :meth:`observe_and_attend`, should this step's scoring pass hand the layer's output back
        (``self.attend.out``) instead of the tap computing it again? Yes when the method's option
        ``mode`` says ``on`` (always) or ``"auto"`` (where one pass is the faster: the CPU)."""
        return self.attend.active and (mode == on or (mode == "auto" and fused_scoring_default()))

    # -- eviction ---------------------------------------------------------------------------
    def next_key(self) -> mx.array:
        """A fresh PRNG key for one eviction step (same seed -> same sequence of keys)."""
        k = mx.random.split(self._rng)
        self._rng = k[0]
        return k[1]

    def _evict(self):
        unpaged = self.pages is not None and self.pages.before_evict(self)  # a paged prompt's rows come back
        sel = self.select_rows()
        idx, real = (sel if isinstance(sel, tuple) else (sel, None))
        if self.cold is not None:  # the rows not kept go to the cold tier (before any buffer changes)
            self.cold.evicted(self, idx, real)
        idx = self.compact(idx, real)  # new buffers of the kept rows and the headroom (caches.storage)
        self._evict_floor = idx.shape[-1]
        self.evictions += 1
        self._light_rows = 0  # a new storage: the next full step decides again
        if unpaged:  # the kept rows now, so this layer's read-back rows are freed before the next layer reads
            mx.eval(self.step_state() + [self.keys, self.values])
        self.on_evicted(idx)

    def on_evicted(self, idx: mx.array) -> None:
        """Hook after an eviction step (idx: the kept old row indices)."""

    def observed_window(self):
        """(queries (B, Hq, W, D), their absolute positions (W,), scale) of the observation window, for a
        method's scores. Where no query was ever observed (no tap, an eviction before the first observe),
        the newest W stored keys stand in for them at the newest W positions, scaled by 1/sqrt(D): the one
        fallback every method that scores with queries shares."""
        q, q_pos = self.window_queries()
        if q is None:
            r = self._rows
            W = min(self.query_window, r)
            q, q_pos = self.stored("keys")[:, :, r - W:], mx.arange(self.offset - W, self.offset, dtype=mx.int32)
        return q, q_pos, (self.scale if self.scale is not None else q.shape[-1] ** -0.5)

    def window_queries(self):
        """(queries (B, Hq, W, D), their absolute positions (W,)) of the observation window."""
        q, at = self._window_q, self._window_at
        if q is None:
            return None, None
        if at:  # the ring's rows in position order
            q = mx.concatenate([q[:, :, at:], q[:, :, :at]], axis=2)
        W = q.shape[2]
        return q, mx.arange(self.offset - W, self.offset, dtype=mx.int32)

    # Batching (BatchGenerator, batch_generate, mlx_lm.server): merge returns a
    # caches.batch.BatchEvictionCache holding one single-row cache per sequence, so every
    # row keeps its own eviction state; filter/extend/extract live there. `merge` exists only on
    # caches that can batch (the server probes hasattr(c, "merge")), never KVCache.merge.
    merge = BatchMerge()
