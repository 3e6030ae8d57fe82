"""KVzap (Jégou and Jeblick, arXiv 2601.07891): a learned, query-agnostic row score.

A tiny per-layer surrogate, fitted offline, maps each token's hidden state (the attention module's
input ``x``) to one score per KV head that predicts the log of its KVzip+ score (KVzip's max
reconstruction attention, normalised by the query's hidden-state norm and scaled by ||W_o v||; the
paper regresses log-scores): linear, ``s = x W + b`` with W (d_model, H_kv), or the paper's 2-layer MLP,
``s = gelu(x W1 + b1) W + b``. Every incoming row
is scored as it is stored, in the prompt and in decode, so the method evicts during decode too; the
prompt is compressed once at its end (``prompt_eviction="end"``) with no extra model pass.

The hidden states reach the method through the hidden-state tap (``veloxquant_mlx.tap``), which the
builder installs for ``Needs.hidden_states``. The builder also calls :meth:`KVzap.attach`,
which finds the scorer (the ``scorer`` option, else a fitted file whose model identity matches, see
:func:`find_scorer`) and checks that it was fitted for this model. ``python -m veloxquant_mlx fit-kvzap``
fits one (``methods/kvzap/fit.py`` holds the regression).
"""

from __future__ import annotations

import dataclasses
import warnings

import mlx.core as mx
import mlx.nn as nn

from ...caches.method import Method, Needs
from ...options import evict_every, option
from ...registry import register
from .scorer import SCORER_PATH_ENV, describe, find_scorer, load_scorer, model_identity

# Sec. 3 (pruning rule): a sliding window of the most recent tokens is always kept, w = 128.
PAPER_WINDOW = 128


@dataclasses.dataclass
class KVzapOptions:
    scorer: str = option("", doc="scorer file (safetensors from fit-kvzap); empty: the fitted file for this model")
    evict_every: int = evict_every()
    # "each": every layer keeps ``budget`` rows per head. "global": at a prompt's end one ranking of every
    # layer's predicted log KVzip+ scores decides each layer's share (KVzip's non-uniform layer budget,
    # KVzip Sec. 3; the surrogates regress one target scale, so their predictions compare across layers),
    # and decode keeps each layer at its share. The total stays layers x heads x budget. Under
    # prompt_eviction="stream" the ranking runs after every prompt chunk's forward instead: scores are
    # fixed when a row arrives, so a row in the whole prompt's top set is in the top set of every chunk
    # that holds it (docs/methods/kvzap.md, "Streaming"). "auto" (default) is "global" in both modes,
    # measured best on the paired passkey grids of two models (docs/methods/kvzap.md).
    # Tiny test shapes (small=) keep "each": the generic per-layer contract tests; test_kvzap tests the rest.
    layers: str = option("auto", choices=("auto", "each", "global"), small="each",
                         doc="budget across layers: auto (= global) | each | global")


def _score(x, w, b):
    # (B, S, d_model) hidden states -> (B, H_kv, S) predicted log KVzip+ scores: one small matmul with its bias
    # (w is (1, d_model, H_kv) and b (1, 1, H_kv): a decode step's shapes, so nothing is broadcast)
    return mx.addmm(b, x.astype(mx.float32), w).swapaxes(-1, -2)


def _score_mlp(x, w1, b1, w, b):
    # the 2-layer MLP surrogate (paper Sec. 3): GELU between the two projections
    return mx.addmm(b, nn.gelu(mx.addmm(b1, x.astype(mx.float32), w1)), w).swapaxes(-1, -2)


# not shapeless: addmm's bias broadcast is traced for one row count (a trace per prefill chunk size)
_score_compiled = {2: mx.compile(_score), 4: mx.compile(_score_mlp)}
_warned: set = set()


