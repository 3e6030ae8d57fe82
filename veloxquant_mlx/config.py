"""KVCacheConfig: one validated description of how every layer's cache evicts.

Each method declares a small ``Options`` dataclass (in its own file) whose fields use
:func:`option` to state their type and range once; the config validates them and maps the flat
keyword style (``nexus_window=16``, ``nestedkv_budget=512``) onto the same fields.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from typing import Any

from .config_spec import (ALLOCATIONS, CORE_FIELDS, KV_BITS, KV_GROUP_SIZES, PROMPT_EVICTIONS,  # noqa: F401
                          format_spec, parse_spec)
from .options import check_pages, check_recall, check_recall_every, check_recall_hold, check_value, validate_options
from .registry import FULL, get_method

# Top-level fields that the flat ``<method>_<name>=`` style may also set.
_FLAT_CORE = ("budget", "n_sink", "recent", "seed")
# Their defaults where the method does not set them (recent: ``default_recent``).
_DEFAULTS = {"budget": 512, "n_sink": 4, "seed": 0}


def default_kv_group_size(kv_bits: int | None) -> int:
    """32 for 4-bit rows, else 64 (mlx-lm's). Paired passkey runs (docs/quality.md) lost Nexus's answers
    with 4-bit groups of 64 on SmolLM2 and Gemma 3, and groups of 32 restored them (~12 % more bytes)."""
    return 32 if kv_bits == 4 else 64


def check_kv_quant(kv_bits, kv_group_size) -> tuple:
    """(kv_bits, kv_group_size) of quantized rows, checked (group None: :func:`default_kv_group_size`).
    The one check of both, for eviction caches and for mlx-lm's own QuantizedKVCache (``full``)."""
    if kv_group_size is None:
        kv_group_size = default_kv_group_size(kv_bits)
    if kv_bits is not None and (not isinstance(kv_bits, int) or isinstance(kv_bits, bool) or kv_bits not in KV_BITS):
        raise ValueError(f"kv_bits={kv_bits!r} is not supported: use None (full precision) or one of "
                         f"{list(KV_BITS)}")
    if not isinstance(kv_group_size, int) or isinstance(kv_group_size, bool) or kv_group_size not in KV_GROUP_SIZES:
        raise ValueError(f"kv_group_size={kv_group_size!r} is not supported: use one of {list(KV_GROUP_SIZES)}")
    return kv_bits, kv_group_size


def parse_full(spec: str = FULL, **given) -> tuple:
    """(kv_bits, kv_group_size) of a ``full`` spec (``full``, ``full:kv_bits=4``): mlx-lm's own cache."""
    name, core, _ = parse_spec(spec, given)
    if name != FULL:
        raise ValueError(f"{spec!r} is not the full cache")
    return check_kv_quant(core.get("kv_bits"), core.get("kv_group_size"))


# Head-budget fields a method may default differently (``Method.config_defaults``; KVzip takes
# the paper's non-uniform budget). A config left at ``METHOD_DEFAULT`` takes the method's value.
HEAD_BUDGET_DEFAULTS = {"allocation": "uniform", "floor_alpha": 0.2, "max_head_factor": 1.1}


def budget_for(density: float, n_tokens: int, minimum: int = 1) -> int:
    """Rows kept per KV head for a ``density`` fraction of ``n_tokens``: rounded to the nearest row,
    at least ``minimum``. The one density -> budget rule (CLI, serve, evaluation, benchmarks)."""
    if not 0.0 < float(density) <= 1.0:
        raise ValueError(f"density={density!r} must lie in (0, 1]")
    return max(int(round(float(density) * int(n_tokens))), int(minimum))


class _MethodDefault:
    def __repr__(self):
        return "METHOD_DEFAULT"


METHOD_DEFAULT = _MethodDefault()


class KVCacheConfig:
    """How each attention layer's cache evicts.

    Args:
        method: registry name (see :func:`veloxquant_mlx.methods`).
        budget: tokens kept per KV head (per layer) after an eviction step.
        n_sink: leading tokens never evicted (attention sinks).
        recent: trailing tokens never evicted; ``None`` takes the method's default.
        seed: base seed; layer ``l`` uses ``seed + l``.
        head_dim: optional expected head dimension, checked against the keys the model sends.
        allocation: how a layer's ``H x budget`` rows are split across its KV heads: ``"uniform"``
            (every head keeps ``budget``) or ``"ada"`` (Ada-KV head-adaptive budgets; needs a method
            with a per-head score, ``Method.allocations``). Left unset,
            ``allocation``, ``floor_alpha`` and ``max_head_factor`` take the method's defaults
            (``HEAD_BUDGET_DEFAULTS``; kvzip and kvzap: ``"ada"``, 0.0 and 2.0, the papers' head budgets).
        floor_alpha: Ada-KV's floor: every head keeps at least ``floor_alpha`` of a uniform share
            (Ada-KV reference default 0.2). Ignored for ``"uniform"``.
        prompt_eviction: ``"end"`` (default: hold the prompt, compress once when it ends, then evict
            through decode; peak = the prompt's KV), ``"stream"`` (evict at every prompt chunk too;
            peak = budget + one chunk; later chunks read a compressed prefix) or ``"offload"`` (page the
            prompt: every chunk attends to every earlier row, read back from a file the cache owns a
            block at a time, and the method compresses once when the prompt ends, as under ``"end"``;
            peak = one chunk + one block + the method's per-row state; docs/offload.md). Prefill-only
            methods compress when the prompt ends in every mode; under ``"stream"`` also at every chunk.
        page_dir: folder of ``"offload"``'s page files (default: the OS temporary folder); must exist and
            be writable (checked here).
        page_block: rows read back from the page file per block (the attention scratch of a chunk's
            queries over one block is at most 512 x query heads x ``page_block`` floats: the chunk's
            queries run in spans of 512).
        max_head_factor: ragged per-head budgets (NestedKV's cross-head pool, Ada-KV, Ada-Nexus) keep at
            most ``max_head_factor x budget`` rows in one head, the layer's total unchanged (the other
            heads take the rest). Storage is as wide as the widest head, so this keeps the allocated
            bytes within ``max_head_factor`` x the kept rows (plus decode headroom). ``None``: the
            specs' own bound (up to ``H x budget`` minus the floors: storage up to 1.6x the kept rows
            was measured for NestedKV). Ignored by uniform allocations.
        kv_bits: ``None`` (rows stored in the model's dtype) or 4 / 8: kept rows stored quantized in
            mlx-lm's ``QuantizedKVCache`` layout (packed words + scales + biases), read by mlx-lm's own
            quantized attention. Eviction gathers packed rows, never requantizing them.
        kv_group_size: elements per quantization group along head_dim (32, 64 or 128; must divide
            head_dim). mlx-lm's names; ``None``: :func:`default_kv_group_size` (32 for 4 bits, else 64).
        recall: ``None`` (evicted rows are gone: every method's own behaviour), ``"memory"`` or
            ``"disk"``: evicted rows go to a cold tier, in pages of ``recall_page`` rows with their
            positions, and a later multi-token input (a follow-up turn) recalls the pages its queries
            need (docs/recall.md). ``"memory"`` keeps the cold rows quantized at ``recall_bits``;
            ``"disk"`` keeps them at full precision in a file the cache owns (in ``recall_dir``, else
            the OS temporary folder), nothing of them resident.
        recall_page: rows per cold page (per KV head); each page keeps its keys' min and max in memory.
        recall_bits: 2, 4 or 8: the cold rows' bits under ``recall="memory"`` (mlx-lm's layout, groups
            of 32 along head_dim).
        recall_dir: folder of the ``"disk"`` tier's files (must exist and be writable; checked here).
        recall_pages: pages per KV head read back at each recall (the best Quest bounds); the
            compression at the input's end then scores them with the method's own rule.
        recall_window: the new input's last queries that score the pages.
        recall_every: ``None`` (recall only when a new input arrives) or N: also recall every N decode
            steps with that step's query, then compress back to ``budget`` (Quest's per-step regime;
            ``recall="memory"`` only, so a decode step never reads a file).
        recall_hold: ``False`` (the compression at a follow-up input's end returns the hot tier to
            ``budget`` rows at once) or ``True``: after a follow-up input that recalled, that compression
            waits, so the turn's answer attends to every recalled row; it runs when the next input
            arrives or when decode adds the eviction slack (``evict_every``, 32 by default) of rows. The
            hot tier then holds up to ``recall_pages x recall_page`` + the input's tokens + the slack
            above ``budget`` while the turn answers. Not for methods whose compression needs a model pass.
        options: the method's options dataclass (or a dict of its fields).
        **flat: ``<method>_<field>=value`` for any core field (budget, n_sink, recent, seed) or
            option field of the chosen method, e.g. ``nexus_window=16``, ``nestedkv_budget=512``.
    """

    def __init__(self, method: str = "nexus", budget: int | None = None, n_sink: int | None = None,
                 recent: int | None = None, seed: int | None = None, head_dim: int | None = None,
                 options: Any = None, allocation: Any = METHOD_DEFAULT, floor_alpha: Any = METHOD_DEFAULT,
                 prompt_eviction: str = "end", kv_bits: int | None = None, kv_group_size: int | None = None,
                 max_head_factor: Any = METHOD_DEFAULT, recall: str | None = None, recall_page: int = 32,
                 recall_bits: int = 4, recall_dir: str | None = None, recall_pages: int = 8,
                 recall_window: int = 32, recall_every: int | None = None, recall_hold: bool = False,
                 page_dir: str | None = None, page_block: int = 1024, **flat):
        cls = get_method(method)
        defaults = {**HEAD_BUDGET_DEFAULTS, **cls.config_defaults}
        allocation_by_method = allocation is METHOD_DEFAULT  # named in the recall refusal below
        allocation, floor_alpha, max_head_factor = (
            defaults[k] if v is METHOD_DEFAULT else v
            for k, v in (("allocation", allocation), ("floor_alpha", floor_alpha), ("max_head_factor", max_head_factor)))
        self.method = method
        core = {"budget": budget, "n_sink": n_sink, "recent": recent, "seed": seed}
        opt_fields = {f.name for f in dataclasses.fields(cls.Options)}
        opt_values = {}
        if options is not None:
            if isinstance(options, dict):
                opt_values.update(options)
            elif isinstance(options, cls.Options):
                opt_values.update(dataclasses.asdict(options))
            else:
                raise TypeError(f"options for {method!r} must be {cls.Options.__name__} or a dict, "
                                f"got {type(options).__name__}")
        prefix = method + "_"
        for key, value in flat.items():
            if not key.startswith(prefix):
                raise TypeError(f"unknown KVCacheConfig argument {key!r} (method is {method!r}; "
                                f"flat options must start with {prefix!r})")
            name = key[len(prefix):]
            if name in _FLAT_CORE:
                if core[name] is not None and core[name] != value:
                    raise ValueError(f"{key}={value!r} conflicts with {name}={core[name]!r}")
                core[name] = value
            elif name in opt_fields:
                if name in opt_values and opt_values[name] != value:
                    raise ValueError(f"{key}={value!r} conflicts with options.{name}={opt_values[name]!r}")
                opt_values[name] = value
            else:
                known = sorted(set(_FLAT_CORE) | opt_fields)
                raise TypeError(f"unknown option {key!r} for method {method!r}; known: "
                                f"{', '.join(prefix + k for k in known)}")
        unknown = set(opt_values) - opt_fields
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)} for method {method!r}; "
                            f"known: {sorted(opt_fields)}")
        self.options = cls.Options(**opt_values)
        validate_options(self.options)

        def check(name, value):
            return check_value("KVCacheConfig", name, value, CORE_FIELDS[name])

        self.budget, self.n_sink, self.seed = (check(k, _DEFAULTS[k] if core[k] is None else core[k])
                                               for k in ("budget", "n_sink", "seed"))
        recent = core["recent"]
        self.recent = check("recent", cls.default_recent(self.budget, self.options) if recent is None else recent)
        self.head_dim = check("head_dim", head_dim)
        self.allocation = check("allocation", allocation)
        self.floor_alpha = check("floor_alpha", floor_alpha)
        self.prompt_eviction = check("prompt_eviction", prompt_eviction)
        self.max_head_factor = check("max_head_factor", max_head_factor)
        kv_bits, kv_group_size = check_kv_quant(kv_bits, kv_group_size)
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        if kv_bits is not None:
            if not cls.supports_kv_bits:
                raise ValueError(f"kv_bits={kv_bits} is not supported by method {method!r}: it cannot store "
                                 "quantized rows")
            if self.head_dim is not None and self.head_dim % kv_group_size:
                raise ValueError(f"kv_group_size={kv_group_size} does not divide head_dim={self.head_dim}: "
                                 "quantized rows need whole groups")
        if self.allocation not in cls.allocations:
            raise ValueError(f"allocation={self.allocation!r} is not supported by method {method!r} (it runs "
                             f"{' or '.join(repr(a) for a in cls.allocations)})")
        self.recall, self.recall_page, self.recall_bits, self.recall_dir, self.recall_pages, self.recall_window = (
            check_recall(recall, recall_page, recall_bits, recall_dir, recall_pages, recall_window))
        self.recall_every = check_recall_every(recall, recall_every)
        self.recall_hold = check_recall_hold(recall, recall_hold, method, cls)
        if recall is not None and self.allocation != "uniform":
            whose = f" ({method}'s default)" if allocation_by_method else ""
            raise ValueError(f"recall={recall!r} needs uniform per-head storage: allocation={self.allocation!r}"
                             f"{whose} keeps ragged heads (use allocation='uniform')")
        if recall is not None and getattr(self.options, "cross_head", False):
            raise ValueError(f"recall={recall!r} needs uniform per-head storage: {method}'s cross-head "
                             f"competition keeps ragged heads (use {method}_cross_head=False)")
        self.page_dir, self.page_block = check_pages(self.prompt_eviction, page_dir, page_block, recall, method, cls)
        # The method's own check first: where it needs more than the generic minimum (Nexus's whole blocks),
        # the first error already names the budget that passes.
        cls.check_config(self)
        if self.budget <= self.n_sink + self.recent:
            raise ValueError(
                f"budget ({self.budget}) must exceed n_sink + recent ({self.n_sink} + {self.recent} = "
                f"{self.n_sink + self.recent}): nothing would be left for {method!r} to select; need budget >= "
                f"{self.n_sink + self.recent + 1}")

    # ``config.nexus.window`` reads the chosen method's options under the method's name.
    def __getattr__(self, name):
        if name != "method" and name == self.__dict__.get("method"):
            return self.__dict__["options"]
        raise AttributeError(name)

    @property
    def method_class(self):
        """The registered method (``caches.method.Method``) this config runs."""
        return get_method(self.method)

    def head_cap_rows(self, budget: int) -> int | None:
        """Most rows one head may keep under ragged per-head budgets (None: no cap)."""
        f = self.max_head_factor
        return None if f is None else max(int(f * budget), budget)

    def replace(self, **changes) -> "KVCacheConfig":
        """A copy with some fields changed (options fields may be passed flat or via options=)."""
        d = self.to_dict()
        opts = d.pop("options")
        opts.update(changes.pop("options", {}) or {})
        method = changes.pop("method", d.pop("method"))
        if method != self.method:
            opts = {}
        d.pop("method", None)
        d.update(changes)
        return KVCacheConfig(method=method, options=opts, **d)

    def to_dict(self) -> dict:
        return {"method": self.method, "budget": self.budget, "n_sink": self.n_sink,
                "recent": self.recent, "seed": self.seed, "head_dim": self.head_dim,
                "allocation": self.allocation, "floor_alpha": self.floor_alpha,
                "prompt_eviction": self.prompt_eviction, "kv_bits": self.kv_bits,
                "kv_group_size": self.kv_group_size, "max_head_factor": self.max_head_factor,
                **self._recall_dict(), **self._pages_dict(), "options": {k: (list(v) if isinstance(v, tuple) else v)
                                                   for k, v in dataclasses.asdict(self.options).items()}}

    def _recall_dict(self) -> dict:
        # Only when recall is on: a config without it carries no recall fields.
        if self.recall is None:
            return {}
        return {"recall": self.recall, "recall_page": self.recall_page, "recall_bits": self.recall_bits,
                "recall_dir": self.recall_dir, "recall_pages": self.recall_pages,
                "recall_window": self.recall_window,
                **({} if self.recall_every is None else {"recall_every": self.recall_every}),
                **({"recall_hold": True} if self.recall_hold else {})}

    def _pages_dict(self) -> dict:
        if self.prompt_eviction != "offload":
            return {}
        return {"page_dir": self.page_dir, "page_block": self.page_block}

    @classmethod
    def from_dict(cls, d: dict) -> "KVCacheConfig":
        d = dict(d)
        return cls(**d)

    @classmethod
    def parse(cls, spec: str, **given) -> "KVCacheConfig":
        """The config a spec string describes: ``KVCacheConfig.parse("nexus:window=16,kv_bits=4")``
        (grammar: :mod:`veloxquant_mlx.config_spec`). ``given``: fields set apart from the spec
        (``budget=256``, an option by its spec key); a field set both ways must agree (else
        ValueError), so a spec never silently overrides a separate setting nor the reverse.
        ``KVCacheConfig.parse(str(c)) == c``."""
        method, core, options = parse_spec(spec, given)
        if method == FULL:
            raise ValueError(f"{spec!r} is mlx-lm's own cache, not an eviction config (see parse_full)")
        try:
            return cls(method=method, options=options, **core)
        except TypeError as e:  # a value of the wrong type given separately
            raise ValueError(str(e)) from None

    def spec_fields(self) -> tuple:
        """(core fields, options) that differ from what the method alone gives: what ``str()`` writes."""
        cls = get_method(self.method)
        signature = {k: p.default for k, p in inspect.signature(KVCacheConfig.__init__).parameters.items()}
        implied = {**signature, **_DEFAULTS, "recent": cls.default_recent(self.budget, self.options),
                   "kv_group_size": default_kv_group_size(self.kv_bits), **HEAD_BUDGET_DEFAULTS,
                   **cls.config_defaults}
        core = {k: getattr(self, k) for k in CORE_FIELDS if getattr(self, k) != implied[k]}
        defaults = cls.Options()
        options = {f.name: getattr(self.options, f.name) for f in dataclasses.fields(self.options)
                   if getattr(self.options, f.name) != getattr(defaults, f.name)}
        return core, options

    def __str__(self):
        return format_spec(self.method, *self.spec_fields())

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def __eq__(self, other):
        return isinstance(other, KVCacheConfig) and self.to_dict() == other.to_dict()

    def __repr__(self):
        opts = ", ".join(f"{k}={v!r}" for k, v in dataclasses.asdict(self.options).items())
        return (f"KVCacheConfig(method={self.method!r}, budget={self.budget}, n_sink={self.n_sink}, "
                f"recent={self.recent}, seed={self.seed}, allocation={self.allocation!r}, "
                f"floor_alpha={self.floor_alpha}, prompt_eviction={self.prompt_eviction!r}, "
                f"kv_bits={self.kv_bits}, kv_group_size={self.kv_group_size}, "
                f"max_head_factor={self.max_head_factor}, "
                + "".join(f"{k}={v!r}, " for k, v in {**self._recall_dict(), **self._pages_dict()}.items()) +
                f"{self.method}=({opts}))")
