"""The evaluation's method labels: a plain ``{label: spec}`` table in the config grammar
(:mod:`veloxquant_mlx.config_spec`), plus label suffixes that add fields to any label.

Published figures are keyed by label, so a label keeps meaning exactly what its cells ran
(tests/test_labels.py pins every label against what it resolved to before this table existed).

* ``full``: mlx-lm's KVCache (``full-4bit``: its QuantizedKVCache); ``rotating``: mlx-lm's
  RotatingKVCache(max_size=budget), what ``mlx_lm.generate --max-kv-size`` gives.
* every registered method is a label of its own name, with its defaults.
* ``<label><suffix>...``: each suffix in :data:`SUFFIXES` adds its fields, a later one overriding an
  earlier one (``nexus-4bit-g32``: 4-bit rows in groups of 32).
* a spec string (``nexus:window=8,kv_bits=4``) is a label of its own.
"""

from __future__ import annotations

import dataclasses
import functools

from ..builder import KVCacheBuilder
from ..caches.quant import model_caches
from ..config import KVCacheConfig, parse_full
from ..config_spec import format_spec, parse_spec
from ..registry import FULL, get_method, methods

ROTATING = "rotating"
PROBE_BUDGET = 512  # a label's fields are checked at this budget before any run

# Run next to every registry method by default: Nexus with top-K instead of the reservoir, and
# without the walk (as measured: on the reservoir).
ABLATIONS = {
    "nexus-topk": "nexus:n_samples=none",
    "nexus-nowalk": "nexus:lam=0.0,prompt_top_k=false",
}

# Only when named. The Nexus ablations pin prompt_top_k=false: they were measured against the
# reservoir default, so a label keeps meaning what its published cells ran.
OPT_IN_ABLATIONS = {
    "nexus-smooth": "nexus:smooth_blocks=1,prompt_top_k=false",  # remedies for the needle's block-boundary cut
    "nexus-prior": "nexus:key_prior=0.5,prompt_top_k=false",
    "nexus-prior1": "nexus:key_prior=1.0,prompt_top_k=false",  # the anomaly prior alone (no attention)
    "nexus-b16": "nexus:block_size=16,prompt_top_k=false",
    "nexus-prompt-topk": "nexus:prompt_top_k=true",  # = nexus's default; the label of older runs
    "nexus-reservoir": "nexus:prompt_top_k=false",  # the paper: the reservoir at the one-shot step too
    "kvzip-global": "kvzip:layers=global",  # = kvzip's default; the label of older runs
}

# kvzip's default is the paper's head budgets with the library's per-head cap: "kvzip-paper" drops the
# cap (exactly the paper), "kvzip-each" is the per-layer uniform contract, "kvzip-plus" is KVzip+;
# "kvzap-each" is kvzap's per-layer uniform split (its default before 2026-12-03).
VARIANTS = {
    "kvzip-paper": "kvzip:max_head_factor=none",
    "kvzip-each": "kvzip:layers=each,allocation=uniform",
    "kvzip-plus": "kvzip:normalize=plus",
    "kvzap-each": "kvzap:layers=each,allocation=uniform",
    ROTATING: ROTATING,
}

# Label suffixes and the fields they add. "-4bit" pins the groups of 64 its published cells ran with
# (the library's 4-bit default is 32).
SUFFIXES = {
    "-ada": "allocation=ada",
    "-4bit": "kv_bits=4,kv_group_size=64",
    "-8bit": "kv_bits=8",
    "-nocap": "max_head_factor=none",
    "-g32": "kv_group_size=32",
    "-g128": "kv_group_size=128",
    "-recall-memory": "recall=memory",  # a cold tier that follow-ups recall from (docs/recall.md)
    "-recall-disk": "recall=disk",
    "-hold": "recall_hold=true",  # after "-recall-<tier>": a turn's recalled rows stay through its answer
}


def _table(ablations: bool = True) -> dict:
    """Every label with a spec of its own: full, the registry's methods, the ablations, the variants."""
    table = {FULL: FULL, **{m: m for m in methods()}}
    if ablations:
        table.update(ABLATIONS)
        table.update(OPT_IN_ABLATIONS)
    return {**table, **VARIANTS}


@functools.lru_cache(maxsize=None)
def _parsed(spec: str) -> tuple:
    """(method or full, core fields, options) of a spec; rotating takes no fields."""
    if spec == ROTATING:
        return ROTATING, {}, {}
    return parse_spec(spec)


