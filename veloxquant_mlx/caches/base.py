"""EvictionCache: the machinery every eviction method shares.

A subclass supplies ``scores()`` (higher = keep) or, where its selection is special,
``select_rows()``. Everything else is shared: this file holds what a method declares and may override,
the mlx-lm protocol, the observed-query window and amortized eviction; its mixins hold the light
decode step (``light.py``), the fetched rows' masks (``masks.py``), the prompt-time policy
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
from ..ops import gather_rows, keep_top_rows
from ..ops.select import gather_rows_of
from ..ops.allocation import ada_keep
from ..ops.attention import fused_scoring_default
from .accounting import Accounting
from .light import LightStep
from .masks import AttentionMasks
from .batch import BatchMerge
from .policy import OnePass, PromptPolicy, PromptState
from .quant import buf_parts, from_parts, row_dim
from .recall_disk import make_cold_tier
from .state import StateRoundTrip
from .storage import PAD_POSITION, RowStorage, with_headroom

_warned_ada_no_tap: set = set()


class EvictionCache(LightStep, AttentionMasks, PromptPolicy, RowStorage, Accounting, StateRoundTrip, _BaseCache):
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

    # What a method needs, declared (the builder and the config read these; nothing is probed) --------
    needs_queries = True  # the query tap's post-RoPE queries (False: key-only / position-only methods)
    needs_hidden_states = False  # each attention module's input: the builder installs the hidden-state tap
    needs_model_pass = False  # True: the builder wraps the model so run_model_pass can run (model_pass.py)
    compresses_in_model_pass = False  # the prompt-end compression runs in that pass (recall_hold refuses it)
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

    # -- mlx-lm cache protocol -------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        r = self._rows
        if r < self._light_rows and keys.shape == self._light_k and values.shape == self._light_v \
                and keys.dtype == self.keys.dtype and values.dtype == self.values.dtype:
            # The light step (refresh_light): one token between evictions, into the headroom. The new row's
            # position is already stored (prefilled); nothing else of the policy can happen here.
            self.keys[:, :, r:r + 1] = keys
            self.values[:, :, r:r + 1] = values
            self._rows = r = r + 1
            self.offset += 1
            self._fetched_store, self._fetched_rows, self._light_now = self.positions, r, True
            self._fetched_ragged = self._light_ragged
            if self.on_light_append is not None:
                self.on_light_append(r - 1)
            return self.keys[:, :, :r], self.values[:, :, :r]
        self._light_rows, self._light_now = 0, False
        if self._awaiting_queries:
            raise self.missing_tap_error()
        self._check_kv(keys, values)
        if self.cold is not None and self.keys is None:
            self.cold.check_head_dim(keys.shape[-1])
        self._before_append(keys.shape[2])
        self._append(keys, values)
        fetched = self._fetch()  # this step attends to every row, whatever is evicted after it
        self.note_fetched()
        if self.queries_from_keys:  # no tap: observe here, and tie the step state to what attention reads
            self._observe(keys, keys.shape[-1] ** -0.5)
            fetched = tuple(mx.depends(list(fetched), self.step_state()))
        else:
            self._awaiting_queries = self._tap_unproven  # observe_queries clears it
        return fetched

    def missing_tap_error(self) -> RuntimeError:
        """This cache was saved from a model with the query tap and, since it was loaded, its last step's
        queries never arrived: the model's attention does not go through the tap (a fresh process that
        loaded the file without ``model=``). Continuing would skip the method's scoring and recall, and
        ragged storage would be attended without its padding mask, so it is refused."""
        self._awaiting_queries = self._tap_unproven = False
        return RuntimeError(
            f"{type(self).__name__} (layer {self.layer_idx}) expects the query tap, and the model's last step "
            "did not deliver its queries: load caches with veloxquant_mlx.load_prompt_cache(path, model=model) "
            "(or call KVCacheBuilder.attach(model, caches)) before generating with them")

    def observe_queries(self, queries: mx.array, scale: float | None = None) -> None:
        """Called by the query tap right after ``update_and_fetch`` with the same step's queries."""
        if self.keys is None:
            raise RuntimeError("observe_queries called before any update_and_fetch")
        self._awaiting_queries = self._tap_unproven = False  # the tap delivers this cache's queries
        if not isinstance(queries, mx.array) or queries.ndim != 4:
            raise ValueError(f"queries must be a 4-D mx.array (B, H_q, S, D), got "
                             f"{getattr(queries, 'shape', type(queries).__name__)}")
        B, Hq, S, D = queries.shape
        kB, kH = self.positions.shape[:2]
        kD = row_dim(self.keys, self.kv_bits)
        if B != kB or D != kD or Hq % kH != 0 or S > self.offset:
            raise ValueError(f"queries {tuple(queries.shape)} do not fit keys (B={kB}, H_kv={kH}, D={kD}, "
                             f"offset={self.offset}): need same B and D, H_q a multiple of H_kv, S <= offset")
        self._observe(queries, D ** -0.5 if scale is None else float(scale))

    def observe_and_attend(self, queries: mx.array, scale: float | None = None):
        """The tap's one-pass path: observe this step's queries, and return the layer's attention output
        when the method's scoring pass computed it from its own weights (None: the tap calls mlx-lm's
        attention). The output must equal causal attention over the rows ``update_and_fetch`` returned."""
        self.attend.active = True
        try:
            self.observe_queries(queries, scale)
        finally:
            self.attend.active = False
        out, self.attend.out = self.attend.out, None
        return out

    def one_pass(self, mode: str, on: str = "fused") -> bool:
        """Inside :meth:`observe_and_attend`, should this step's scoring pass hand the layer's output back
        (``self.attend.out``) instead of the tap computing it again? Yes when the method's option
        ``mode`` says ``on`` (always) or ``"auto"`` (where one pass is the faster: the CPU)."""
        return self.attend.active and (mode == on or (mode == "auto" and fused_scoring_default()))

    def step_state(self) -> list:
        """Arrays a step updates that attention does not read (positions, per-row scores, the query
        window): the query tap makes the layer's output depend on them (``mx.depends``), so they are
        evaluated with the token instead of growing a lazy graph that pins old buffers."""
        if self.keys is None:
            return []
        return [a for a in (self.positions, self._window_q, *self.row_extras.values()) if a is not None]

    def _observe(self, queries: mx.array, scale: float) -> None:
        self.scale = scale
        self.queries_observed += 1
        self.on_queries(queries)
        if self.cold is not None and self.cold.armed:
            self._recall(queries, scale)
        if self.prompt.ending:
            self._end_prompt()
        elif self._evicts_during(queries.shape[2]) and self._rows > self.evict_threshold():
            self._evict()
        self.refresh_light()

    # -- eviction ---------------------------------------------------------------------------
    def next_key(self) -> mx.array:
        """A fresh PRNG key for one eviction step (same seed -> same sequence of keys)."""
        k = mx.random.split(self._rng)
        self._rng = k[0]
        return k[1]

    def _evict(self):
        sel = self.select_rows()
        idx, real = (sel if isinstance(sel, tuple) else (sel, None))
        if self.cold is not None:  # the rows not kept go to the cold tier (before any buffer changes)
            self.cold.evicted(self, idx, real)
        if real is not None:
            idx, real = self.trim_ragged(idx, real)
        K = idx.shape[-1]
        # The kept rows go into NEW buffers of exactly K + headroom rows (allocation follows the budget).
        # Never an in-place `buf[:, :, :K] = ...`: this step's attention still holds the slice
        # update_and_fetch returned, and an in-place write made that slice read the compacted rows
        # (measured: a chunk that triggered eviction attended to wrong keys). Gathering from the whole
        # buffers (row indices are < rows) keeps the flattening free.
        extra = self.headroom_after_eviction(K)
        # Keys/values with their headroom in ONE gather (headroom rows repeat row 0; they are overwritten
        # before anything reads them): a gather then a concatenate with zeros copied the kept rows twice,
        # and MLX's CPU concatenate cost ~3x the gather (measured at 442 x 8 x 128 fp32 rows).
        # Quantized rows: packed words, scales and biases are gathered alike (never requantized).
        k_idx = idx if extra <= 0 else mx.concatenate([idx, mx.zeros((*idx.shape[:-1], extra), idx.dtype)], -1)
        k_parts, v_parts = buf_parts(self.keys), buf_parts(self.values)  # one shared row index for all of them
        kept = gather_rows_of(k_parts + v_parts, k_idx)
        self.keys, self.values = from_parts(kept[:len(k_parts)], self.keys), from_parts(kept[len(k_parts):], self.values)
        pos = gather_rows(self.positions, idx)
        if real is not None:
            pos = mx.where(real, pos, PAD_POSITION)
        self._ragged = real is not None
        self.positions = self.future_positions(pos, extra)
        for name in self.row_extras:
            self.row_extras[name] = with_headroom(gather_rows(self.row_extras[name], idx), extra)
        self._rows = K
        self._evict_floor = K
        self.evictions += 1
        self._light_rows = 0  # a new storage: the next full step decides again
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
