"""WindowScoreCache: the shared base of methods scored by their observation window's queries.

A method that ranks rows by the attention the last ``options.window`` queries pay them subclasses it
and supplies ``scores()``; the base keeps that window as the forced recent rows and hands out the
window's queries (or keys standing in for them when no query was observed).
"""

from __future__ import annotations

import mlx.core as mx

from .base import EvictionCache


class WindowScoreCache(EvictionCache):
    """Eviction by the observation window's attention; the method's options carry ``window``."""

    def __init__(self, config, layer_idx=0, n_layers=1):
        super().__init__(config, layer_idx, n_layers)
        self.query_window = self.options.window

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # the observation window itself is kept

    def _window(self):
        """(queries, positions, scale) of the observation window; keys stand in when no query was
        ever observed (the cache used without the tap and without key fallback)."""
        q, q_pos = self.window_queries()
        if q is None:
            W = min(self.options.window, self._rows)
            q = self.stored("keys")[:, :, self._rows - W:]
            q_pos = mx.arange(self.offset - W, self.offset, dtype=mx.int32)
        scale = self.scale if self.scale is not None else q.shape[-1] ** -0.5
        return q, q_pos, scale
