"""KVzip (Kim et al., NeurIPS 2025, arXiv 2505.23416): keep what the model needs to reconstruct its
own context.

When the prompt ends, the model re-reads its context through a reconstruction pass ("Repeat the
previous context exactly." followed by the context tokens) with the prompt's cache as the past. Every
stored row is scored by the maximum attention it receives in that pass, per KV head, over the GQA
group and the reconstruction positions (Sec. 3, importance scoring); the context is reconstructed
in chunks of about 2K tokens (Sec. 3, chunked scoring). Each head keeps its top rows plus the
sinks and the recent window (Ada-KV head budgets with ``allocation="ada"``: the paper's non-uniform
head budget, within a layer).

A cache cannot call the model: the builder wraps the model (the glue's model-pass hook), which feeds
every forward's token ids to the caches (this method keeps them per row, ``zip_ids``) and, right after a
forward whose prompt ended, runs the method's ``model_pass``: the reconstruction
(``methods/kvzip/model_pass.py``) reads each cache's rows (``cache.reading()``: attention reads the stored
rows plus the pass's own keys, which are never stored; the tap's queries score the rows), then every
cache compresses. Prefill-only: decode tokens are appended. A later turn scores only the text that
arrived since the last pass (rows with position >= ``scored``); kept rows keep their scores.

Used without the model wrapper (a cache built directly, no ids), the method falls back to the max
attention of its last ``window`` prompt queries: not KVzip, documented in docs/methods/kvzip.md.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx

from ...caches.method import Method, Needs
from ...ops.attention import one_pass
from ...options import option
from ...registry import register
from .model_pass import reconstruct
from .ops import reconstruction_attend, reconstruction_scores, value_output_norms, window_max_scores


@dataclasses.dataclass
class KVzipOptions:
    # Sec. 3 (chunked scoring): the context is reconstructed in chunks of 2K tokens (bounded memory).
    chunk: int = option(2048, low=1, small=24, doc="context tokens reconstructed per forward of the pass")
    overlap: int = option(8, low=0, doc="previous chunk's last tokens quoted in the next repeat prompt")
    # 128, not 512: the same scores and time at a quarter of the scoring scratch (docs/methods/kvzip.md)
    q_block: int = option(128, low=1, doc="reconstruction queries per scoring sub-block (bounds memory)")
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
class KVzip(Method):
    """KVzip: rows scored by the max attention of the model's reconstruction of its context."""

    Options = KVzipOptions
    # Sec. 3 (non-uniform head budgets): one ranking of every head's rows, no per-head floor. The cap
    # (2 x the layer's share in one head) is ours: storage is as wide as the widest head.
    config_defaults = {"allocation": "ada", "floor_alpha": 0.0, "max_head_factor": 2.0}
    prefill_only = True
    needs = Needs(window="window", model_pass=True, token_ids=True)  # (the window is the fallback's)
    model_pass_note = "KVzip's reconstruction pass"  # what `compress`'s progress bar says runs at the end
    compresses_in_model_pass = True  # the prompt-end compression runs after the forward (recall_hold refuses it)
    row_fields = {"zip_score": 0.0, "zip_ids": -1.0}  # a row's reconstruction score and its token id
    state_fields = ("scored", "passes", "ids_known")

    def __init__(self, config, layer=0, n_layers=1):
        super().__init__(config, layer, n_layers)
        self.scored = 0  # positions < scored carry a reconstruction score
        self.passes = 0  # reconstruction passes run over this layer
        self.ids_known = True  # every row since ``scored`` has its token id
        self.chunk = None  # (first row, end row, sink rows) while a reconstruction chunk is read
        self.parts = []  # per-chunk scores of the pass in progress
        self.plus = None  # KVzip+: (1 / ||h|| of the chunk's queries, the attention's W_o), set per chunk
        self.layer_shares = "zip_score" if self.options.layers == "global" else None

    def scores(self, view):
        return view.field("zip_score")

    def wants_pass(self, view, ending, due) -> bool:
        # text arrived since the last pass; "global": a layer below its own budget may still give rows away
        return view.offset > self.scored and (due or (
            ending and self.layer_shares is not None and view.offset > view.budget))

    rows_from_inputs = True  # a row's field is its own token id

    def on_rows(self, view, step):
        if self.chunk is not None:  # a reconstruction chunk reading the rows
            return self._score_chunk(view, step)
        ids = step.ids
        if ids is None or ids.shape[1] != step.rows:
            self.ids_known = False
            return {"zip_ids": mx.full((1, 1, step.rows), -1.0)}
        return {"zip_ids": mx.expand_dims(ids.astype(mx.float32), 1)}

    @classmethod
    def model_pass(cls, driver, seq):
        """The reconstruction of the text since the last pass (``methods/kvzip/model_pass.py``); without the
        model, or without every row's token id, the fallback."""
        zips = [c for c, _ in seq if getattr(c, "pass_due", False)]
        if driver is None or not all(z.method.ids_known for z in zips):
            return [z.method.fallback(z.view) for z in zips]
        return reconstruct(driver, seq, zips)

    def fallback(self, view) -> dict:
        """No model pass possible: the last prompt queries' max attention scores the rows since the last pass."""
        q, q_pos, scale = view.window()
        r, n = view.rows, view.offset - self.scored
        s = window_max_scores(q, view.keys[:, :, r - n:r], q_pos, view.positions[:, :, r - n:r], scale)
        return self.finish(view, [s])

    def finish(self, view, parts: list) -> dict:
        """The scores of the rows since the last pass, as per-row fields of the newest rows."""
        self.scored, self.ids_known, self.parts = view.offset, True, []
        if not parts:
            return {}
        return {"zip_score": parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)}

    # -- a reconstruction chunk (the cache's reading(): the forward's own rows are never stored) ------
    def begin_chunk(self, view, lo: int, hi: int) -> None:
        """The next forward reconstructs pending tokens [lo, hi): its queries score the rows of those tokens."""
        base = view.rows - (view.offset - self.scored)
        self.chunk, self.plus = (base + lo, base + hi, min(self.config.n_sink, base + lo)), None

    def observe_hidden(self, hidden: mx.array, o_weight: mx.array) -> None:
        """KVzip+: the attention module's input (B, S, hidden) of this chunk and its output projection
        weight (hidden, query heads * head_dim); the model pass's hook calls it before the attention runs."""
        if self.chunk is not None:
            inv = mx.rsqrt(mx.maximum(mx.square(hidden.astype(mx.float32)).sum(axis=-1), 1e-30))
            self.plus = (inv, o_weight)

    def _score_chunk(self, view, step):
        # the step attends to the stored rows, then its own (the last S, never stored)
        (lo, hi, lead), q, S = self.chunk, step.queries, step.queries.shape[2]
        keys, values = step.keys, step.values
        own_k, own_v = keys[:, :, -S:], values[:, :, -S:]
        plus = self._plus_weights(values, lo, hi, lead, q.shape[1])
        if (step.attend and one_pass(self.options.pass_attention) and lead == 0 and lo == 0
                and hi == keys.shape[2] - S and not view.ragged):  # the chunk's rows are every stored row: one softmax
            out, s = reconstruction_attend(q, keys[:, :, lo:hi], own_k, values[:, :, lo:hi], own_v, step.scale,
                                           self.options.q_block, plus)
            self.parts.append(s)
            return {"zip_score": s}, out
        ctx = keys[:, :, lo:hi] if not lead else mx.concatenate([keys[:, :, :lead], keys[:, :, lo:hi]], axis=2)
        self.parts.append(reconstruction_scores(q, ctx, own_k, step.scale, lead, self.options.q_block, plus))
        return {"zip_score": self.parts[-1]}  # (not stored: evaluated with the layer's output)

    def _plus_weights(self, values, lo, hi, lead, n_heads):
        """KVzip+'s (1 / ||h||, ||W_o v|| of the sink rows then rows lo:hi), or None for plain KVzip."""
        if self.options.normalize != "plus":
            return None
        if self.plus is None:
            raise RuntimeError("kvzip normalize='plus' needs the attention inputs of the pass: build the caches "
                               "with KVCacheBuilder.for_model / install on a model whose layers have self_attn.o_proj")
        inv_h, o_weight = self.plus
        vals = values[:, :, lo:hi] if not lead else mx.concatenate([values[:, :, :lead], values[:, :, lo:hi]], axis=2)
        return inv_h, value_output_norms(vals, o_weight, n_heads)