@register("kvzap")
class KVzap(Method):
    """KVzap: rows scored as they arrive by a fitted map (linear or MLP) of their hidden state (KVzip+ surrogate)."""

    Options = KVzapOptions
    # Paper Sec. 3 prunes every (token, head) pair below one threshold: no per-head floor. So kvzip's head
    # budgets: one ranking of a layer's heads, floor 0, and the library's storage cap of 2x a head's share
    # (measured against the Ada-KV reference floor 0.2 and cap 1.1 in docs/methods/kvzap.md).
    config_defaults = {"allocation": "ada", "floor_alpha": 0.0, "max_head_factor": 2.0}
    # the hidden-state tap; the model pass: layers="global" ranks every layer's rows after the forward
    needs = Needs(queries=False, hidden_states=True, model_pass=True)
    row_fields = {"zap_score": 0.0}  # every row's predicted log KVzip+ score
    state_fields = ("scorer", "sha256")  # the scorer travels by path and hash

    @classmethod
    def default_recent(cls, budget, options):
        # The paper's window, capped at half the budget so the scorer still picks at small budgets.
        return min(PAPER_WINDOW, max(budget // 2, 1))

    def __init__(self, config, layer=0, n_layers=1):
        super().__init__(config, layer, n_layers)
        self._scorer = self._sha = None  # the scorer file in use and its sha256
        self._weights = self._local = None  # (W (d_model, H_kv of the whole model), b); this rank's, batched for a step
        self.layer_shares = "zap_score" if self.options.layers in ("global", "auto") else None

    def scores(self, view):
        return view.field("zap_score")

    rows_from_inputs = True  # a row's score is a function of its own hidden state

    def on_rows(self, view, step):
        """Every new row's predicted score, from the step's hidden states (Sec. 3: the surrogate)."""
        x, S = step.hidden, step.rows
        if self._weights is None or x is None:
            return {"zap_score": self._unscored(view, S)}
        if x.shape[1] != S:
            raise ValueError(f"kvzap: hidden states {tuple(x.shape)} do not match {S} new rows")
        if self._local is None:  # batched as a decode step's (1, 1, d_model) hidden state: it broadcasts nothing
            self._local = tuple(a.reshape(1, *(a.shape if a.ndim == 2 else (1, -1)))
                                for a in self._layer_weights(view.positions.shape[1], view.shard))
        return {"zap_score": _score_compiled[len(self._local)](x, *self._local)}

    def wants_pass(self, view, ending, due) -> bool:
        # layers="global": one ranking of every layer's rows at the prompt's end, and, streaming, after every
        # chunk once the prompt passes budget + slack (a row's score is fixed when it arrives)
        return self.layer_shares is not None and view.offset > view.budget + (0 if ending else self.slack())

    # -- the scorer ------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model, methods: list) -> None:
        """Give every kvzap layer of ``model`` its scorer: the ``scorer`` option's file, else the fitted file of
        this model's identity. Clear errors otherwise."""
        if not methods:
            return
        ident = model_identity(model)
        path = methods[0].options.scorer or find_scorer(ident)
        if path is None:
            raise ValueError(
                f"kvzap: no fitted scorer for this model ({describe(ident)}): fit one with `python -m "
                "veloxquant_mlx fit-kvzap --model NAME --out FILE` and pass kvzap_scorer=FILE (spec "
                f"kvzap:scorer=FILE), or put FILE in a folder named by ${SCORER_PATH_ENV}")
        meta = load_scorer(path)[1]
        if meta["identity"] != ident:
            raise ValueError(f"kvzap scorer {str(path)!r} was fitted for {describe(meta['identity'])}, "
                             f"not this model ({describe(ident)})")
        for m in methods:
            m.scorer = path

    @property
    def scorer(self):
        """Path of the scorer file in use (None: none yet); setting it loads this layer's weights."""
        return self._scorer

    @scorer.setter
    def scorer(self, path) -> None:
        if path is None:
            return
        weights, meta, self._sha = load_scorer(path)
        if self.layer not in weights:
            raise ValueError(f"kvzap scorer {str(path)!r} has no weights for layer {self.layer} "
                             f"(fitted layers: {meta['layers']})")
        self._weights, self._local, self._scorer = weights[self.layer], None, str(path)

    @property
    def sha256(self):
        return self._sha

    @sha256.setter
    def sha256(self, sha) -> None:  # restored after the scorer: it must be the file the cache was saved with
        if sha is not None and self._sha is not None and sha != self._sha:
            raise ValueError(f"kvzap scorer {self._scorer!r} changed since this cache was saved "
                             f"(sha256 {self._sha}, saved with {sha})")

    def _layer_weights(self, n_local: int, shard):
        """This layer's (hidden..., W, b), W's columns those of this rank's ``n_local`` KV heads."""
        *hidden, w, b = self._weights  # (an MLP's first layer is shared by every head)
        if w.shape[1] != (n_local if shard is None else shard.total_heads(n_local)):
            raise ValueError(f"kvzap scorer has {w.shape[1]} KV heads for layer {self.layer}, the cache holds "
                             f"{n_local}")
        if shard is not None:  # tensor parallel: this rank's head columns
            w, b = shard.local(w, n_local, axis=1), shard.local(b, n_local, axis=0)
        return (*hidden, w, b)

    def _unscored(self, view, S):
        """No scorer or no hidden state: a cache built without the builder ranks rows by recency (a
        StreamingLLM window, warned once); a scorer without the tap is an error."""
        if self._weights is not None:
            raise RuntimeError("kvzap has a scorer but received no hidden states: build the caches with "
                               "KVCacheBuilder.for_model / install (they install the hidden-state tap)")
        if "direct" not in _warned:
            _warned.add("direct")
            warnings.warn("kvzap cache without a scorer (built without KVCacheBuilder): rows are ranked by "
                          "recency instead", stacklevel=5)
        return view.positions[:, :, -S:].astype(mx.float32)
