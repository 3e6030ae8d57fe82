"""Nexus Sampling (Duong et al.): walk-augmented block scores + n-averaged weighted reservoir selection.

One eviction step (§2, Fig. 2): once right after the prompt's last token (default
``prompt_eviction="end"``; also at every prompt chunk under ``"stream"``), then lazily in decode once
the stored rows exceed ``budget + block_size``:

1. S_hat = rownorm(BlockSum_b(softmax(Q Kᵀ · scale))) over the last W observed queries, causal
   by absolute position, blocks of b stored rows (Eq. 1).
2. a = mean_q a^(q) (Eq. 3); C <- C + (1 + <a^(q), C>) a^(q) over the most recent H window rows,
   oldest first (Eq. 4); s = a + λ C/||C||_1 (Eq. 2); w = s + ε_tie j/(N_k-1) (Eq. 5).
3. Force the sink block(s) and the blocks of the recent window; keep the top
   K = (budget - forced rows) // b other blocks by the n-averaged reservoir priority (Eq. 6, in the
   log domain), or by w when ``n_samples=None`` (deterministic limit, Lemma A.2).

Head averaging (App. A.1: Q and K are "head-averaged"): with ``per_head=False`` (default) the
window queries are averaged over all query heads and the keys over all KV heads, giving ONE
(W x N) attention and one layer-shared block selection that every KV head keeps. With
``per_head=True`` each KV head gets its own selection, scored with the mean of its GQA group's
query heads against its own keys. See docs/methods/nexus.md.

Ada-Nexus (App. C, ``allocation="ada"``): scoring is per KV head (as ``per_head=True``, whatever
``per_head`` says) and Ada-KV's head-adaptive budgets are applied at block granularity
(``caches.allocation.AdaBlocks``): heads keep different numbers of blocks, padded by whole blocks.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ...caches.allocation import AdaBlocks, Uniform
from ...caches.method import Method, Needs
from ...ops.anomaly import ANOMALY_DEFAULTS, anomaly_scores, episodic_block_size
from ...ops.select import PAD_POSITION
from ...options import option
from ...registry import register
from .ops import (block_distribution, block_max, block_priority, block_rows, block_sums, forced_blocks, head_means,
                  log_reservoir_priority, n_blocks, nexus_weights, select_blocks, shared_block_weights, top_blocks)

@dataclasses.dataclass
class NexusOptions:
    """Nexus Sampling options; defaults are the paper's (§5.1)."""

    block_size: int = option(32, low=1, small=4, doc="b: tokens per key block; also the eviction slack")
    window: int = option(16, low=1, small=4, doc="W: observation window (recent queries scored)")
    walk_depth: int = option(3, low=1, doc="H: walk steps (most recent H window rows)")
    lam: float = option(0.5, low=0.0, doc="λ: weight of the walk (bridge) term; 0 disables the walk")
    eps_tie: float = option(1e-6, low=0.0, doc="ε_tie: recency tie-break magnitude (Eq. 5)")
    n_samples: int = option(5, low=1, allow_none=True,
                            doc="n: reservoir averaging count (Eq. 6); None = n→∞ = deterministic top-K by w")
    per_head: bool = option(False, doc="False: one layer-shared selection (all KV heads keep the same "
                                       "blocks); True: one selection per KV head (its GQA group averaged)")
    head_average: str = option("attention", choices=("attention", "vectors"),
                               doc="how heads are averaged (App. A.1 'head-averaged'): 'attention' averages "
                                   "the per-head block distributions S_hat; 'vectors' averages the query and "
                                   "key vectors before one softmax (literal reading; measurably worse)")

    # Our deviation from the paper (docs/methods/nexus.md): better on both models, paired.
    prompt_top_k: bool = option(True, doc="deterministic top-K by w (the n→∞ limit) at the one-shot "
                                          "compression when the prompt ends, the reservoir (n_samples) for "
                                          "decode evictions: the survival argument (§4, Lemma 4.1) is about "
                                          "repeated eviction steps, which the one-shot step is not; False = "
                                          "the reservoir everywhere (the paper)")
    smooth_blocks: int = option(0, low=0, doc="r: neighbour smoothing of the block weights before selection "
                                              "(each block takes the largest w within r blocks, SnapKV's "
                                              "pooling at block level) so a needle straddling a block "
                                              "boundary keeps both blocks' odds; 0 = off (the paper)")

    key_prior: float = option(0.0, low=0.0, high=1.0,
                              doc="γ: weight of a question-agnostic key-anomaly prior mixed into the block "
                                  "weights, w <- (1-γ) w/Σw + γ p, p = NestedKV's multi-scale key-anomaly "
                                  "score, block max, averaged over the heads sharing a selection; aims at "
                                  "needles evicted while a long prompt streams, before any question; 0 = off "
                                  "(the paper)")

    def check(self):
        if self.walk_depth > self.window:
            raise ValueError(f"NexusOptions.walk_depth ({self.walk_depth}) must be <= window "
                             f"({self.window}): the walk consumes observation-window rows (Eq. 4)")