def spec_of(label: str, ablations: bool = True) -> str:
    """The spec string a label runs (``"snapkv-ada"`` -> ``"snapkv:allocation=ada"``); ValueError for
    a label that names nothing, or a key its method does not have (values: :func:`method_specs`)."""
    table = _table(ablations)
    if label not in table and ":" in label:  # a spec string is a label of its own
        _parsed(label)
        return label
    base, suffixes = label, []
    while base not in table and base.endswith(tuple(SUFFIXES)):
        suffix = next(s for s in SUFFIXES if base.endswith(s))
        base, suffixes = base[:-len(suffix)], [suffix] + suffixes
    if base not in table:
        raise ValueError(f"unknown method {label!r}; known: {', '.join(table)} (each may end in "
                         f"{', '.join(SUFFIXES)})")
    method, core, options = _parsed(table[base])
    if not suffixes:
        return table[base]
    if method == ROTATING:
        raise ValueError(f"unknown method {label!r}: {ROTATING} takes no suffix")
    for s in suffixes:  # full takes only kv_bits and kv_group_size: the grammar refuses the rest
        try:
            core = {**core, **parse_spec(f"{method}:{SUFFIXES[s]}")[1]}
        except ValueError as e:
            raise ValueError(f"unknown method {label!r}: {e}") from None
    return format_spec(method, core, options)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One column of the comparison: a label and the spec string it runs (see :func:`spec_of`)."""

    name: str
    spec: str

    @property
    def _fields(self) -> tuple:
        return _parsed(self.spec)

    @property
    def method(self) -> str | None:
        """The registry method; None for mlx-lm's own caches (full, rotating)."""
        m = self._fields[0]
        return None if m in (FULL, ROTATING) else m

    @property
    def mlx_cache(self) -> str | None:
        """mlx-lm's own eviction a user would pick instead ("rotating"), else None."""
        return ROTATING if self._fields[0] == ROTATING else None

    @property
    def is_full(self) -> bool:
        """The full cache (mlx-lm's KVCache, or its QuantizedKVCache for ``full-4bit``): no budget."""
        return self._fields[0] == FULL

    @property
    def opts(self) -> dict:
        """The method options the label pins."""
        return dict(self._fields[2])

    @property
    def allocation(self):
        return self._fields[1].get("allocation")

    @property
    def kv_bits(self):
        return self._fields[1].get("kv_bits")

    @property
    def quant(self) -> tuple:
        """(kv_bits, kv_group_size): how the rows are stored (bits None = float rows)."""
        core = self._fields[1]
        return (core.get("kv_bits"), core.get("kv_group_size", 64) if core.get("kv_bits") else 64)

    @property
    def prefill_only(self) -> bool:
        """True when the method compresses only once at the end of the prompt (or is the full cache):
        then the prefill + decode regime is identical to the prefill-only one."""
        if self.method is None:
            return True
        return bool(getattr(get_method(self.method), "prefill_only", False))

    def config(self, budget: int, **fields) -> KVCacheConfig:
        """The eviction config this label runs at ``budget`` (``fields``: seed, prompt_eviction, ...)."""
        return KVCacheConfig.parse(self.spec, budget=int(budget), **fields)


def method_specs(names=None, ablations: bool = True) -> list:
    """Full cache + every registry method (read at run time) + the Nexus ablations.

    ``names`` restricts / orders the list: any label of :func:`spec_of` (``"nexus-topk"``,
    ``"snapkv-ada"``, ``"nexus-4bit-g32"``, ...)."""
    if names is None:
        names = [FULL, *methods(), *(ABLATIONS if ablations else ())]
    out = []
    for n in names:
        spec = MethodSpec(n, spec_of(n, ablations))
        if spec.method is not None:
            try:  # refuse a label whose fields the method refuses before any run (budget: any that fits)
                spec.config(PROBE_BUDGET)
            except ValueError as e:
                raise ValueError(f"unknown method {n!r}: {e}") from None
        elif spec.is_full:
            parse_full(spec.spec)
        out.append(spec)
    return out


def make_caches(model, spec: MethodSpec, budget: int, seed: int = 0, prompt_eviction: str = "end"):
    """Fresh per-layer caches: mlx-lm's KVCache for the full cache, else the eviction cache with
    ``prompt_eviction`` ("end": compress when the prompt ends; "stream": also at every chunk)."""
    if spec.mlx_cache == ROTATING:
        return rotating_caches(model, budget)
    if spec.method is None:  # "full-4bit": mlx-lm's own quantized cache, no eviction
        return model_caches(model, *spec.quant)
    return KVCacheBuilder.for_model(model, spec.config(budget, seed=int(seed), prompt_eviction=prompt_eviction))


def rotating_caches(model, budget: int) -> list:
    """What ``mlx_lm.generate --max-kv-size budget`` gives: ``RotatingKVCache(max_size=budget, keep=4)``
    per layer (a model's own sliding-window layers keep their caches; mlx-lm's make_prompt_cache
    ignores max_kv_size for a model with make_cache, so the plain KVCache layers are swapped here)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    return [RotatingKVCache(max_size=int(budget), keep=4) if type(c) is KVCache else c
            for c in make_prompt_cache(model)]


_ADA = "-ada"  # label suffix of a method run with Ada-KV allocation


def _is_ada(name) -> bool:
    return name.endswith(_ADA)


def _ada_base(name) -> str:
    """The uniform-allocation method of an Ada label ("snapkv-ada" -> "snapkv"); other names unchanged."""
    return name[:-len(_ADA)] if _is_ada(name) else name
