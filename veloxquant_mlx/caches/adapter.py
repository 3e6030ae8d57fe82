"""The mlx-lm side of an eviction cache, one way through a step: ``update_and_fetch`` stores the step's
rows and returns what attention reads; the query tap's ``tap_step`` hands over the step's queries and
gets back the output (one pass), the mask and the arrays the output must depend on; ``_observe`` runs
the method's per-query work, the prompt-time policy (``policy.py``) and the eviction it calls for.

The light step (issue 49): between evictions a decode step of a decode-ready cache appends one row into
the headroom and returns the stored rows, and its queries cost one row written into the query window's
ring where the method keeps one, plus the method's declared per-step hook: no validation beyond shapes,
no policy, no positions write (the headroom holds them: ``storage.prefilled``), no host sync. Every full
step decides (``refresh_light``) up to how many rows the next steps may be light; anything else that can
happen in a step (a prompt, its end, an eviction, growth, recall, a batch row, quantized rows, no tap)
takes the full path, which the light one equals row for row (tests/test_light_step.py).
"""

from __future__ import annotations

import mlx.core as mx

from .quant import row_dim


class MlxLmAdapter:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: mlx-lm's cache contract and the tap's entry."""

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
        if self.pages is not None:
            self.pages.step_rows = None
            if self.pages.closed:  # an input ended keeping every row: read them back
                self.pages.unpage(self)
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
        if self.pages is not None and self.pages.reading:  # the paged step (its output is the tap's to use)
            self.pages.tap(self, queries, scale, None, {})
            return
        self.check_queries(queries)
        self._observe(queries, queries.shape[-1] ** -0.5 if scale is None else float(scale))

    def check_queries(self, queries) -> None:
        """The tap delivers this step's queries: they must fit the stored keys."""
        self._awaiting_queries = self._tap_unproven = False
        if not isinstance(queries, mx.array) or queries.ndim != 4:
            raise ValueError(f"queries must be a 4-D mx.array (B, H_q, S, D), got "
                             f"{getattr(queries, 'shape', type(queries).__name__)}")
        B, Hq, S, D = queries.shape
        kB, kH = self.positions.shape[:2]
        kD = row_dim(self.keys, self.kv_bits)
        if B != kB or D != kD or Hq % kH != 0 or S > self.offset:
            raise ValueError(f"queries {tuple(queries.shape)} do not fit keys (B={kB}, H_kv={kH}, D={kD}, "
                             f"offset={self.offset}): need same B and D, H_q a multiple of H_kv, S <= offset")

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
        elif self.cold is not None and self.prompt.open and self._streams_prompt():
            self.cold.note_queries(queries)  # the streamed prompt's last queries recall at its end
        if self.prompt.ending:
            self._end_prompt()
        elif self._evicts_during(queries.shape[2]) and self._rows > self.evict_threshold():
            self._evict()
        self.refresh_light()

    # A method's per-step work on the light path, declared (None: none): ``on_light_append(row)`` after the
    # new row is stored (kvzap's score, kvzip's token id); ``on_light_queries(queries, attend)`` with the
    # step's queries (H2O's attention mass), returning the layer's output when ``attend`` allows and its
    # scoring computed it (one pass), else None.
    on_light_append = None
    on_light_queries = None
    # MLA (set by tap.bind_latent_queries): maps a step's queries into the space of the cached latent rows.
    latent_query = None

    def refresh_light(self) -> None:
        """Decide, after a full step, up to how many rows the next decode steps may take the light path."""
        self._light_rows = 0
        p = self.prompt
        # Tensor-parallel caches (dist) keep the full path and padding headroom after evictions: with the
        # positions prefilled there, the two-rank worker's final radix top-k check (tests/test_distributed.py)
        # failed reproducibly though every per-run check passed; not root-caused (issue 49's report).
        if (self.keys is None or self.kv_bits is not None or self.kv_external or self.cold is not None
                or self.dist is not None
                or self.queries_from_keys or self._tap_unproven or self.prefilled is not self.positions
                or p.open or p.ending or not p.saw_decode or self._fetched_store is None):
            return
        B, H, cap, Dk = self.keys.shape
        if any(fill and name not in self.rows_written_on_append for name, fill in self.extra_row_fields().items()):
            return  # a field whose new rows need their fill written (the headroom holds zeros)
        W, q = self.query_window, self._window_q
        if W and (q is None or q.shape[2] != W):
            return  # the window fills on the full path (the light one writes a full ring)
        limit = cap if self.prefill_only else min(cap, self.evict_threshold())
        self._light_k, self._light_v = (B, H, 1, Dk), (B, H, 1, self.values.shape[3])
        self._light_ragged = self.is_ragged
        self._light_deps = [a for a in (self._window_q, *self.row_extras.values()) if a is not None]
        self._light_q = None  # the queries' shape, set by the full observe that follows
        self._light_rows = limit

    def tap_step(self, queries: mx.array, scale, mask, kwargs: dict, keys=None):
        """The query tap's one call per layer: observe this step's queries (``keys``: what the model hands
        attention, when known); returns (the layer's output or None for the tap to compute it, the mask
        to use, arrays the output must depend on or None)."""
        if self._light_now and queries.shape == self._light_q and scale == self.scale:  # (never MLA)
            self._light_now = False
            self.queries_observed += 1
            out = None
            if self.query_window:  # the window's one-row write (a full ring: its oldest row)
                i = self._window_at
                self._window_q[:, :, i:i + 1] = queries
                self._window_at = i + 1 if i + 1 < self.query_window else 0
            if self.on_light_queries is not None:
                out = self.on_light_queries(queries, (mask is None or isinstance(mask, str)) and not (
                    kwargs and any(v is not None for v in kwargs.values())))
            if out is None and (self._fetched_ragged or isinstance(mask, mx.array)):
                mask = self.attention_mask(mask, queries)
            return out, mask, self._light_deps or None
        out, self._light_now = None, False
        if self.pages is not None and self.pages.reading:  # an input read against the page file
            return self.pages.tap(self, queries, scale, mask, kwargs, keys)
        seen = queries if self.latent_query is None else self.latent_query(queries)
        plain = all(v is None for v in kwargs.values()) and self.kv_bits is None and seen is queries
        if plain and (mask is None or isinstance(mask, str)):
            out = self.observe_and_attend(queries, scale)
        else:
            self.observe_queries(seen, scale)
        if out is None:
            mask = self.attention_mask(mask, seen)
        if self._light_rows and queries.shape[2] == 1 and seen is queries:
            self._light_q = queries.shape
        return out, mask, self.step_state() or None