def neighbour_max(w: mx.array, radius: int, forced: mx.array | None = None) -> mx.array:
    """Each block's weight replaced by the largest within ``radius`` blocks on either side (last axis),
    renormalised to sum to 1. ``forced`` blocks (kept anyway: the sink, the recent window) lend their
    weight to no neighbour (the attention sink would otherwise always win the block after it)."""
    if forced is not None:
        w = mx.where(forced, 0.0, w).astype(w.dtype)
    out = w
    nk = w.shape[-1]
    for s in range(1, min(radius, nk - 1) + 1):
        zeros = mx.zeros((*w.shape[:-1], s), dtype=w.dtype)
        out = mx.maximum(out, mx.concatenate([w[..., s:], zeros], axis=-1))   # right neighbour
        out = mx.maximum(out, mx.concatenate([zeros, w[..., :-s]], axis=-1))  # left neighbour
    return out / mx.maximum(out.sum(axis=-1, keepdims=True), 1e-30)


def min_budget(block_size: int, n_sink: int, recent: int) -> int:
    """Smallest budget that always holds the forced sink block(s), the recent-window blocks (up to
    max(recent, 1) + b - 1 rows when the window straddles a block boundary) and one selectable block."""
    return n_blocks(n_sink, block_size) * block_size + (max(recent, 1) + block_size - 1) + block_size


