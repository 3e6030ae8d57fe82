"""EvictionCache: the adapter between mlx-lm's cache contract and an eviction method.

Models call ``keys, values = cache.update_and_fetch(keys, values)`` with keys already rotated at ``offset``;
the cache returns the kept rows followed by the new ones (so mlx-lm's bottom-right "causal" mask stays
right), and the query tap's ``tap_step`` hands it the same step's queries. The cache is a composition:

* ``store`` (``caches.rows.RowStore``): the kept rows, quantized rows, per-row fields, bytes, state arrays;
* ``schedule`` (``caches.schedule.Schedule``): when to evict, and to how many rows;
* ``window`` (``caches.window.QueryWindow``): the queries the method scores with;
* ``pages`` (``caches.pages``) and ``cold`` (``caches.recall``): the paged prompt and the recall tier;
* ``dist`` (``caches.shard.HeadShard``): this rank's heads under tensor parallelism;
* ``method`` (``caches.method.Method``): the rule, reading the cache through ``view`` only.

One way through a step: ``update_and_fetch`` appends and fetches (``_begin`` first: checks, the prompt-time
policy, the paged prompt and the recall tier), ``_observe`` hands the queries to the window and the method,
and ``_settle`` asks the schedule whether to evict, the one place ``evict`` is called. Between evictions a
decode step takes a cheap branch of the same path (``_light``: the schedule has nothing to do, so the
checks and the policy are skipped); it keeps every row, score and token the full step keeps
(tests/test_light_step.py). Nothing in a step forces a host sync: sizes are Python ints from shapes, data
work is lazy MLX.
"""

from __future__ import annotations

import collections
import contextlib
import json
import warnings

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache

from ..config import KVCacheConfig
from .allocation import Uniform
from .batch import BatchMerge
from .masks import Fetched, layer_array_mask
from .pages import PromptPages
from .passes import run_model_pass
from .quant import buf_shape, dequantize_rows, quantize_rows, row_dim, rows_zip
from .recall_disk import make_cold_tier
from .rows import PAD_POSITION, RowStore
from .schedule import Schedule
from .subclass import method_of_subclass
from .view import Step, View
from .window import QueryWindow

HELD_STEPS = 32  # the most decode steps whose rows' on_rows the cheap branch holds (fold_held)
_FORMAT_VERSION = 2  # of the saved metadata; 2: "prompt_open" replaced "compressed"
_warned: set = set()


class OnePass:
    """The tap's one-pass path (``observe_and_attend``): a method's scoring may compute the layer's attention
    output from its own weights and hand it back instead of the tap computing it again."""

    __slots__ = ("active", "out")

    def __init__(self):
        self.active, self.out = False, None


