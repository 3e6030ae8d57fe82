"""Allocation: how a layer's ``H x keep`` kept rows are split over its KV heads, one object per rule.

A method declares which rules it runs (``Method.allocations``: config name -> one of these) and the
config picks one. Every rule returns the rows to keep, (B, H, K) indices ascending per head; a ragged
rule (heads keep different counts) returns (indices, real), ``real`` False on the padding rows, cut to
the widest head. Ragged storage needs the query tap's per-layer mask to hide its padding; the cache
falls back to :class:`Uniform` where the tap is not active.

* :class:`Uniform`: every head keeps its own top ``keep`` rows.
* :class:`AdaRows`: Ada-KV (Feng et al., NeurIPS 2025): the heads share the layer's slots by one
  layer-wide ranking of their scores, with a floor per head (``floor_alpha``).
* :class:`AdaBlocks`: the same allocation over whole blocks of rows (Nexus App. C, Ada-Nexus).
* :class:`CrossHeadPool`: a guaranteed floor of rows per head, the rest of the layer's slots to the best
  (head, row) pairs of the layer (NestedKV's cross-head competition).
* :class:`LayerShares`: one ranking across a sequence's layers: each layer's share of the total budget
  (KVzip's non-uniform layer budget, Sec. 3), computed after the forward by the builder's model-pass hook.

Under tensor parallelism (``view.shard``) the layer-wide steps combine every rank's heads.
"""

from __future__ import annotations

import warnings

import mlx.core as mx

from ..ops import keep_top_rows
from ..ops.allocation import (ada_keep, ada_select_blocks, cross_head_keep, layer_winner_counts, max_head_rows,
                              rows_from_mask)
from .shard import group_max
from ..ops.select import PAD_POSITION


def ragged_width(shard, counts: mx.array) -> int:
    """The largest of the (B, H) per-head kept counts, read back to size ragged storage: the one host sync
    of ragged storage, once per eviction step (under tensor parallelism the widest head of the group)."""
    return group_max(shard, counts.max())


def cut(view, idx: mx.array, real: mx.array):
    """Ragged rows (every head's real ones first) cut to the widest head actually kept."""
    width = max(ragged_width(view.shard, real.sum(axis=-1)), 1)
    return idx[..., :width], real[..., :width]


def head_cap(factor: float | None, keep: int) -> int | None:
    """Most rows one head may keep under ragged budgets, ``factor`` x ``keep`` (None: no cap)."""
    return None if factor is None else max(int(factor * keep), keep)


class Uniform:
    """Every head keeps its own top ``keep`` rows (the sinks and the recent window forced)."""

    ragged = False

    def __init__(self, config=None):
        pass

    def rows(self, view, scores: mx.array, keep: int, forced: bool = True) -> mx.array:
        """``forced`` False: the scores already rank the rows a method always keeps (NestedKV's)."""
        return keep_top_rows(scores, keep, view.n_sink if forced else 0, view.recent if forced else 0)


class AdaRows:
    """Ada-KV over rows: one layer-wide ranking of every head's scores splits the layer's slots, with a
    floor of ``floor_alpha x keep`` per head and at most ``max_head_factor x keep`` in one head."""

    ragged = True

    def __init__(self, config):
        self.floor_alpha, self.max_head_factor = config.floor_alpha, config.max_head_factor

    def rows(self, view, scores: mx.array, keep: int):
        idx, real = ada_keep(scores, view.positions, view.offset, keep, view.n_sink, view.recent, self.floor_alpha,
                             PAD_POSITION, layer=view.shard, cap=head_cap(self.max_head_factor, keep))
        return cut(view, idx, real)