@register("nexus")
class Nexus(Method):
    """Nexus Sampling: walk-augmented block scores; top-K blocks at the prompt's end, n-averaged reservoir in decode."""

    Options = NexusOptions
    needs = Needs(window="window")
    allocations = {"uniform": Uniform, "ada": AdaBlocks}  # Ada-Nexus (App. C): Ada-KV over whole blocks

    @classmethod
    def default_recent(cls, budget, options):
        return options.window  # force the blocks holding the observation window

    @classmethod
    def check_config(cls, config):
        o = config.options
        if o.key_prior and config.allocation == "ada":
            raise ValueError("nexus key_prior is not supported with allocation='ada' (the anomaly score "
                             "needs each head's rows compacted; Ada-Nexus storage is ragged by blocks)")
        need = min_budget(o.block_size, config.n_sink, config.recent)
        if config.budget < need:
            raise ValueError(
                f"nexus budget ({config.budget}) too small: it must hold the forced sink block(s) "
                f"(ceil(n_sink={config.n_sink} / b={o.block_size}) blocks), the recent-window blocks "
                f"(up to recent={max(config.recent, 1)} + b - 1 rows) and at least one selectable block of "
                f"b={o.block_size} rows: need budget >= {need}")

    def slack(self) -> int:
        return self.options.block_size  # evict once a whole block of b rows is over the budget

    # -- scoring ------------------------------------------------------------------------------
    def block_weights(self, view) -> mx.array:
        """w (B, G, N_k) for the stored rows (Eq. 1-5); G = 1 (layer-shared) or H_kv."""
        o = self.options
        pos = view.positions
        B, H = pos.shape[:2]
        q, q_pos, scale = view.window()
        G = q.shape[1] // H
        d = view.shard  # tensor parallel: this rank's heads (None: one process)
        per_head = o.per_head or self.config.allocation == "ada"  # Ada needs per-KV-head weights
        if o.head_average == "attention":
            # S_hat per query head against its own KV head, then averaged over the heads that share a
            # selection: all of them (layer-shared) or the GQA group (per KV head).
            if view.paged:  # a paged prompt's end: the softmax's block sums, a block of rows at a time
                s_hat = view.window_attention(lambda p: block_sums(p, o.block_size), align=o.block_size)
                s_hat = s_hat / s_hat.sum(axis=-1, keepdims=True)  # rownorm (Eq. 1)
            else:
                q = q.reshape(B, H, G, *q.shape[2:])
                s_hat = block_distribution(q, mx.expand_dims(view.keys, 2), q_pos, mx.expand_dims(pos, 2), scale,
                                           o.block_size)  # (B, H, G, W, N_k)
            if not per_head and d is not None:  # heads on other ranks too: all_sum of a few rows
                return shared_block_weights(d, s_hat.sum(axis=(1, 2)), H * G, o.walk_depth, o.lam,
                                            o.eps_tie)
            s_hat = s_hat.mean(axis=2) if per_head else s_hat.mean(axis=(1, 2))[:, None]
        elif per_head:
            q = q.reshape(B, H, G, *q.shape[2:]).mean(axis=2) if G > 1 else q  # GQA-group-averaged query
            s_hat = block_distribution(q, view.keys, q_pos, pos, scale, o.block_size)
        else:
            # Head-averaged Q and K vectors (App. A.1, literal); positions agree across heads (uniform storage).
            keys = view.keys
            keys = keys if keys.dtype == mx.float32 else keys.astype(mx.float32)
            if d is None:
                k_mean, q_mean = keys.mean(axis=1, keepdims=True), q.mean(axis=1, keepdims=True)
            else:  # the means over every rank's heads
                k_mean, q_mean = head_means(d, keys.sum(axis=1, keepdims=True), q, H)
            s_hat = block_distribution(q_mean, k_mean, q_pos, pos[:, :1], scale, o.block_size)
        return nexus_weights(s_hat, o.walk_depth, o.lam, o.eps_tie)

    def key_prior_weights(self, view, n_groups: int) -> mx.array:
        """p (B, n_groups, N_k): NestedKV's multi-scale key-anomaly score of every stored row (needs no
        query, so it is the same whatever question follows), max over each block, averaged over the
        heads that share a selection (all of them when n_groups == 1), normalised to sum 1."""
        keys, pos = view.keys, view.positions
        valid = pos != PAD_POSITION
        # forced rows (sinks, the recent window) are kept anyway: keep them out of the normalisation
        forced = valid & ((pos < view.n_sink) | (pos >= view.offset - max(view.recent, 1)))
        o = ANOMALY_DEFAULTS  # the key prior scores rows with the anomaly score's defaults
        s = anomaly_scores(keys, valid, forced, window=o.window, block=episodic_block_size(keys.shape[2]),
                           prior=o.prior, beta=o.beta, tau=o.tau, kappa=o.kappa, gap_frac=o.gap_frac)
        p = block_max(mx.where(mx.isfinite(s), s, 0.0), self.options.block_size)  # (B, H, N_k)
        if n_groups == 1:
            d = view.shard  # tensor parallel: every rank's heads (one all_sum of N_k floats)
            p = p.sum(axis=1, keepdims=True)
            p = p if d is None else d.all_sum(p)
        return p / mx.maximum(p.sum(axis=-1, keepdims=True), 1e-30)

    def select(self, view, keep, allocation):
        o = self.options
        pos = view.positions
        (B, H, N), b = pos.shape, o.block_size
        mask, n_forced, forced_rows = forced_blocks(N, b, view.n_sink, view.recent)
        n_free = max((keep - forced_rows) // b, 0)
        n_keep = n_forced + n_free
        w = self.block_weights(view)
        if o.key_prior:
            w = ((1.0 - o.key_prior) * w / mx.maximum(w.sum(axis=-1, keepdims=True), 1e-30)
                 + o.key_prior * self.key_prior_weights(view, w.shape[1]))
        if o.smooth_blocks:
            w = neighbour_max(w, o.smooth_blocks, mask)
        n = None if (o.prompt_top_k and view.compressing) else o.n_samples
        key = view.key() if n is not None else None
        if isinstance(allocation, AdaBlocks):
            # Ada-Nexus: per-head budgets over whole blocks; padding blocks are never candidates.
            n_lead = min(n_blocks(view.n_sink, b), n_blocks(N, b))
            valid = pos[..., ::b] != PAD_POSITION  # a block is all real or all padding
            blocks, real = allocation.blocks(view, w, valid, n_lead, n_forced - n_lead, n_free,
                                             rank=lambda w: block_priority(w, n, key))
            idx = block_rows(blocks, b, N)
            return idx, mx.repeat(real, b, axis=-1)[..., :idx.shape[-1]]
        d = view.shard
        if d is not None and o.per_head and n is not None:
            # per-head draws for the global head layout, sliced to this rank's heads (no traffic)
            u = d.uniform(key, (n, *w.shape), axis=2)
            blocks = top_blocks(log_reservoir_priority(w, u), mask, n_keep)
        else:
            blocks = select_blocks(w, mask, n_keep, n, key)
        idx = block_rows(blocks, b, N)
        return mx.broadcast_to(idx, (B, H, idx.shape[-1]))
