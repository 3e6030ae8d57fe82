"""KVzap (Jégou and Jeblick, arXiv 2601.07891): a learned, query-agnostic row score.

A tiny per-layer surrogate, fitted offline, maps each token's hidden state (the attention module's
input ``x``) to one score per KV head that predicts the log of its KVzip+ score (KVzip's max
reconstruction attention, normalised by the query's hidden-state norm and scaled by ||W_o v||; the
paper regresses log-scores): linear, ``s = x W + b`` with W (d_model, H_kv), or the paper's 2-layer MLP,
``s = gelu(x W1 + b1) W + b``. Every incoming row
is scored as it is stored, in the prompt and in decode, so the method evicts during decode too; the
prompt is compressed once at its end (``prompt_eviction="end"``) with no extra model pass.

The hidden states reach the cache through the hidden-state tap (``veloxquant_mlx.tap``), which the
builder installs for ``needs_hidden_states``. The builder also calls :meth:`KVzapCache.attach_model`,
which finds the scorer (the ``scorer`` option, else a fitted file whose model identity matches, see
:func:`find_scorer`) and checks that it was fitted for this model. ``python -m veloxquant_mlx fit-kvzap``
fits one (``methods/kvzap/fit.py`` holds the regression).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from ...caches import forward
from ...caches.base import EvictionCache
from ...caches.layer_shares import global_layer_shares
from ...model_dims import model_dims
from ...options import option
from ...registry import register

SCORER_FORMAT = "veloxquant-kvzap-scorer/1"
SHIPPED_DIR = Path(__file__).resolve().parent / "scorers"
# Extra folders searched for fitted scorers by identity (os.pathsep-separated), before the shipped ones.
SCORER_PATH_ENV = "VELOXQUANT_KVZAP_PATH"
# Sec. 3 (pruning rule): a sliding window of the most recent tokens is always kept, w = 128.
PAPER_WINDOW = 128


@dataclasses.dataclass
class KVzapOptions:
    scorer: str = option("", doc="scorer file (safetensors from fit-kvzap); empty: the fitted file for this model")
    evict_every: int = option(32, low=1, small=4, doc="amortization slack: evict once this many extra rows exist")
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


# -- model identity ------------------------------------------------------------------------------------
def model_identity(model) -> dict:
    """What a scorer is fitted for: architecture and shapes from ``model.args``, plus a hash of a few
    weight tensors (the embedding's first rows and every norm weight, which tensor parallelism does not
    shard), so two models of the same shape differ."""
    from mlx.utils import tree_flatten

    dims = model_dims(model)  # nested text_config and every field spelling; one-line ValueError otherwise
    ident = {"architecture": dims.model_type, "n_layers": dims.n_layers, "d_model": dims.d_model,
             "n_kv_heads": dims.n_kv_heads, "head_dim": dims.head_dim}
    h = hashlib.sha256()
    for name, w in sorted(tree_flatten(model.parameters())):
        if name.endswith("embed_tokens.weight"):
            w = w[:16]
        elif not name.endswith("norm.weight"):
            continue
        h.update(name.encode())
        h.update(memoryview(_host_bytes(w)))
    ident["weights_sha256"] = h.hexdigest()[:16]
    return ident


def _host_bytes(w):
    import numpy as np

    return np.ascontiguousarray(np.array(w.astype(mx.float32) if w.dtype == mx.bfloat16 else w)).tobytes()


def _describe(ident: dict) -> str:
    return (f"{ident.get('architecture')} L={ident.get('n_layers')} d={ident.get('d_model')} "
            f"H_kv={ident.get('n_kv_heads')} head_dim={ident.get('head_dim')} weights={ident.get('weights_sha256')}")


# -- scorer files ----------------------------------------------------------------------------------------
def save_scorer(path, weights: dict, identity: dict, fit: dict, provenance: dict, quality: dict) -> None:
    """Write a scorer: ``weights`` {layer index: (W (d_model, H_kv), b (H_kv,))} for a linear one, or
    (W1 (d_model, hidden), b1 (hidden,), W (hidden, H_kv), b (H_kv,)) for an MLP, plus its metadata.
    The last two are always the output layer (the per-head columns tensor parallelism slices)."""
    arrays = {}
    for i, params in sorted(weights.items()):
        if len(params) not in (2, 4):
            raise ValueError(f"layer {i}: a scorer layer is (W, b) or (W1, b1, W, b), got {len(params)} arrays")
        names = ("W", "b") if len(params) == 2 else ("W1", "b1", "W", "b")
        for name, a in zip(names, params):
            arrays[f"{name}.{i}"] = mx.array(a, dtype=mx.float32)
    meta = {"format": SCORER_FORMAT, "identity": identity, "fit": fit, "provenance": provenance,
            "quality": quality, "layers": sorted(weights)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata={k: json.dumps(v, sort_keys=True) for k, v in meta.items()})
    os.replace(tmp, path)


_LOADED: dict = {}


def read_scorer_metadata(path) -> dict:
    """The scorer file's metadata (identity, fit, provenance, quality, layers); raises for other files."""
    return load_scorer(path)[1]


