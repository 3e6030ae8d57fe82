"""WindowScoreCache: the shared base of methods scored by their observation window's queries.

A method that ranks rows by the attention the last ``options.window`` queries pay them subclasses it
and supplies ``scores()``; the base keeps that window as the forced recent rows and hands out the
window's queries (``observed_window``, with the base's one fallback to keys).
"""

from __future__ import annotations

from .base import EvictionCache


class WindowScoreCache(EvictionCache):
    """Eviction by the observation window's attention; the method's options carry ``window``."""

    def __init__(self, config, layer_idx=0, n_layers=1):
        super().__init__(config, layer_idx, n_layers)
        self.query_window = self.options.window

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # the observation window itself is kept
