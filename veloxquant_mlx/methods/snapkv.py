"""SnapKV (Li et al., NeurIPS 2024): compress the prompt once, by what its last queries look at.

When the prompt ends, the last ``window`` prompt queries (the observation window) score every earlier
key: softmax attention summed over the window and over the GQA group, then 1-D max-pooled
(``kernel``) so that neighbours of important tokens survive together. Each KV head keeps the window,
the ``n_sink`` attention sinks and its top ``budget - window - n_sink`` pooled scores; decode tokens
are then appended without further eviction (prefill-only regime, as in the Nexus paper's Table 1).
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ..options import option
from ..ops.window_scores import snapkv_scores
from ..registry import register
from ..caches.base import EvictionCache


@dataclasses.dataclass
class SnapKVOptions:
    # Observation window 32 and max-pool kernel 7: the SnapKV paper's LongBench setting (also the
    # PyramidKV/KVCache-Factory defaults the Nexus paper's baselines follow).
    window: int = option(32, low=1, small=8, doc="observation window: last prompt queries that score the keys")
    kernel: int = option(7, low=1, doc="1-D max-pooling kernel over the key axis (1 = no pooling)")


class _WindowScoreCache(EvictionCache):
    """Shared plumbing for methods scored by the observation window's queries."""

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


@register("snapkv")
class SnapKVCache(_WindowScoreCache):
    """SnapKV: prefill-only, observation-window attention, max-pooled, top-K per KV head."""

    Options = SnapKVOptions
    prefill_only = True

    def scores(self):
        q, q_pos, scale = self._window()
        return snapkv_scores(q, self.stored("keys"), q_pos, self.stored("positions"), scale,
                             self.options.kernel)
