"""The light decode step of an eviction cache (issue 49): between evictions, one append and one fetch.

A decode step of a decode-ready cache appends one row into the headroom and returns the stored rows
(``EvictionCache.update_and_fetch``'s first branch), and its queries cost one row written into the
query window's ring where the method keeps one, plus the method's declared per-step hook: no
validation beyond shapes, no policy, no positions write (the headroom holds them: ``prefilled``), no
host sync. Every full step decides (``refresh_light``) up to how many rows the next steps may be
light; anything else that can happen in a step (a prompt, its end, an eviction, growth, recall, a
batch row, quantized rows, no tap) takes the full path, which the light one equals row for row
(tests/test_light_step.py).
"""

from __future__ import annotations

import mlx.core as mx


class LightStep:
    """Mixin of :class:`~veloxquant_mlx.caches.base.EvictionCache`: the light step's decision and the tap's entry."""

    # A method's per-step work on the light path, declared (None: none): ``on_light_append(row)`` after the
    # new row is stored (kvzap's score, kvzip's token id); ``on_light_queries(queries, attend)`` with the
    # step's queries (H2O's attention mass), returning the layer's output when ``attend`` allows and its
    # scoring computed it (one pass), else None.
    on_light_append = None
    on_light_queries = None

    def refresh_light(self) -> None:
        """Decide, after a full step, up to how many rows the next decode steps may take the light path."""
        self._light_rows = 0
        p = self.prompt
        if (self.keys is None or self.kv_bits is not None or self.kv_external or self.cold is not None
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

    def tap_step(self, queries: mx.array, scale, mask, kwargs: dict):
        """The query tap's one call per layer: observe this step's queries; returns (the layer's output or
        None for the tap to compute it, the mask to use, arrays the output must depend on or None)."""
        if self._light_now and queries.shape == self._light_q and scale == self.scale:
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
        out = None
        plain = all(v is None for v in kwargs.values()) and self.kv_bits is None
        if plain and (mask is None or isinstance(mask, str)):
            out = self.observe_and_attend(queries, scale)
        else:
            self.observe_queries(queries, scale)
        if out is None:
            mask = self.attention_mask(mask, queries)
        if self._light_rows and queries.shape[2] == 1:
            self._light_q = queries.shape
        return out, mask, self.step_state() or None
