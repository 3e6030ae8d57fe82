"""PyramidKV (Cai et al., COLM 2025): SnapKV's score with budgets that shrink with depth.

Layer ``l`` of ``L`` keeps ``max - l (max - min) / (L - 1)`` selected tokens plus the observation
window, with ``min = (C - w) / beta`` and ``max = 2 (C - w) - min``: lower layers (broad attention)
keep more, higher layers (funnelled attention) fewer, and the mean over layers is the configured
budget ``C``. Integer budgets come from rounding the cumulative sum, so the mean is exactly ``C``.
"""

from __future__ import annotations

import dataclasses
import math

from ..caches.method import Method, Needs
from ..ops.window_scores import pooled_window_scores, window_reduce
from ..options import option
from ..registry import register


@dataclasses.dataclass
class PyramidKVOptions:
    # window 32 / kernel 7 as SnapKV; beta = 20 is PyramidKV's reference setting for the pyramid slope.
    window: int = option(32, low=1, small=8, doc="observation window: last prompt queries that score the keys")
    kernel: int = option(7, low=1, doc="1-D max-pooling kernel over the key axis (1 = no pooling)")
    beta: float = option(20.0, low=1.0, small=2.0, doc="pyramid steepness: the top layer keeps (C - w) / beta")


def pyramid_budgets(budget: int, window: int, n_layers: int, beta: float) -> list:
    """Per-layer budgets (window included), decreasing linearly, integers with mean exactly ``budget``."""
    if n_layers == 1:
        return [budget]
    sel = budget - window
    lo = sel / beta
    hi = 2 * sel - lo
    step = (hi - lo) / (n_layers - 1)

    def cum(k):  # selected tokens of layers 0..k-1
        return k * hi - step * k * (k - 1) / 2

    return [round(cum(i + 1)) - round(cum(i)) + window for i in range(n_layers)]


@register("pyramidkv")
class PyramidKV(Method):
    """PyramidKV: SnapKV's score with linearly decreasing per-layer budgets (prefill-only)."""

    Options = PyramidKVOptions
    needs = Needs(window="window")
    prefill_only = True

    def layer_budget(self):
        c, o = self.config, self.options
        b = pyramid_budgets(c.budget, o.window, self.n_layers, o.beta)[self.layer]
        if b <= c.n_sink + c.recent:
            raise ValueError(f"pyramidkv layer {self.layer} budget {b} <= n_sink + recent "
                             f"({c.n_sink} + {c.recent}); raise budget or lower beta")
        return b

    def scores(self, view):  # SnapKV's score (the pyramid is in the budgets)
        scores = view.window_attention(window_reduce("sum"))
        return pooled_window_scores(scores, view.positions, view.window()[1], self.options.kernel)

    @classmethod
    def check_config(cls, config):
        o = config.options
        if config.budget <= o.window:
            raise ValueError(f"pyramidkv needs budget ({config.budget}) > window ({o.window})")
        # The deepest layer keeps about (C - w) / beta selected tokens; rounding can cost one.
        lowest = math.ceil((config.budget - o.window) / o.beta) - 1 + o.window
        if lowest <= config.n_sink + config.recent:
            raise ValueError(
                f"pyramidkv's deepest layers would keep ~{lowest} tokens, not more than n_sink + recent "
                f"({config.n_sink} + {config.recent}); raise budget, lower beta ({o.beta}) or n_sink")

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # the observation window itself is kept
