"""The Method protocol: an eviction rule, outside the cache.

A method says which stored rows to keep; the cache (``caches.cache.EvictionCache``) stores them, decides
when to evict, and hands the method a read-only :class:`~veloxquant_mlx.caches.view.View` of what it may
read. A method implements one of

* ``scores(view)``: a (B, H, rows) importance of the stored rows, higher kept; the configured allocation
  (``caches.allocation``) turns it into rows (uniform top-k per head, or Ada-KV's head budgets), or
* ``select(view, keep, allocation)``: its own selection of ``keep`` rows per head: row indices
  (B, H, K), or (indices, real) where ``real`` marks the real rows of ragged heads,

and optionally ``on_rows(view, step)``, the per-row state it keeps (``row_fields``) updated at every step,
the light decode step included. What a method needs from the model is declared (:class:`Needs`), never
probed; which allocations it supports is declared (``allocations``), and the config reads it.
"""

from __future__ import annotations

import dataclasses

from ..options import NoOptions
from .allocation import AdaRows, Uniform


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a method reads beyond the stored rows, so the builder installs it (nothing is probed)."""

    queries: bool = True  # the query tap's post-RoPE queries (False: key-only or position-only rules)
    window: int | str = 0  # recent queries kept for scores(): a number, or the name of the option holding it
    hidden_states: bool = False  # each step's attention input (step.hidden): the builder's hidden-state tap
    model_pass: bool = False  # prompt-time compressions may run after the forward, with the model at hand
    token_ids: bool = False  # each step's token ids (step.ids), which the model-pass wrapper feeds

    def window_of(self, options) -> int:
        return getattr(options, self.window) if isinstance(self.window, str) else self.window


class Method:
    """Base of every eviction method: the protocol's defaults (module docstring)."""

    # -- what a method declares ---------------------------------------------------------------------
    Options = NoOptions
    name: str = ""  # set by ``registry.register``
    needs = Needs()
    prefill_only = False  # True: compress once when the prompt ends, then only append
    # config.allocation -> the strategy this method runs it with (caches.allocation); the config refuses others
    allocations: dict = {"uniform": Uniform, "ada": AdaRows}
    row_fields: dict = {}  # per-row state, name -> value of a new row; moves with its row, saved with the cache
    state_fields: tuple = ()  # attributes of the method saved with the cache (small JSON values)
    config_defaults: dict = {}  # KVCacheConfig head-budget fields this method defaults differently
    supports_kv_bits = True  # can the kept rows be stored quantized (config.kv_bits)?

    def __init__(self, config, layer: int = 0, n_layers: int = 1):
        self.config, self.options, self.layer, self.n_layers = config, config.options, layer, n_layers

    # -- the rule ------------------------------------------------------------------------------------
    def scores(self, view):
        """(B, H, rows) importance of every stored row; higher is kept."""
        raise NotImplementedError(f"{type(self).__name__} implements neither scores() nor select()")

    def select(self, view, keep: int, allocation):
        """Rows to keep, ``keep`` per head: (B, H, K) indices, or (indices, real) for ragged heads."""
        return allocation.rows(view, self.scores(view), keep)

    # on_rows(view, step) -> {field: values of the last n stored rows} (or (fields, output) when
    # step.attend and the method computed the layer's attention output): defined by methods with per-row state
    on_rows = None
    # True where on_rows reads only step.hidden and step.ids, one row at a time (kvzap, kvzip): the cache may
    # then call it once for the rows of several decode steps, when they are next read
    rows_from_inputs = False
    # The per-row field on_rows adds each query's attention mass to (H2O): the paged prompt sums it over the
    # rows in its file (caches.pages), in place of on_rows.
    attention_mass_field: str | None = None

    # -- configuration (read by KVCacheConfig before any cache exists) ------------------------------
    @classmethod
    def default_recent(cls, budget: int, options) -> int:
        """The recent window kept when the config leaves ``recent`` unset."""
        return min(32, max(budget // 8, 1))

    @classmethod
    def supports_allocation(cls, allocation: str) -> bool:
        return allocation in cls.allocations

    @classmethod
    def check_config(cls, config) -> None:
        """Cross-field validation (raise ValueError)."""

    def layer_budget(self) -> int:
        """Rows per KV head this layer keeps (PyramidKV varies it by layer)."""
        return self.config.budget

    def slack(self) -> int:
        """Rows allowed above the budget before an eviction runs: the ``evict_every`` option, else 32."""
        return getattr(self.options, "evict_every", None) or 32

    # -- the model (Needs.hidden_states, Needs.model_pass) --------------------------------------------
    compresses_in_model_pass = False  # the prompt-end compression runs in the model pass (recall_hold refuses it)
    model_pass_note = ""  # what runs in the model pass, for a progress bar
    layer_shares: str | None = None  # the per-row field one ranking across layers reads after the model pass

    @classmethod
    def attach(cls, model, methods: list) -> None:
        """The model, once the builder made this method's caches (``methods``: their Method instances)."""

    def wants_pass(self, view, ending: bool, due: bool) -> bool:
        """Does this prompt-time compression run through the model pass after the forward (``Needs.model_pass``)?
        ``ending``: at the prompt's end, else after a streamed chunk; ``due``: the cache compresses now anyway
        (over the budget at the end, over its eviction threshold after a chunk)."""
        return False

    @classmethod
    def model_pass(cls, driver, seq: list):
        """The pass itself, after the forward (``caches.passes``): ``seq`` is one sequence's per-layer (cache,
        batch index or None) pairs, ``driver`` the glue's ModelPassDriver (None: no model at hand). Returns,
        per cache whose compression waited, the per-row fields of its newest rows to set first (or None)."""
        return None