class EvictionCache(_BaseCache):
    """One attention layer's eviction cache (module docstring)."""

    method_class = None  # a deprecated EvictionCache subclass's method (caches.subclass); None: the config's

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.method_class = method_of_subclass(cls)

    def __new__(cls, config=None, *args, **kwargs):
        sub = getattr(getattr(config, "method_class", None), "cache_class", None)
        return super().__new__(sub if cls is EvictionCache and sub is not None else cls)

    def __init__(self, config: KVCacheConfig, layer_idx: int = 0, n_layers: int = 1):
        if not isinstance(config, KVCacheConfig):
            raise TypeError(f"config must be a KVCacheConfig, got {type(config).__name__}")
        if not (isinstance(layer_idx, int) and isinstance(n_layers, int) and 0 <= layer_idx < n_layers):
            raise ValueError(f"need 0 <= layer_idx < n_layers, got layer_idx={layer_idx}, n_layers={n_layers}")
        sub = type(self).method_class
        if sub is not None and config.method_class is not sub:
            raise ValueError(f"config.method={config.method!r} does not build {type(self).__name__}")
        self.config, self.options = config, config.options
        m = self.method = sub(config, layer_idx, n_layers, self) if sub else config.method_class(config, layer_idx,
                                                                                                   n_layers)
        self.kv_bits, self.kv_group_size = config.kv_bits, config.kv_group_size
        if config.kv_bits is not None:  # mlx-lm's attention takes its quantized path by hasattr(cache, "bits")
            self.bits, self.group_size = config.kv_bits, config.kv_group_size
        self.layer_idx, self.n_layers = layer_idx, n_layers
        self.n_sink, self.recent = config.n_sink, config.recent
        self.budget, self.slack = m.layer_budget(), m.slack()
        written = tuple(m.row_fields) if m.on_rows is not None else ()
        self.store = RowStore(config.kv_bits, config.kv_group_size, m.row_fields, written)
        self.schedule = Schedule(config.prompt_eviction, m.prefill_only, self.budget, self.slack, RowStore.decode_step)
        self.window = QueryWindow(m.needs.window_of(config.options))
        self.view, self._step, self.fetched, self.attend = View(self), Step(), Fetched(), OnePass()
        self.offset = self.evictions = self.queries_observed = 0
        self.queries_from_keys = False  # set by the builder when the model has no query tap
        self.tap_active = False  # set by the builder when per-layer masks reach this cache
        # a loaded cache that expects the tap checks that its first step's queries arrive (missing_tap_error)
        self._tap_unproven = self._awaiting_queries = False
        self.scale = None
        self._rng = mx.random.key(config.seed + layer_idx)
        self._light, self._light_now, self._light_q = 0, False, None  # the cheap branch (_refresh_light)
        self._pending = False  # the last step's rows are stored and its queries have not arrived yet
        self._rows_due = False  # rows stored that the method's on_rows has not seen
        # what the cheap branch holds for the next read instead of writing it every step (fold_held): the
        # window's newest queries, and each step's (hidden, ids) where the method's rows come from its inputs
        self._held_q, self._held_rows = collections.deque(maxlen=max(self.window.size, 1)), []
        self.holds = False  # the cheap branch holds some of it
        self._reading, self._own, self._read_deps = False, None, []  # a model pass reading the rows (reading())
        self.pass_due = False  # a prompt-time compression waits for the model pass (caches.passes)
        self.pass_driven = False  # inside a forward of the builder's model-pass wrapper
        self.needs_ids = m.needs.token_ids  # the model-pass wrapper sets each forward's token ids (input_ids)
        self.input_ids = None  # (B, S) token ids of this step, where the method reads them
        self.needs_hidden = m.needs.hidden_states  # the hidden-state tap hands this cache its input (attention_input)
        self.attention_input = None  # (B, S, d_model) this step's attention input, set by the hidden-state tap
        self.dist = None  # HeadShard of this rank under tensor parallelism (set by the builder)
        self.latent_query = None  # MLA: the step's queries in the latent's space (tap.bind_latent_queries)
        self.cold = make_cold_tier(config)  # recallable eviction (config.recall; caches.recall), or None
        # prompt_eviction="offload": the page file every row goes to while an input is read (caches.pages)
        self.pages = PromptPages(config) if config.prompt_eviction == "offload" else None

    # -- mlx-lm's contract: the step ---------------------------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        store = self.store
        light = store.rows < self._light and keys.shape == self._light_k and values.shape == self._light_v \
            and keys.dtype == store.keys.dtype and values.dtype == store.values.dtype
        if not light:
            if self._reading:  # a model pass reads the stored rows: this forward's rows are attended, never stored
                return self._read_fetch(keys, values)
            self._begin(keys, values)
        S = keys.shape[2]
        fetched = store.append(keys, values, self.offset, not light and self.schedule.evicts_during(S))
        self.offset += S
        step = self._step
        step.rows, self._rows_due, self._light_now, self._pending = S, self.method.on_rows is not None, light, True
        if self._rows_due and fetched is not None:  # the rows this step attends to, as the method reads them
            step.keys, step.values = fetched if store.bits is None else (store.read("keys"), store.read("values"))
        f = self.fetched
        f.store, f.given, f.rows, f.ragged = store.positions, None, store.rows, store.ragged
        if self.queries_from_keys:  # no tap: the keys stand in for the queries, and tie the step's state
            self._observe(keys, keys.shape[-1] ** -0.5, False, light)
            return tuple(mx.depends(list(fetched), self.step_state()))
        self._awaiting_queries = self._tap_unproven  # the tap's queries clear it
        return fetched

    def _begin(self, keys, values) -> None:
        """The full step before its rows are stored: what the light steps held, the last step's unfinished
        work, the checks, the prompt-time policy (caches.schedule), the paged prompt and the recall tier."""
        if self.holds:
            self.fold_held()
        sched, cold = self.schedule, self.cold
        if self._pending:  # the last step's rows got no queries (no tap): its work now
            mine = self.attention_input, self.input_ids  # (this step's, kept for it)
            self.attention_input = self.input_ids = None
            self._observe(None, self.scale, False, False)
            self.attention_input, self.input_ids = mine
        if self._awaiting_queries:
            raise self.missing_tap_error()
        if self.pages is not None:
            self.pages.step_rows = None
            if self.pages.closed:  # an input ended keeping every row: read them back
                self.pages.unpage(self)
        self.store.check(keys, values, self.config.head_dim)
        S = keys.shape[2]
        if cold is not None and self.store.keys is None:
            cold.check_head_dim(keys.shape[-1])
        if self.pages is not None and S > 1 and not sched.open:
            self.pages.begin_input(self)  # this input is read against every row so far, from the file
            self._light = 0  # the hot rows are gone: no cheap branch until the input's end refreshes it
        if cold is not None and S > 1 and not sched.open and self.offset > 0:
            if cold.held:  # recall_hold: the last turn's compression waited for this input
                self._settle(0, "release")
            cold.arm(turn=True)  # a new turn on a cache that has evicted: recall with its queries
        elif cold is not None and S == 1 and not sched.open and self.offset > 0:
            cold.decode_step()  # recall_every: every Nth decode step recalls with its query
        elif cold is not None and S == 1 and sched.open and sched.streams():
            # the streamed prompt's last token: the pages its last queries need come back
            cold.arm(turn=True, queries=cold.q)
        if S > 1 and sched.saw_decode:  # one text from every layer: Python's default filter shows it once
            warnings.warn(
                f"{type(self).__name__} already holds {self.offset} tokens from an "
                "earlier generation and now receives a new prompt. If you wrote "
                "`model.make_cache = lambda *a, **k: caches`, every generate() continues the old context: "
                "use KVCacheBuilder.install(model, config) for fresh caches per call (call "
                "cache.continue_on_purpose() on caches you continue on purpose).", stacklevel=4)
            sched.saw_decode = False
        if S == 1 and self.offset > 0:
            sched.saw_decode = True
        if S == 1 and sched.open and sched.compresses_at_end():
            sched.ending = True  # the prompt's last token: it attends to the whole prompt, then compression
        sched.open = S > 1

    def tap_step(self, queries: mx.array, scale, mask, kwargs: dict, keys=None):
        """The query tap's one call per layer: observe this step's queries (``keys``: what the model hands
        attention, when known); returns (the layer's output or None for the tap to compute it, the mask
        to use, arrays the output must depend on or None)."""
        if self._light_now and queries.shape == self._light_q and scale == self.scale:  # (never MLA)
            self._light_now = False
            plain = (mask is None or isinstance(mask, str)) and not (kwargs and any(v is not None for v in
                                                                                    kwargs.values()))
            out, f = self._observe(queries, scale, plain, True), self.fetched
            if out is None and (f.ragged or isinstance(mask, mx.array)):
                d = f.decode  # ragged rows: the decode mask of this positions buffer, once built, sliced
                mask = d[3][..., :f.rows] if d is not None and d[0] is f.store and not isinstance(mask, mx.array) \
                    else f.mask(mask, queries, self.offset - 1, False)  # (fp rows: never per KV head)
            return out, mask, self._light_deps or None
        self._light_now = False
        if self._reads_pages():  # a model pass over a closed paged prompt
            return self._paged_read_step(queries, scale, mask, kwargs)
        if self.pages is not None and self.pages.reading:  # an input read against the page file
            return self._paged_step(queries, scale, mask, kwargs, keys)
        seen = queries if self.latent_query is None else self.latent_query(queries)
        plain = all(v is None for v in kwargs.values()) and self.kv_bits is None and seen is queries
        out = None
        if plain and (mask is None or isinstance(mask, str)):
            out = self.observe_and_attend(queries, scale)
        else:
            self.observe_queries(seen, scale)
        if out is None:
            mask = self.attention_mask(mask, seen)
        if self._light and queries.shape[2] == 1 and seen is queries:
            self._light_q = queries.shape
        return out, mask, self.step_state() or None

    def observe_queries(self, queries: mx.array, scale: float | None = None) -> None:
        """The step's post-RoPE queries (B, H_q, S, D), right after its ``update_and_fetch``."""
        if self.store.keys is None and not self._reading:
            raise RuntimeError("observe_queries called before any update_and_fetch")
        scale = queries.shape[-1] ** -0.5 if scale is None else float(scale)
        if self.pages is not None and self.pages.reading:  # the paged step (its output is the tap's to use)
            self._paged_step(queries, scale, None, {})
            return
        if self._reading:
            self._read_observe(queries, scale)
            return
        self.check_queries(queries)
        out = self._observe(queries, scale, self.attend.active, False)
        if out is not None:
            self.attend.out = out

    def observe_and_attend(self, queries: mx.array, scale: float | None = None):
        """The tap's one-pass path: observe this step's queries, and return the layer's attention output
        when the method's scoring computed it from its own weights (None: the tap calls mlx-lm's attention).
        The output must equal causal attention over the rows ``update_and_fetch`` returned."""
        self.attend.active = True
        try:
            self.observe_queries(queries, scale)
        finally:
            self.attend.active = False
        out, self.attend.out = self.attend.out, None
        return out

    def _observe(self, queries, scale: float, attend: bool, light: bool, hold: bool = True):
        """The step's queries (None: none arrived): the window, the method's per-row work, then (the full
        step) the recall tier and the schedule; ``hold``: a light step may hold work for its next read
        (fold_held). Returns the layer's output where the method computed it."""
        out, self._pending = None, False
        if queries is not None:
            self.queries_observed += 1
            if self.window.size:
                if light and hold:
                    self._held_q.append(queries)
                    self.holds = True
                else:
                    self.window.add(queries)
        if self._rows_due and light and hold and self.method.rows_from_inputs:  # on_rows at the rows' next read
            self._rows_due = False
            self._held_rows.append((self.attention_input, self.input_ids))
            self.attention_input = self.input_ids = None
            self.holds = True
            if self._held_rows[HELD_STEPS - 1:]:  # HELD_STEPS held (a slice, not a len() call, per step)
                self.fold_held()
        elif self._rows_due:  # the method's per-row work (Method.on_rows), the same on both branches
            step, self._rows_due = self._step, False
            step.queries, step.scale, step.attend = queries, scale, attend
            step.all_visible = queries is not None and queries.shape[2] == 1 and not self.fetched.ragged
            step.hidden, step.ids, self.attention_input, self.input_ids = self.attention_input, self.input_ids, None, None
            if step.keys is None:  # (a batch row: the batch stored its rows after its update_and_fetch)
                step.keys, step.values = self.view.keys, self.view.values
            got = self.method.on_rows(self.view, step)
            step.queries = step.hidden = step.ids = step.keys = step.values = None
            fields, out = got if isinstance(got, tuple) else (got, None)
            r, buf = self.store.rows, self.store.fields
            for name, v in fields.items():  # (RowStore.write, inline: the cheap branch counts its calls)
                buf[name][:, :, r - v.shape[2]:r] = v
        if light:
            return out
        self.scale = scale
        S = self._step.rows
        cold = self.cold
        if cold is not None and queries is not None and cold.armed:
            out = self._recall(queries, scale, out)
        elif cold is not None and queries is not None and self.schedule.open and self.schedule.streams():
            cold.note_queries(queries)  # the streamed prompt's last queries recall at its end
        self._settle(S)
        return out

    def check_queries(self, queries) -> None:
        """The tap delivers this step's queries: they must fit the stored keys."""
        self._awaiting_queries = self._tap_unproven = False
        if not isinstance(queries, mx.array) or queries.ndim != 4:
            raise ValueError(f"queries must be a 4-D mx.array (B, H_q, S, D), got "
                             f"{getattr(queries, 'shape', type(queries).__name__)}")
        B, Hq, S, D = queries.shape
        kB, kH = self.store.positions.shape[:2]
        kD = row_dim(self.store.keys, self.kv_bits)
        if B != kB or D != kD or Hq % kH != 0 or S > self.offset:
            raise ValueError(f"queries {tuple(queries.shape)} do not fit keys (B={kB}, H_kv={kH}, D={kD}, "
                             f"offset={self.offset}): need same B and D, H_q a multiple of H_kv, S <= offset")

    def missing_tap_error(self) -> RuntimeError:
        """This cache was saved from a model with the query tap and, since it was loaded, its last step's
        queries never arrived: the model's attention does not go through the tap. Continuing would skip the
        method's scoring and recall, and ragged rows would be attended without their mask: refused."""
        self._awaiting_queries = self._tap_unproven = False
        return RuntimeError(
            f"{type(self).__name__} (layer {self.layer_idx}) expects the query tap, and the model's last step "
            "did not deliver its queries: load caches with veloxquant_mlx.load_prompt_cache(path, model=model) "
            "(or call KVCacheBuilder.attach(model, caches)) before generating with them")

    def fold_held(self) -> None:
        """Write what the cheap branch held: the window's newest queries, and the method's on_rows over the
        held steps' rows at once (``Method.rows_from_inputs``). Every reader of the window or the fields calls
        it first (where ``holds``), so they read what a full step would have written."""
        self.holds = False
        if self._held_q:
            held = list(self._held_q)
            self._held_q.clear()
            self.window.add(held[0] if len(held) == 1 else mx.concatenate(held, axis=2))
        if self._held_rows:
            held, self._held_rows = self._held_rows, []
            hidden = [h for h, _ in held if h is not None]
            ids = [i for _, i in held if i is not None]
            step, n = self._step, len(held)
            step.rows, step.queries, step.keys, step.values, step.attend = n, None, None, None, False
            step.hidden = mx.concatenate(hidden, axis=1) if len(hidden) == n else None  # (one missing: None)
            step.ids = mx.concatenate(ids, axis=1) if len(ids) == n else None
            fields = self.method.on_rows(self.view, step)
            step.hidden = step.ids = None
            self.store.write(fields)

    def step_state(self) -> list:
        """Arrays a step updates that attention does not read (positions, per-row fields, the query window):
        the tap makes the layer's output depend on them (``mx.depends``), so they are evaluated with the
        token instead of growing a lazy graph that pins old buffers."""
        if self._reading:
            return self._read_deps
        st = self.store
        if st.keys is None:
            return []
        return [a for a in (st.positions, self.window.q, *st.fields.values()) if a is not None]

    # -- when to evict: the one call site of evict ------------------------------------------------------
    def _settle(self, S: int, compress=None) -> None:
        """After a step of S rows (or ``compress``: the compression a model pass ran for, ``("pass", keep)``,
        or ``"release"``, a held recall's): does the schedule evict now, and to how many rows?"""
        sched, rows, at_end = self.schedule, self.size(), False
        if compress == "release":
            due, at_end = rows > self.budget, True
        elif compress is not None:
            keep = compress[1]
            sched.share = None if sched.prefill_only else keep
            due, at_end = rows > (sched.keep() if keep is None else keep), True
        elif sched.ending:
            sched.ending, at_end = False, True
            due = rows > self.budget
            if self._holds_recall() or self._through_pass(True, due):
                due = False
        elif sched.evicts_during(S):
            due = rows > sched.threshold()
            if S > 1 and self._through_pass(False, due):
                due = False
        else:
            due = False
        if due:
            with sched.compressing_to(compress[1]) if at_end and isinstance(compress, tuple) else \
                    sched.compressing_to() if at_end else contextlib.nullcontext():
                self.evict(sched.keep())
        if compress == "release":
            sched.floor = min(sched.floor, self.size())
        self._refresh_light()

    def evict(self, keep: int) -> None:
        """Keep ``keep`` rows per head: the method's selection under the configured allocation; the rows not
        kept go to the cold tier where there is one. The kept rows get new buffers with the headroom until
        the next eviction."""
        if self.holds:
            self.fold_held()
        unpaged = self.pages is not None and self.pages.before_evict(self)  # a paged prompt's rows come back
        sel = self.method.select(self.view, keep, self.allocation())
        idx, real = sel if isinstance(sel, tuple) else (sel, None)
        if self.cold is not None:  # before the buffers change
            self.cold.evicted(self, idx, real)
        K = idx.shape[-1]
        # Under tensor parallelism the headroom's positions are padding, written by every step (the cheap branch
        # included): with them prefilled, the two-rank worker's later, unrelated radix top-k check
        # (tests/test_distributed.py) fails on its first trial though every per-run check passes, and passes when
        # the worker collects cyclic garbage before it (gc.collect(); mx.synchronize() alone does not): arrays of
        # the generation's graphs (collectives in them) released at a garbage collection inside that check.
        prefill = self.dist is None
        self.schedule.floor = self.store.compact(idx, real, self.schedule.headroom(K), self.offset, prefill)
        self.evictions += 1
        self._light = 0
        if unpaged:  # this layer's read-back rows are freed before the next layer reads its file
            mx.eval([*self.step_state(), self.store.keys, self.store.values])

    def allocation(self):
        """The configured allocation of this eviction (caches.allocation). Ragged storage needs the per-layer
        mask the query tap applies: without it, uniform budgets (warned once where the config asked for Ada-KV)."""
        allocation = self.method.allocations[self.config.allocation](self.config)
        if allocation.ragged and not self.tap_active:
            if self.config.allocation == "ada" and self.config.method not in _warned:
                _warned.add(self.config.method)
                warnings.warn(f"allocation='ada' needs the query tap's per-layer mask (ragged per-head storage); it "
                              f"is not active for {self.config.method}, so uniform per-head budgets are used instead",
                              stacklevel=4)
            return Uniform()
        return allocation

    def _holds_recall(self) -> bool:
        """``recall_hold``: a follow-up input that recalled ends without its compression, so its answer
        attends to every recalled row; decode evicts past the rows held now plus the slack."""
        if not (self.cold is not None and self.cold.held):
            return False
        self.schedule.floor = max(self.schedule.floor, self.size())
        return True

    def _through_pass(self, ending: bool, due: bool) -> bool:
        """Does this prompt-time compression (``ending``: at the prompt's end, else after a streamed chunk;
        ``due``: the schedule compresses now anyway) run through the method's model pass
        (``Method.wants_pass``)? After the forward where the model-pass wrapper drives it, else now."""
        if not (self.method.needs.model_pass and self.method.wants_pass(self.view, ending, due)):
            return False
        self.pass_due = True
        if not self.pass_driven:
            run_model_pass(None, [(self, None)])
        return True

    def compress(self, keep: int | None = None) -> None:
        """The compression a model pass ran for (``pass_due``), to ``keep`` rows per head (None: the budget);
        a share from a ranking across layers stays this layer's keep where decode evicts."""
        self.pass_due = False
        self._settle(0, ("pass", keep))

    def _recall(self, queries: mx.array, scale: float, out):
        """A new input on a cache with a cold tier (caches.recall). Where the tap lets this cache hand the
        layer's output back (fp rows), its first chunk recalls at once and attends to the recalled rows too;
        elsewhere the recall waits for the input's last token. Either way the compression at its end picks."""
        self.cold.note_queries(queries)
        S = queries.shape[2]
        early = S > 1 and self.attend.active and self.kv_bits is None
        if (early or S == 1) and self.cold.recall(self):
            if early:  # recalled rows are older than the chunk: "causal" (bottom-right) stays right
                return mx.fast.scaled_dot_product_attention(queries, self.stored("keys"), self.stored("values"),
                                                            scale=scale, mask="causal")
            self.schedule.ending = True
        return out

    def _refresh_light(self) -> None:
        """After a full step: up to how many rows the next decode steps may take the cheap branch (the
        schedule has nothing to do before the next eviction threshold)."""
        self._light = 0
        st, sched = self.store, self.schedule
        # (quantized rows: a new row is quantized on the full branch; a batch row: the batch stores its rows; a
        # step read from the page file: the next step's full branch ends what KV-shared layers read of it)
        if (st.keys is None or st.bits is not None or st.external or self._tap_unproven or sched.open
                or sched.ending or not sched.saw_decode or (self.cold is not None and self.cold.every is not None)
                or (self.pages is not None and self.pages.step_rows is not None)):
            return
        B, H, cap, Dk = st.keys.shape
        self._light_k, self._light_v = (B, H, 1, Dk), (B, H, 1, st.values.shape[3])
        # written in place by the cheap branch: the fields (unless held: fold_held), positions not prefilled
        self._light_deps = [] if self.method.rows_from_inputs else list(st.fields.values())
        if st.prefilled is not st.positions:
            self._light_deps.append(st.positions)
        self._light_q = None  # the queries' shape, set by the tap step that follows
        self._light = cap if sched.prefill_only else min(cap, sched.threshold())

    # -- the paged prompt's step ------------------------------------------------------------------------
    def _paged_step(self, queries, scale, mask, kwargs, keys=None):
        """An input read against the page file (caches.pages): this chunk attends to every paged row and its
        own; the method's per-row work runs as on any step (a field of attention mass is the pages' to sum
        over the file); then the chunk's rows go to the file, and at the input's end the schedule compresses."""
        pages = self.pages
        self.check_queries(queries)
        scale = queries.shape[-1] ** -0.5 if scale is None else float(scale)
        out = pages.attend(self, queries, scale, mask, kwargs, keys)
        self.scale = scale
        if self.method.attention_mass_field is not None:  # its on_rows' work is the pages' mass over the file
            self._rows_due = False
        self._observe(queries, scale, False, True, False)  # (the file takes this step's rows and fields now)
        pages.store_step(self)
        if self.schedule.ending:  # the input's last token: every row is in the file; the method picks
            pages.close(self)
            self._settle(queries.shape[2])
        return out, mask, None

    # -- a model pass reading the stored rows (Needs.model_pass: KVzip's reconstruction) -----------------
    @contextlib.contextmanager
    def reading(self):
        """Inside: a forward attends to the stored rows followed by its own, which are never stored, and its
        queries (with every row it attends to: step.keys / step.values) go to the method's ``on_rows``; the
        fields it returns are not stored, only evaluated with the layer's output."""
        self._reading, self._read_deps, self._light = True, [], 0  # (a reading step is never light)
        try:
            yield
        finally:
            self._reading, self._own, self._read_deps = False, None, []

    def _read_fetch(self, keys, values):
        self.store.check(keys, values, self.config.head_dim)
        if self._reads_pages():  # the tap's step attends over the file (_paged_read_step)
            self._own = (keys, values)
            return keys, values
        k, v = self.store.fetch()
        B, H, S = keys.shape[:3]
        new_pos = mx.broadcast_to(mx.arange(self.offset, self.offset + S, dtype=mx.int32), (B, H, S))
        self.fetched.note(None, 0, self.store.ragged, mx.concatenate([self.store.raw("positions"), new_pos], axis=2))
        self._own = (keys, values)
        if self.queries_from_keys:  # no tap: keys stand in for the queries, as everywhere else
            self._read_observe(keys, keys.shape[-1] ** -0.5)
        # quantized rows: this forward's rows join in the stored layout, so attention takes one path
        join = lambda stored, new: rows_zip(lambda a, b: mx.concatenate([a, b], axis=2), stored,
                                            quantize_rows(new, self.kv_bits, self.kv_group_size))
        return join(k, keys), join(v, values)

    def _reads_pages(self) -> bool:
        """A model pass reads a closed paged prompt: its rows are in the file, none in memory."""
        return self._reading and self.pages is not None and self.pages.closed

    def _paged_read_step(self, queries, scale, mask, kwargs):
        """A model pass's step over a closed paged prompt: attention over every paged row, a block at a time,
        then the pass's own rows (as ``reading()`` attends them: in the stored layout, never stored); the
        method reads the rows it scores by slices of ``step.keys`` / ``step.values`` (caches.pages.PassRows)."""
        why = self.pages.unsupported(self, mask, kwargs, None)
        if why:
            raise ValueError(f"prompt_eviction='offload' cannot run {self.config.method}'s model pass on this "
                             f"model: {why}; use prompt_eviction='end'")
        scale = queries.shape[-1] ** -0.5 if scale is None else float(scale)
        bits, gs = self.kv_bits, self.kv_group_size
        out = self.pages.attend_before(queries, scale, kwargs, None, self._own_as_read(), bits, gs)
        self._read_observe(queries, scale, self.pages.pass_rows(self._own, bits, gs))
        mx.eval(self._read_deps)  # this layer's scores now: the rows they read from the file can go
        return out, mask, None

    def _own_as_read(self) -> tuple:
        """A reading step's own (keys, values) as attention reads them: in the stored layout (quantized rows)."""
        bits, gs = self.kv_bits, self.kv_group_size
        return tuple(dequantize_rows(quantize_rows(a, bits, gs), bits, gs) for a in self._own)

    def shared_output(self, queries: mx.array, scale, kwargs: dict):
        """A KV-shared layer's attention over the rows this cache's step attended to, where this step read
        them from its page file (the rows ``update_and_fetch`` returned are then only the step's own); else None."""
        pages = self.pages
        if pages is None:
            return None
        if self._reads_pages():
            scale = queries.shape[-1] ** -0.5 if scale is None else float(scale)
            return pages.attend_before(queries, scale, kwargs, None, self._own_as_read(), self.kv_bits,
                                       self.kv_group_size)
        if pages.step_rows is not None:
            return pages.attend_shared(queries, scale, kwargs, self.kv_bits, self.kv_group_size)
        return None

    def write_fields(self, fields: dict) -> None:
        """Per-row fields of the newest rows, ``{name: (B, H or 1, n)}``: a model pass's scores."""
        if self.store.keys is None and self.pages is not None and self.pages.closed:
            self.pages.write_fields(fields)
        else:
            self.store.write(fields)

    def _read_rows(self):
        """The rows a reading step attends to, for its method: the stored ones as attention reads them, then
        the forward's own (unquantized: they are never stored)."""
        keys, values = self._own
        return (mx.concatenate([self.store.read("keys"), keys], axis=2),
                mx.concatenate([self.store.read("values"), values], axis=2))

    def _read_observe(self, queries, scale, rows=None):
        """A reading step's queries to the method's ``on_rows``, with the rows it attends to (``rows``: a paged
        prompt's, read by slices; the method then leaves the layer's output to the tap)."""
        step = self._step
        step.queries, step.scale, step.rows = queries, scale, queries.shape[2]
        step.attend, step.all_visible = self.attend.active and rows is None, False
        step.keys, step.values = self._read_rows() if rows is None else rows
        got = self.method.on_rows(self.view, step)
        step.queries = step.keys = step.values = None
        fields, out = got if isinstance(got, tuple) else (got, None)
        self._read_deps = list(fields.values())
        if out is not None:
            self.attend.out = out

    # -- masks ------------------------------------------------------------------------------------------
    def attention_mask(self, mask, queries: mx.array):
        """The mask this layer's attention should use, given the one mlx-lm built from cache[0]
        (caches.masks): the rows the last ``update_and_fetch`` returned, padding hidden per head."""
        n = queries.shape[2]
        return self.fetched.mask(mask, queries, self.offset if self._reading else self.offset - n,
                                 self.kv_bits is not None)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        return layer_array_mask(N, self.store.rows, return_array, window_size)

    # -- the method's inputs --------------------------------------------------------------------------
    def next_key(self) -> mx.array:
        """A fresh PRNG key for one eviction (same seed -> the same sequence of keys)."""
        k = mx.random.split(self._rng)
        self._rng = k[0]
        return k[1]

    def window_queries(self):
        """(queries (B, H_q, W, D), their absolute positions (W,)) of the observation window."""
        if self.holds:
            self.fold_held()
        q = self.window.ordered()
        if q is None:
            return None, None
        W = q.shape[2]
        return q, mx.arange(self.offset - W, self.offset, dtype=mx.int32)

    def observed_window(self):
        """(queries, positions, scale) of the window; where no query was seen (no tap, an eviction before the
        first query) the newest W stored keys stand in at the newest W positions, scaled 1/sqrt(D): the one
        fallback every method that scores with queries shares."""
        q, q_pos = self.window_queries()
        if q is None:
            r = self.size()
            W = min(self.window.size, r)
            q, q_pos = self.stored("keys")[:, :, r - W:], mx.arange(self.offset - W, self.offset, dtype=mx.int32)
        return q, q_pos, (self.scale if self.scale is not None else q.shape[-1] ** -0.5)

    # -- reading the cache ----------------------------------------------------------------------------
    def stored(self, name: str = "keys") -> mx.array:
        """The stored rows of ``keys``, ``values``, ``positions`` or a per-row field, as attention reads them
        (quantized rows dequantized; a closed paged prompt's rows read from its file)."""
        if self.holds:
            self.fold_held()
        if self.store.keys is None and self.pages is not None and self.pages.closed:
            return self.pages.stored(name, self.kv_bits, self.kv_group_size)
        return self.store.read(name)

    def key_blocks(self, align: int = 1):
        """At a paged prompt's end, while its keys are still in the file: a function giving a fresh iterator
        of (keys, positions) blocks of every stored row (multiples of ``align`` rows but the last); else None."""
        keys = self.store.keys
        if self.pages is None or getattr(keys, "gather", None) is None or keys.loaded:
            return None
        pages, bits, gs = self.pages, self.kv_bits, self.kv_group_size
        return lambda: pages.key_blocks(align, bits, gs)

    def size(self) -> int:
        return self.store.rows

    def empty(self) -> bool:
        return self.store.keys is None

    def is_trimmable(self) -> bool:
        return False

    def trim(self, n):
        raise NotImplementedError("eviction caches cannot be trimmed: evicted rows are gone")

    # the parts as mlx-lm's caches and earlier callers read them (mlx-lm's pipeline sets the last layer's keys)
    keys = property(lambda self: self.store.keys, lambda self, keys: setattr(self.store, "keys", keys))
    values = property(lambda self: self.store.values)
    positions = property(lambda self: self.store.positions)
    is_ragged = property(lambda self: self.store.ragged, doc="heads keep different numbers of rows")
    prefill_only = property(lambda self: self.method.prefill_only)
    prompt = property(lambda self: self.schedule, doc="where the cache stands between prompt and decode")

    def continue_on_purpose(self) -> None:
        """The next input continues this cache deliberately (multi-turn reuse, a loaded file): no reuse warning."""
        self.schedule.saw_decode = False
        self._light = 0  # the next step takes the full branch, which keeps the prompt state

    # -- bytes ------------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Bytes this cache holds: the allocated capacity of its buffers, positions and per-row fields, the
        query window, the recall tier's resident part and what a paged prompt holds in memory (its file is
        ``page_disk_bytes`` in :meth:`byte_report`)."""
        if self.holds:
            self.fold_held()
        held = self.store.nbytes + (0 if self.window.q is None else self.window.q.nbytes)
        held += 0 if self.pages is None else self.pages.resident_bytes
        if self.cold is not None and self.store.keys is not None:
            held += self.cold.resident_bytes + self.cold.summary_bytes
        return held

    def kept_per_head(self) -> mx.array:
        """(B, H) real kept rows per batch row and KV head (reporting: with ragged heads a host read)."""
        return mx.zeros((0, 0), mx.int32) if self.store.keys is None else self.store.kept_per_head()

    def kept_positions(self) -> mx.array:
        """(B, H, rows) absolute positions of the kept rows, -1 for padding."""
        if self.store.keys is None:
            return mx.zeros((0, 0, 0), mx.int32)
        pos = self.store.raw("positions")
        return mx.where(pos == PAD_POSITION, -1, pos)

    @property
    def tokens_seen(self) -> int:
        return self.offset

    @property
    def tokens_kept(self) -> float:
        """Kept rows per KV head (mean over batch rows and heads when ragged)."""
        if self.store.keys is None:
            return 0
        return self.kept_per_head().astype(mx.float32).mean().item() if self.store.ragged else self.store.rows

    kept_bytes = property(lambda self: self.store.kept_bytes(), doc="bytes of the kept rows' keys and values")
    full_seq_bytes = property(lambda self: self.store.full_bytes(self.offset),
                              doc="bytes mlx-lm's KVCache would hold for every token seen")

    @property
    def compression_ratio(self) -> float:
        kept = self.kept_bytes
        return self.full_seq_bytes / kept if kept else 1.0

    def byte_report(self) -> dict:
        """Allocated bytes (what the process holds for this layer), the kept rows' and the full sequence's;
        ``allocated_fraction`` = allocated / full is the memory a user sees. With a recall tier: hot_bytes +
        cold_resident_bytes + summary_bytes = allocated_bytes; cold_disk_bytes is on disk."""
        full, alloc = self.full_seq_bytes, self.nbytes
        extra = {} if self.cold is None else {
            "hot_bytes": alloc - self.cold.resident_bytes - self.cold.summary_bytes, **self.cold.report()}
        if self.pages is not None:
            extra.update(self.pages.report())
        return {**extra, "method": self.config.method, "layer": self.layer_idx, "tokens_seen": self.tokens_seen,
                "tokens_kept": self.tokens_kept, "allocated_bytes": alloc, "kept_bytes": self.kept_bytes,
                "full_seq_bytes": full, "allocated_fraction": alloc / full if full else 0.0,
                "compression_ratio": self.compression_ratio, "evictions": self.evictions}

    # -- save / load (mlx-lm's state / meta_state; veloxquant_mlx.prompt_cache writes the file) ---------
    @property
    def state(self):
        if self.holds:
            self.fold_held()
        if self.pages is not None and self.pages.closed:  # an input ended keeping every row: read them back
            self.pages.unpage(self)
        if self.store.keys is None:
            return {}
        st = {**self.store.arrays(), "rng": self._rng}
        q = self.window.ordered()
        if q is not None:  # in position order, and never the ring itself (written in place)
            st["window_q"] = mx.array(q) if q is self.window.q else q
        if self.cold is not None:
            st.update(self.cold.state())
        return st

    @state.setter
    def state(self, st):
        self._light, self.store.prefilled = 0, None
        self._held_q.clear()  # what light steps held belongs to the rows being replaced
        self._held_rows, self.holds = [], False
        if not st:
            self.store.drop()
            return
        if "rng" not in st:
            raise ValueError(f"{type(self).__name__} state is missing ['rng']")
        self.store.load(st, type(self).__name__)
        self._rng = st["rng"]
        self.window.load(st.get("window_q"))
        if self.cold is not None:
            self.cold.set_state(st)
        elif any(k.startswith("recall.") for k in st):
            raise ValueError(f"{type(self).__name__} state holds a cold tier but the config has recall=None")

    @property
    def meta_state(self):
        if self.pages is not None and self.pages.reading:
            raise ValueError(f"{type(self).__name__} (layer {self.layer_idx}) is reading a prompt against its page "
                             "file: save it once the prompt has ended")
        sched, m = self.schedule, self.method
        method_state = {f: getattr(m, f) for f in m.state_fields if getattr(m, f) is not None}
        return json.dumps({
            "format": _FORMAT_VERSION, "class": type(self).__name__, "config": self.config.to_dict(),
            "layer_idx": self.layer_idx, "n_layers": self.n_layers, "offset": self.offset,
            "rows": self.store.rows, "evictions": self.evictions, "queries_observed": self.queries_observed,
            "queries_from_keys": self.queries_from_keys, "tap_active": self.tap_active,
            "scale": self.scale, "saw_decode": sched.saw_decode, "prompt_open": sched.open,
            "ending": sched.ending, "ragged": self.store.ragged, "evict_floor": sched.floor,
            **({} if self.cold is None else {"recall": self.cold.meta()}),
            **({} if sched.share is None else {"layer_share": sched.share}),
            **({m.name: method_state} if method_state else {}),
        }, sort_keys=True)

    @meta_state.setter
    def meta_state(self, text):
        try:
            meta = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ValueError(f"corrupted cache metadata: {e}") from None
        sub = type(self).method_class is not None  # a method's own subclass: its name (else any method's cache)
        if meta.get("format") != _FORMAT_VERSION or (sub and meta.get("class") != type(self).__name__):
            raise ValueError(f"cache metadata is for {meta.get('class')!r} format {meta.get('format')!r}, "
                             f"not {type(self).__name__} format {_FORMAT_VERSION}")
        if meta["rows"] != self.store.rows:
            raise ValueError(f"cache metadata says {meta['rows']} rows but the arrays hold {self.store.rows}")
        sched, m = self.schedule, self.method
        self.offset, self.evictions = meta["offset"], meta["evictions"]
        self.queries_observed, self.queries_from_keys = meta["queries_observed"], meta["queries_from_keys"]
        self.tap_active, self.scale = meta["tap_active"], meta["scale"]
        self._tap_unproven = self.tap_active and not self.queries_from_keys  # missing_tap_error
        sched.saw_decode, sched.open, sched.ending = meta["saw_decode"], meta["prompt_open"], meta.get("ending", False)
        self.store.ragged, sched.floor, self._light = meta["ragged"], meta.get("evict_floor", 0), 0
        # (a share was saved under the method's name before every method could keep one)
        sched.share = meta.get("layer_share", meta.get(f"{m.name}_layer_share"))
        for f, v in (meta.get(m.name) or {}).items():
            if f in m.state_fields:
                setattr(m, f, v)
        if self.cold is not None:
            self.cold.set_meta(meta.get("recall", {}))
        if self.store.positions is not None:
            self.note_fetched()

    @classmethod
    def from_state(cls, state, meta_state):
        try:
            meta = json.loads(meta_state)
            config = KVCacheConfig.from_dict(meta["config"])
        except (TypeError, ValueError, KeyError) as e:
            raise ValueError(f"corrupted cache metadata: {e}") from None
        obj = cls(config, layer_idx=meta["layer_idx"], n_layers=meta["n_layers"])
        obj.state = state
        obj.meta_state = meta_state
        return obj

    def note_fetched(self) -> None:
        """The stored rows are what the next mask describes (a batch row that got no tokens this step)."""
        st = self.store
        self.fetched.note(st.positions, st.rows, st.ragged)

    # Batching (BatchGenerator, batch_generate, mlx_lm.server): merge returns a caches.batch.BatchEvictionCache
    # holding one single-row cache per sequence. `merge` exists only on caches that can batch (the server
    # probes hasattr(c, "merge")), never KVCache.merge.
    merge = BatchMerge()


def continue_on_purpose(caches) -> list:
    """Tell each eviction cache of ``caches`` (a model's list; plain mlx-lm caches are skipped) that the next
    input continues it deliberately, a second turn or a loaded file: no reuse warning. Returns ``caches``."""
    for c in caches:
        if isinstance(c, EvictionCache):
            c.continue_on_purpose()
    return caches
