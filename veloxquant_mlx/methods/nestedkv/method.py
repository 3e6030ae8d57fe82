"""NestedKV-adapted: multi-scale, key-only, one-shot prefill eviction (spec: docs/sources/nestedkv_method.txt).

Inspired by Chen et al., "NestedKV" (arXiv:2605.26678, unpublished preprint): an adaptation, not a
faithful port. When the prompt ends (right after the first single-token step after multi-token input) every head's
keys are scored against three anchors (stable / episodic / current), the three min-max normalized
anomalies are blended per head (log-prior (0.4, 0.4, 0.2) + beta * top/bottom-10% gap, softmax) and
routed per token toward the strongest scale by a surprise gate (sigmoid(kappa * (u - tau)) on the
min-max normalized, mean-centred cross-scale std). Heads then compete for the layer's H * budget
slots: each keeps a floor of floor(safeguard_alpha * budget) rows, the rest go to the best
(head, row) pairs of the layer (``caches.allocation.CrossHeadPool``). Heads therefore keep different
numbers of rows; storage is padded to a static bound and the query tap's per-layer mask hides the padding.

Choices where the spec is silent (see docs/methods/nestedkv.md):
- "strongest scale" is per token: the largest of the three normalized anomalies at that token.
- sinks (positions < n_sink) are kept (+inf) and excluded from the min-max / gap / surprise statistics.
- without the query tap padding could not be masked: uniform per-head budget.
- decode tokens are appended, never rescored: the cache is NOT bounded during decode. A new prompt
  turn is compressed again at its end, over the kept rows plus the new ones (ragged storage is first
  compacted per head; episodic blocks / windows then run over that compacted order).
"""

from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from ...caches.allocation import CrossHeadPool, Uniform, cut, head_cap
from ...caches.method import Method, Needs
from ...ops import gather_rows
from ...ops.select import PAD_POSITION
from ...ops.anomaly import ANOMALY_DEFAULTS as _A
from ...ops.anomaly import anomaly_scores, episodic_block_size
from ...ops.attention import causal_attention, one_pass
from ...options import option
from ...registry import register


@dataclasses.dataclass
class NestedKVOptions:
    window: int = option(_A.window, low=1, small=8, doc="W: trailing window of the current-memory anchor")
    beta: float = option(_A.beta, low=0.0, doc="head-adaptive blend temperature")
    tau: float = option(_A.tau, doc="surprise gate threshold (min-max normalized, mean-centred std)")
    kappa: float = option(_A.kappa, low=0.0, doc="surprise gate sharpness")
    safeguard_alpha: float = option(0.20, low=0.0, high=1.0, doc="per-head guaranteed floor (fraction of budget)")
    prior: tuple = option(_A.prior, kind=tuple, doc="blend log-prior (stable, episodic, current)")
    gap_frac: float = option(_A.gap_frac, low=0.0, low_open=True, high=0.5, doc="top/bottom fraction of the gap")
    cross_head: bool = option(True, doc="cross-head budget competition (needs the query tap)")
    # Prompt chunks' attention (NestedKV itself reads no queries): "blocked" computes it in query
    # sub-blocks that skip their causal future (exact to float rounding; faster than MLX's CPU kernel,
    # docs/methods/nestedkv.md), "mlx" leaves it to mlx-lm's kernel; "auto": blocked on the CPU only.
    prefill_attention: str = option("auto", choices=("auto", "blocked", "mlx"),
                                    doc="prompt chunks' attention: blocked sub-blocks (CPU) or mlx-lm's kernel")
    query_block: int = option(256, low=1, doc="prompt queries per blocked-attention sub-block")
    max_head_factor: float = option(None, kind=float, low=1.0, allow_none=True,
                                    doc="cap on one head's rows, in budgets (None: KVCacheConfig.max_head_factor, "
                                        "default 1.1; set both to None for the spec's bound)")

    def check(self):
        if len(self.prior) != 3 or any((not isinstance(p, (int, float))) or p <= 0 for p in self.prior):
            raise ValueError(f"NestedKVOptions.prior must be 3 positive numbers, got {self.prior!r}")
        self.prior = tuple(float(p) for p in self.prior)


def pool(config):
    """Spec step 5: the cross-head pool, a floor of ``safeguard_alpha x budget`` rows per head (or, with
    ``cross_head=False``, every head its own budget)."""
    o = config.options
    if not o.cross_head:
        return Uniform()
    floor = min(int(math.floor(o.safeguard_alpha * config.budget)), config.budget)
    cap = head_cap(config.max_head_factor if o.max_head_factor is None else o.max_head_factor, config.budget)
    return CrossHeadPool(floor, cap)


@register("nestedkv")
class NestedKV(Method):
    """NestedKV-adapted: stable/episodic/current key anomalies, gated blend, cross-head budgets (prefill only)."""

    Options = NestedKVOptions
    needs = Needs(queries=False)
    prefill_only = True
    allocations = {"uniform": pool}

    @classmethod
    def default_recent(cls, budget, options):
        return 0  # the "current" scale replaces a forced recent window

    def on_rows(self, view, step):
        # A prompt chunk's attention, where the tap lets the method hand it back (one pass): the rows stored
        # now are the rows update_and_fetch returned (a chunk appends; compression runs at the end step).
        q = step.queries
        if q is None or q.shape[2] == 1 or not (step.attend and one_pass(self.options.prefill_attention, "blocked")):
            return {}
        out = causal_attention(q, view.keys, view.values, view.positions, view.offset - q.shape[2], step.scale,
                               self.options.query_block)
        return {}, out

    def row_scores(self, keys, positions, offset):
        """(B, H, N) final scores of the given rows (compacted: valid rows first)."""
        valid = positions != PAD_POSITION
        forced = valid & (positions < self.config.n_sink)
        # The newest row (the prompt's last token: the compression runs right after it) is always
        # kept, like every other method's recent window; recent=0 by default otherwise.
        forced = forced | (valid & (positions >= offset - max(self.config.recent, 1)))
        o = self.options
        return anomaly_scores(keys, valid, forced, window=o.window, block=episodic_block_size(keys.shape[2]),
                              prior=o.prior, beta=o.beta, tau=o.tau, kappa=o.kappa, gap_frac=o.gap_frac)

    def select(self, view, keep, allocation):
        keys, pos = view.keys, view.positions
        order = None
        if view.ragged:  # compact: each head's real rows first, in position order
            N = pos.shape[-1]
            r = mx.arange(N, dtype=mx.int32)
            order = mx.argsort(mx.where(pos != PAD_POSITION, r, N + r), axis=-1).astype(mx.int32)
            keys, pos = gather_rows(keys, order), gather_rows(pos, order)
        s = self.row_scores(keys, pos, view.offset)
        heads = s.shape[1] if view.shard is None else view.shard.total_heads(s.shape[1])
        if isinstance(allocation, CrossHeadPool) and heads > 1:  # the layer's heads compete for H x budget slots
            idx, real = allocation.rows(view, s, keep)
        else:
            idx = Uniform().rows(view, s, keep, forced=False)
            if order is None:
                return idx  # uniform per-head budget: no padding
            idx, real = cut(view, idx, gather_rows(pos, idx) != PAD_POSITION)
        return (idx if order is None else gather_rows(order, idx)), real