def load_scorer(path):
    """(weights {layer: (W, b)}, metadata, sha256 of the file), cached per (path, mtime, size)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"kvzap scorer {str(path)!r} is not a file")
    st = p.stat()
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    if key not in _LOADED:
        arrays, raw = mx.load(str(p), return_metadata=True)
        if raw.get("format") != json.dumps(SCORER_FORMAT):
            raise ValueError(f"{str(path)!r} is not a kvzap scorer (format {raw.get('format')!r}, "
                             f"expected {SCORER_FORMAT!r}); fit one with `python -m veloxquant_mlx fit-kvzap`")
        meta = {k: json.loads(v) for k, v in raw.items()}
        weights = {int(i): ((arrays[f"W1.{i}"], arrays[f"b1.{i}"]) if f"W1.{i}" in arrays else ())
                   + (arrays[f"W.{i}"], arrays[f"b.{i}"]) for i in meta["layers"]}
        sha = hashlib.sha256(p.read_bytes()).hexdigest()[:16]
        _LOADED[key] = (weights, meta, sha)
    return _LOADED[key]


def _search_dirs() -> list:
    extra = [Path(d) for d in os.environ.get(SCORER_PATH_ENV, "").split(os.pathsep) if d]
    return extra + [SHIPPED_DIR]


def find_scorer(identity: dict):
    """The first scorer file in $VELOXQUANT_KVZAP_PATH's folders, then the shipped ones, fitted for a
    model of this identity; None when there is none."""
    for folder in _search_dirs():
        for f in sorted(folder.glob("*.safetensors")) if folder.is_dir() else ():
            try:
                if load_scorer(f)[1]["identity"] == identity:
                    return f
            except (ValueError, KeyError, OSError):
                continue
    return None


def _score(x, w, b):
    # (B, S, d_model) hidden states -> (B, H_kv, S) predicted log KVzip+ scores: one small matmul
    return (x.astype(mx.float32) @ w + b).swapaxes(-1, -2)


def _score_mlp(x, w1, b1, w, b):
    # the 2-layer MLP surrogate (paper Sec. 3): GELU between the two projections
    return (nn.gelu(x.astype(mx.float32) @ w1 + b1) @ w + b).swapaxes(-1, -2)


_score_compiled = {2: mx.compile(_score, shapeless=True), 4: mx.compile(_score_mlp, shapeless=True)}
_warned: set = set()


@register("kvzap")
class KVzapCache(EvictionCache):
    """KVzap: rows scored as they arrive by a fitted map (linear or MLP) of their hidden state (KVzip+ surrogate)."""

    Options = KVzapOptions
    # Paper Sec. 3 prunes every (token, head) pair below one threshold: no per-head floor. So kvzip's head
    # budgets: one ranking of a layer's heads, floor 0, and the library's storage cap of 2x a head's share
    # (measured against the Ada-KV reference floor 0.2 and cap 1.1 in docs/methods/kvzap.md).
    config_defaults = {"allocation": "ada", "floor_alpha": 0.0, "max_head_factor": 2.0}
    needs_queries = False
    needs_hidden_states = True  # the builder installs the hidden-state tap (veloxquant_mlx.tap)
    needs_model_pass = True  # layers="global": the prompt-end compression waits for every layer's scores

    @classmethod
    def default_recent(cls, budget, options):
        # The paper's window, capped at half the budget so the scorer still picks at small budgets.
        return min(PAPER_WINDOW, max(budget // 2, 1))

    def __init__(self, config, layer_idx=0, n_layers=1):
        super().__init__(config, layer_idx, n_layers)
        self._hidden = None  # this step's attention input, from the hidden-state tap
        self._weights = None  # (W (d_model, H_kv of the whole model), b), set by attach_model / on load
        self._local = None  # the same, sliced to this rank's heads
        self.scorer_file = None  # (path, sha256) of the scorer in use
        self.layer_share = None  # layers="global": this layer's rows per head since a prompt's end
        self._share_due = False  # layers="global": compression deferred to after the forward
        self._ranking_possible = True  # False once a forward ran without the builder's model wrapper

    def extra_row_fields(self):
        return {"zap_score": 0.0}

    rows_written_on_append = ("zap_score",)  # _append scores every new row

    def scores(self):
        return self.stored("zap_score")

    # -- the scorer ------------------------------------------------------------------------------------
    @classmethod
    def attach_model(cls, model, caches: list) -> None:
        """Give every kvzap cache of ``model`` its layer's scorer (called by the builder): the ``scorer``
        option's file, else the fitted file of this model's identity. Clear errors otherwise."""
        if not caches:
            return
        ident = model_identity(model)
        path = caches[0].options.scorer or find_scorer(ident)
        if path is None:
            raise ValueError(
                f"kvzap: no fitted scorer for this model ({_describe(ident)}): fit one with `python -m "
                "veloxquant_mlx fit-kvzap --model NAME --out FILE` and pass kvzap_scorer=FILE (spec "
                f"kvzap:scorer=FILE), or put FILE in a folder named by ${SCORER_PATH_ENV}")
        meta = load_scorer(path)[1]
        if meta["identity"] != ident:
            raise ValueError(f"kvzap scorer {str(path)!r} was fitted for {_describe(meta['identity'])}, "
                             f"not this model ({_describe(ident)})")
        for c in caches:
            c.use_scorer(path)

    def use_scorer(self, path) -> None:
        weights, meta, sha = load_scorer(path)
        if self.layer_idx not in weights:
            raise ValueError(f"kvzap scorer {str(path)!r} has no weights for layer {self.layer_idx} "
                             f"(fitted layers: {meta['layers']})")
        self._weights, self._local = weights[self.layer_idx], None
        self.scorer_file = (str(path), sha)

    def observe_attention_input(self, x, module=None) -> None:
        """The hidden-state tap: this step's attention input (B, S, d_model), before update_and_fetch."""
        self._hidden = x

    def _layer_weights(self, n_local: int):
        if self._local is None:
            *hidden, w, b = self._weights  # (an MLP's first layer is shared by every head)
            if w.shape[1] != (n_local if self.dist is None else self.dist.total_heads(n_local)):
                raise ValueError(f"kvzap scorer has {w.shape[1]} KV heads for layer {self.layer_idx}, the "
                                 f"cache holds {n_local}")
            if self.dist is not None:  # tensor parallel: this rank's head columns
                w, b = self.dist.local(w, n_local, axis=1), self.dist.local(b, n_local, axis=0)
            self._local = (*hidden, w, b)
        return self._local

    def _append(self, keys, values):
        prev = self._rows
        super()._append(keys, values)
        self._score_rows(prev, keys.shape)

    def _score_rows(self, prev, shape):
        """Score the rows ``prev .. prev + S`` just appended (``shape``: their keys' (B, H, S, D))."""
        S = shape[2]
        x, self._hidden = self._hidden, None  # a row of a batch gets its own slice (caches.batch)
        if self._weights is None or x is None:
            s = self._unscored(prev, S)
        else:
            if x.shape[1] != S or x.shape[0] != shape[0]:
                raise ValueError(f"kvzap: hidden states {tuple(x.shape)} do not match {S} new rows of "
                                 f"{shape[0]} sequences")
            params = self._layer_weights(shape[1])
            s = _score_compiled[len(params)](x, *params)
        self.row_extras["zap_score"][:, :, prev:prev + S] = s
        if (self._streams_globally(S) and self._ranking_possible and not self._share_due
                and self.offset > self.budget + self.slack):
            self._defer_ranking()

    def refresh_light(self):
        super().refresh_light()
        params = self._local
        self._light_score = None if params is None else (len(params), params)  # (no function: caches are copied)

    def on_light_append(self, row):
        """_score_rows of the light step's one row, once the full path has checked the scorer and its heads."""
        x, light = self._hidden, self._light_score
        if light is None or x is None or x.shape[:2] != (self._light_k[0], 1):
            return self._score_rows(row, self._light_k)  # its checks and errors
        self._hidden = None
        n, params = light
        self.row_extras["zap_score"][:, :, row:row + 1] = _score_compiled[n](x, *params)

    def _unscored(self, prev, S):
        """No scorer or no hidden state: a cache built without the builder ranks rows by recency (a
        StreamingLLM window, warned once); a scorer without the tap is an error."""
        if self._weights is not None:
            raise RuntimeError("kvzap has a scorer but received no hidden states: build the caches with "
                               "KVCacheBuilder.for_model / install (they install the hidden-state tap)")
        if "direct" not in _warned:
            _warned.add("direct")
            warnings.warn("kvzap cache without a scorer (built without KVCacheBuilder): rows are ranked by "
                          "recency instead", stacklevel=4)
        return self.positions[:, :, prev:prev + S].astype(mx.float32)

    # -- layers="global": one ranking across layers at each prompt's end -------------------------------
    @property
    def global_layers(self) -> bool:
        """Does one ranking of every layer's rows split the budget (layers "global" or "auto")?"""
        return self.options.layers in ("global", "auto")

    def _streams_globally(self, S: int) -> bool:
        """A prompt chunk under prompt_eviction="stream" with one ranking across layers: the chunk's
        eviction waits for the forward's end, when every layer holds its rows (run_model_pass)."""
        return S > 1 and self.global_layers and self.config.prompt_eviction == "stream"

    def evict_threshold(self) -> int:
        if self._share_due:  # this forward's eviction is the ranking after it (run_model_pass)
            return self._rows + 1
        return super().evict_threshold()

    def _defer_ranking(self) -> None:
        """Ask for the ranking across layers after this forward; without the builder's model wrapper
        each layer evicts on its own (warned once)."""
        if forward.defer(self):
            self._share_due = True
            return
        self._ranking_possible = False
        if "no pass" not in _warned:
            _warned.add("no pass")
            warnings.warn("kvzap layers='global' needs the caches built by KVCacheBuilder (its model "
                          "wrapper runs the ranking after the forward): each layer keeps its own budget",
                          stacklevel=5)

    def keep_rows(self) -> int:
        # The layer's share sizes the decode threshold and the buffers too (base evict_threshold and
        # headroom_after_eviction read keep_rows), so a layer kept below the budget holds no budget-wide rows.
        if self.layer_share is None or self.prompt.target is not None:
            return super().keep_rows()  # the budget, or a compression's target
        return self.layer_share

    def _end_prompt(self):
        if self.global_layers and self.offset > self.budget and not self._holds_recall():
            self._defer_ranking()  # after the forward, with every layer's rows: run_model_pass
            if self._share_due:
                self.prompt.ending = False
                return
        super()._end_prompt()

    @classmethod
    def run_model_pass(cls, driver, seq):
        """After the forward whose prompt end (or, streaming, whose prompt chunk) every kvzap layer of
        this sequence deferred: one ranking of all their rows, then each compresses to its share (no
        model pass runs)."""
        due = [c for c, _ in seq if isinstance(c, cls) and c._share_due]
        if not due:
            return
        shares = global_layer_shares(due, "zap_score", "kvzap")
        for i, c in enumerate(due):
            c._share_due = False
            c.layer_share = None if shares is None else shares[i]
            c._light_rows = 0  # its eviction threshold moved: the next step is a full one
            if c._rows > c.keep_rows():
                with c.prompt.compressing_to(c.layer_share):
                    c._evict()

    # -- save / load: the scorer travels by path and hash ----------------------------------------------
    @property
    def meta_state(self):
        meta = json.loads(EvictionCache.meta_state.fget(self))
        if self.scorer_file is not None:
            meta["kvzap"] = {"scorer": self.scorer_file[0], "sha256": self.scorer_file[1]}
        if self.layer_share is not None:
            meta["kvzap_layer_share"] = self.layer_share
        return json.dumps(meta, sort_keys=True)

    @meta_state.setter
    def meta_state(self, text):
        EvictionCache.meta_state.fset(self, text)
        meta = json.loads(text)
        self.layer_share = meta.get("kvzap_layer_share")
        z = meta.get("kvzap")
        if z:
            self.use_scorer(z["scorer"])
            if self.scorer_file[1] != z["sha256"]:
                raise ValueError(f"kvzap scorer {z['scorer']!r} changed since this cache was saved "
                                 f"(sha256 {self.scorer_file[1]}, saved with {z['sha256']})")
