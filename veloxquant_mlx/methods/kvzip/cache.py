"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): keep what the model needs to reconstruct its
own context.

When the prompt ends, the model re-reads its context through a reconstruction pass ("Repeat the
previous context exactly." followed by the context tokens) with the prompt's cache as the past. Every
stored row is scored by the maximum attention it receives in that pass, per KV head, over the GQA
group and the reconstruction positions (Sec. 3, importance scoring); the context is reconstructed
in chunks of about 2K tokens (Sec. 3, chunked scoring). Each head keeps its top rows plus the
sinks and the recent window (Ada-KV head budgets with ``allocation="ada"``: the paper's non-uniform
head budget, within a layer).

A cache cannot call the model: the builder wraps the model (the glue's model-pass hook), whose
forward frame gives the token ids each forward feeds (this file stores them per row, ``zip_ids``) and,
right after a forward in which a cache deferred its compression, calls ``run_model_pass``: the pass
(``methods/kvzip/model_pass.py``) runs with the caches in scoring
mode (``begin_chunk`` .. ``end_chunk``: attention reads the stored rows plus the pass's own keys,
which are never stored; the tap's queries score the rows), then every cache evicts
(``finish_pass``). Prefill-only: decode tokens are appended. A later turn scores only the text that
arrived since the last pass (rows with position >= ``zip_scored``); kept rows keep their scores.

Used without the model wrapper (a cache built directly, no ids), the cache falls back to the max
attention of its last ``window`` prompt queries: not KVzip, documented in docs/methods/kvzip.md.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from ...options import option
from .model_pass import reconstruct
from .ops import reconstruction_attend, reconstruction_scores, value_output_norms, window_max_scores
from ...registry import register
from ...caches import forward
from ...caches.base import EvictionCache
from ...caches.quant import dequantize_rows, quantize_rows, rows_map, rows_zip
from ...caches.storage import with_headroom


@dataclasses.dataclass
class KVzipOptions:
    # Sec. 3 (chunked scoring): the context is reconstructed in chunks of 2K tokens (bounded memory).
    chunk: int = option(2048, low=1, small=24, doc="context tokens reconstructed per forward of the pass")
    overlap: int = option(8, low=0, doc="previous chunk's last tokens quoted in the next repeat prompt")
    q_block: int = option(512, low=1, doc="reconstruction queries per scoring sub-block (bounds memory)")
    window: int = option(16, low=1, small=8, doc="fallback only (no model pass): last queries that score")
    # One pass on the CPU (ops.attention.fused_scoring_default): the scoring softmax also gives the
    # layer's output when the chunk's rows are every row attention reads (the first pass of <= chunk).
    pass_attention: str = option("auto", choices=("auto", "fused", "separate"),
                                 doc="reconstruction pass: auto | fused (one softmax) | separate")
    # "each": every layer keeps ``budget`` rows per head (the library's contract). "global": one
    # ranking over every layer's rows decides each layer's share (the paper's non-uniform budget);
    # the total stays layers x heads x budget. Reads the L shares back once per pass.
    # Tiny test shapes (small=) keep "each": the generic per-layer contract tests; test_kvzip tests "global".
    layers: str = option("global", choices=("each", "global"), small="each",
                         doc="budget across layers: each | global")
    # "plus": KVzip+ (KVzap, arXiv 2601.07891): the probability over the query's hidden-state norm, times
    # the row's ||W_o v||. Needs the pass's hook on the attention modules (methods/kvzip/model_pass.py).
    normalize: str = option("none", choices=("none", "plus"), doc="row score: none (KVzip) | plus (KVzip+)")


@register("kvzip")
class KVzipCache(EvictionCache):
    """KVzip: rows scored by the max attention of the model's reconstruction of its context."""

    Options = KVzipOptions
    # Sec. 3 (non-uniform head budgets): one ranking of every head's rows, no per-head floor. The cap
    # (2 x the layer's share in one head) is ours: storage is as wide as the widest head.
    config_defaults = {"allocation": "ada", "floor_alpha": 0.0, "max_head_factor": 2.0}
    prefill_only = True
    needs_model_pass = True  # the builder installs veloxquant_mlx.model_pass for this method
    model_pass_note = "KVzip's reconstruction pass"  # what `compress`'s progress bar says runs at the end
    compresses_in_model_pass = True  # the prompt-end compression runs after the forward (recall_hold refuses)

    @classmethod
    def run_model_pass(cls, driver, seq):
        reconstruct(cls, driver, seq)  # methods/kvzip/model_pass.py

    def __init__(self, config, layer_idx=0, n_layers=1):
        super().__init__(config, layer_idx, n_layers)
        self.query_window = self.options.window  # only read by the fallback
        self.zip_scored = 0  # positions < zip_scored carry a reconstruction score
        self.zip_passes = 0  # reconstruction passes run over this cache
        self._ids_known = True  # every row since zip_scored has its token id
        self._zip_due = False
        self._chunk = None  # (first row, end row, sink rows) while a reconstruction chunk runs
        self._own = None  # that chunk's own keys and values (never stored)
        self._parts = []  # per-chunk scores of the pass in progress
        self._plus = None  # KVzip+: (1 / ||h|| of the chunk's queries, the attention's W_o), set per chunk

    def extra_row_fields(self):
        return {"zip_score": 0.0, "zip_ids": -1.0}

    rows_written_on_append = ("zip_ids",)  # _append writes every new row's id (-1: unknown)

    def scores(self):
        return self.stored("zip_score")

    # -- token ids ------------------------------------------------------------------------------
    def _append(self, keys, values):
        prev = self._rows
        super()._append(keys, values)
        self.on_light_append(prev, keys.shape)

    def on_light_append(self, prev, shape=None):
        """The token ids of the rows ``prev ..`` just appended (``shape``: their keys'; the light step's one row)."""
        shape = shape or self._light_k
        ids = forward.input_ids()  # this row's slice when a batch cache feeds it
        ids = None if ids is None or ids.shape != (shape[0], shape[2]) else mx.expand_dims(ids.astype(mx.float32), 1)
        if ids is None:
            self._ids_known = False
        self.row_extras["zip_ids"][:, :, prev:prev + shape[2]] = -1.0 if ids is None else ids

    @property
    def pending(self) -> int:
        """Tokens seen since the last reconstruction pass (the newest rows, never evicted yet)."""
        return self.offset - self.zip_scored

    def pending_ids(self) -> mx.array:
        """(B, pending) int32 token ids of the text the next pass reconstructs."""
        r = self._rows
        return self.row_extras["zip_ids"][:, 0, r - self.pending:r].astype(mx.int32)

    # -- compression: deferred to the model pass when the wrapper drives this forward ------------
    def _evict(self):
        n = self.pending
        if n > 0:
            if self._ids_known and forward.defer(self):
                self._zip_due = True  # the wrapper runs the pass after this forward, then finish_pass
                return
            self._fallback_scores(n)
        super()._evict()

    def _fallback_scores(self, n):
        """No model pass possible: the last prompt queries' max attention scores the pending rows."""
        q, q_pos, scale = self.observed_window()
        r = self._rows
        s = window_max_scores(q, self.stored("keys")[:, :, r - n:r], q_pos, self.positions[:, :, r - n:r], scale)
        self._set_pending_scores(s)

    def _set_pending_scores(self, s):
        r, n = self._rows, self.pending
        old = self.row_extras["zip_score"]
        rows = mx.concatenate([old[:, :, :r - n], s.astype(mx.float32)], axis=2) if r > n else s
        self.row_extras["zip_score"] = with_headroom(rows, old.shape[2] - r)
        self.zip_scored = self.offset
        self._ids_known = True

    # -- the reconstruction pass (driven by veloxquant_mlx.model_pass) ----------------------------
    def begin_chunk(self, lo: int, hi: int) -> None:
        """Scoring mode for pending tokens [lo, hi): the next forward attends to the stored rows plus
        its own keys (never stored), and its queries score the rows of those tokens."""
        base = self._rows - self.pending
        self._chunk = (base + lo, base + hi, min(self.n_sink, base + lo))
        self._own = None

    def end_chunk(self) -> None:
        self._chunk = self._own = self._plus = None

    def observe_hidden(self, hidden: mx.array, o_weight: mx.array) -> None:
        """KVzip+: the attention module's input (B, S, hidden) of this chunk and its output projection
        weight (hidden, query heads * head_dim); the model pass's hook calls it before the attention runs."""
        if self._chunk is not None:
            inv = mx.rsqrt(mx.maximum(mx.square(hidden.astype(mx.float32)).sum(axis=-1), 1e-30))
            self._plus = (inv, o_weight)

    def finish_pass(self) -> None:
        """Every chunk scored: store the pending rows' scores (then ``compress``)."""
        parts, self._parts = self._parts, []
        if parts:
            self._set_pending_scores(parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2))
            self.zip_passes += 1

    def compress(self, budget: int | None = None) -> None:
        """The deferred compression, to ``budget`` rows per head (default: the configured one)."""
        if not (self._zip_due and self.pending == 0):
            return
        self._zip_due = False
        with self.prompt.compressing_to(budget):  # the budget itself stays; keep_rows() reads the target
            super()._evict()

    def _end_prompt(self):
        # "global": a layer below its own budget may still have to give rows to another layer.
        if self.options.layers == "global" and self.pending and self.offset > self.budget >= self._rows:
            self.prompt.ending = False
            self._evict()
            return
        super()._end_prompt()

    def update_and_fetch(self, keys, values):
        if self._chunk is None:
            return super().update_and_fetch(keys, values)
        self._check_kv(keys, values)
        self._own = (keys, values)
        k, v = self._fetch()
        B, H, S = keys.shape[:3]
        new_pos = mx.broadcast_to(mx.arange(self.offset, self.offset + S, dtype=mx.int32), (B, H, S))
        self.note_fetched(mx.concatenate([self.positions[:, :, :self._rows], new_pos], axis=2))
        if self.queries_from_keys:  # no tap: keys stand in for the queries, as everywhere else
            self._score_chunk(keys, keys.shape[-1] ** -0.5)
        # Quantized rows: the pass's own rows join in the stored layout, so attention takes one path.
        return self._join(k, keys), self._join(v, values)

    def _join(self, stored, new):
        new = quantize_rows(new, self.kv_bits, self.kv_group_size)
        return rows_zip(lambda a, b: mx.concatenate([a, b], axis=2), stored, new)

    def _key_rows(self, lo, hi):
        """Stored keys lo:hi as attention reads them (dequantized when the rows are quantized)."""
        return dequantize_rows(rows_map(lambda x: x[:, :, lo:hi], self.keys), self.kv_bits, self.kv_group_size)

    def observe_queries(self, queries, scale=None):
        if self._chunk is None:
            return super().observe_queries(queries, scale)
        self._score_chunk(queries, queries.shape[-1] ** -0.5 if scale is None else float(scale))

    def _fuse_attention(self, lo, hi, lead) -> bool:
        return (self.one_pass(self.options.pass_attention) and lead == 0 and lo == 0 and hi == self._rows
                and self.kv_bits is None and not self.is_ragged)

    def _plus_weights(self, lo, hi, lead, n_heads):
        """KVzip+'s (1 / ||h||, ||W_o v|| of the sink rows then rows lo:hi), or None for plain KVzip."""
        if self.options.normalize != "plus":
            return None
        if self._plus is None:
            raise RuntimeError("kvzip normalize='plus' needs the attention inputs of the pass: build the caches "
                               "with KVCacheBuilder.for_model / install on a model whose layers have self_attn.o_proj")
        inv_h, o_weight = self._plus
        vals = self._value_rows(lo, hi)
        if lead:
            vals = mx.concatenate([self._value_rows(0, lead), vals], axis=2)
        return inv_h, value_output_norms(vals, o_weight, n_heads)

    def _value_rows(self, lo, hi):
        return dequantize_rows(rows_map(lambda x: x[:, :, lo:hi], self.values), self.kv_bits, self.kv_group_size)

    def _score_chunk(self, queries, scale):
        lo, hi, lead = self._chunk
        own_keys, own_values = self._own
        if self._fuse_attention(lo, hi, lead):  # the chunk's rows are all the rows attention reads
            self.attend.out, s = reconstruction_attend(queries, self.stored("keys")[:, :, lo:hi], own_keys,
                                                           self.stored("values")[:, :, lo:hi], own_values,
                                                           scale, self.options.q_block,
                                                           self._plus_weights(lo, hi, lead, queries.shape[1]))
            self._parts.append(s)
            return
        ctx = self._key_rows(lo, hi)
        if lead:
            ctx = mx.concatenate([self._key_rows(0, lead), ctx], axis=2)
        self._parts.append(reconstruction_scores(queries, ctx, own_keys, scale, lead, self.options.q_block,
                                                 self._plus_weights(lo, hi, lead, queries.shape[1])))

    def attention_mask(self, mask, queries):
        if self._chunk is None:
            return super().attention_mask(mask, queries)
        S = queries.shape[2]
        if not self.is_ragged:
            return create_causal_mask(S, offset=self._rows) if isinstance(mask, mx.array) else mask
        return self.ragged_mask(self.fetched_positions, mx.arange(self.offset, self.offset + S), queries)

    def step_state(self):
        # A scoring step stores nothing; its scores are tied to the layer's output so each layer's
        # max is taken as the pass reaches it, not after the last layer (which kept every layer's
        # attention probabilities alive until then).
        return self._parts[-1:] if self._chunk is not None else super().step_state()

    # -- save / load: the scoring bookkeeping travels with the rows ------------------------------
    @property
    def meta_state(self):
        meta = json.loads(EvictionCache.meta_state.fget(self))
        meta["kvzip"] = {"scored": self.zip_scored, "passes": self.zip_passes, "ids_known": self._ids_known}
        return json.dumps(meta, sort_keys=True)

    @meta_state.setter
    def meta_state(self, text):
        EvictionCache.meta_state.fset(self, text)
        z = json.loads(text).get("kvzip", {})
        self.zip_scored = int(z.get("scored", 0))
        self.zip_passes = int(z.get("passes", 0))
        self._ids_known = bool(z.get("ids_known", True))
