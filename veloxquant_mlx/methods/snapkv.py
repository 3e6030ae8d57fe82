"""SnapKV (Li et al., NeurIPS 2024): compress the prompt once, by what its last queries look at.

When the prompt ends, the last ``window`` prompt queries (the observation window) score every earlier
key: softmax attention summed over the window and over the GQA group, then 1-D max-pooled
(``kernel``) so that neighbours of important tokens survive together. Each KV head keeps the window,
the ``n_sink`` attention sinks and its top ``budget - window - n_sink`` pooled scores; decode tokens
are then appended without further eviction (prefill-only regime, as in the Nexus paper's Table 1).
"""

from __future__ import annotations

import dataclasses

from ..caches.method import Method, Needs
from ..ops.window_scores import pooled_window_scores, window_reduce
from ..options import option
from ..registry import register


@dataclasses.dataclass
class SnapKVOptions:
    # Observation window 32 and max-pool kernel 7: the SnapKV paper's LongBench setting (also the
    # PyramidKV/KVCache-Factory defaults the Nexus paper's baselines follow).
    window: int = option(32, low=1, small=8, doc="observation window: last prompt queries that score the keys")
    kernel: int = option(7, low=1, doc="1-D max-pooling kernel over the key axis (1 = no pooling)")


@register("snapkv")
class SnapKV(Method):
    """SnapKV: prefill-only, observation-window attention, max-pooled, top-K per KV head."""

    Options = SnapKVOptions
    needs = Needs(window="window")
    prefill_only = True

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # the observation window itself is kept

    def scores(self, view):
        scores = view.window_attention(window_reduce("sum"))
        return pooled_window_scores(scores, view.positions, view.window()[1], self.options.kernel)