class AdaBlocks:
    """Ada-KV over whole blocks of rows (Nexus App. C): per-block priorities (B, H, N_k), comparable across
    heads, share the layer's ``H x n_sel`` selectable blocks; the first ``n_lead`` and last ``n_trail``
    blocks of every head are kept. Padding is whole blocks, so the block grid survives."""

    ragged = True

    def __init__(self, config):
        self.floor_alpha, self.max_head_factor = config.floor_alpha, config.max_head_factor

    def blocks(self, view, weights: mx.array, valid: mx.array, n_lead: int, n_trail: int, n_sel: int, rank=None):
        """(blocks (B, H, Wb) int32, real (B, H, Wb) bool): per head the lead blocks, its selected blocks
        ascending, padding blocks, then the trailing blocks; cut to the widest head's selection. ``rank``
        maps the layer's (B, H, N_k) weights to the priorities that compete (random draws see every head of
        the layer, as one process draws them); None: the weights themselves."""
        cap = head_cap(self.max_head_factor, n_sel)

        def allocate(weights, valid):
            priority = weights if rank is None else rank(weights)
            blocks, real = ada_select_blocks(priority, valid, n_lead, n_trail, n_sel, self.floor_alpha, cap)
            width = blocks.shape[-1]
            n_kept = max(ragged_width(view.shard, real[..., n_lead:width - n_trail].sum(axis=-1)), 0)
            keep = list(range(n_lead + n_kept)) + list(range(width - n_trail, width))
            if len(keep) == width:
                return blocks, real
            take = mx.array(keep, dtype=mx.int32)
            return mx.take(blocks, take, axis=-1), mx.take(real, take, axis=-1)

        # tensor parallel: every rank runs the layer-wide allocation over all heads (one all_gather)
        shard = view.shard
        return allocate(weights, valid) if shard is None else shard.across_heads(allocate, weights, valid)


class CrossHeadPool:
    """Every head keeps its top ``floor`` rows; the layer's other ``H x (keep - floor)`` slots go to the best
    (head, row) pairs of the whole layer, at most ``cap`` rows in one head. The scores rank the rows the
    method always keeps (+inf) and never keeps (-inf: padding); rows index the scores' own order."""

    ragged = True

    def __init__(self, floor: int, cap: int | None):
        self.floor, self.cap = floor, cap

    def rows(self, view, scores: mx.array, keep: int):
        def compete(s):
            H, N = s.shape[1], s.shape[2]
            k_max = max_head_rows(N, H, keep, self.floor, self.cap)
            return rows_from_mask(cross_head_keep(s, keep, self.floor, self.cap), k_max)

        shard = view.shard  # tensor parallel: every rank runs the competition over all heads (one all_gather)
        idx, real = compete(scores) if shard is None else shard.across_heads(compete, scores)
        return cut(view, idx, real)


_warned: set = set()


class LayerShares:
    """One ranking across a sequence's layers (KVzip Sec. 3): every layer's evictable rows (not the sinks,
    not the recent window) compete on one score scale, and layer ``l`` keeps ``n_sink + recent + (its
    winners / its heads)`` rows per head, so the total stays ``layers x heads x budget``."""

    def __init__(self, method: str):
        self.method = method

    def shares(self, views: list, field: str):
        """Rows per head for each layer (a list aligned with ``views``), ranked by the per-row ``field``
        (higher kept); None where one ranking is not possible (several sequences in one cache, tensor
        parallelism), warned once: then every layer keeps its own budget. Reads the L winner counts back
        once (after the forward, never inside ``update_and_fetch``)."""
        first = views[0]
        why = None
        if first.positions.shape[0] != 1:
            why = "a batch of several sequences in one cache"
        elif any(v.shard is not None for v in views):
            why = "tensor parallelism"
        if why is not None:
            if (self.method, why) not in _warned:
                _warned.add((self.method, why))
                warnings.warn(f"{self.method} layers='global' is not supported with {why}: each layer keeps its "
                              "own budget", stacklevel=4)
            return None
        forced_rows = first.n_sink + first.recent
        scores, cands = [], []
        for v in views:
            pos = v.positions
            forced = (pos < v.n_sink) | (pos >= v.offset - v.recent)
            scores.append(v.field(field))
            cands.append((pos != PAD_POSITION) & ~forced)
        heads = [c.shape[1] for c in cands]
        n_total = sum(heads) * (first.budget - forced_rows)
        counts = layer_winner_counts(scores, cands, n_total).tolist()
        return [forced_rows + int(round(n / h)) for n, h in zip(counts, heads)]
