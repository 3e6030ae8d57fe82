"""The text form of a cache configuration: ``method:key=value,key=value``.

One grammar for every place a configuration is written down (``--method`` of the CLI, ``serve``,
the evaluation's labels): ``nexus``, ``nexus:window=16,kv_bits=4``, ``snapkv:allocation=ada``.

* A key is a core field of :class:`~veloxquant_mlx.config.KVCacheConfig` (:data:`CORE_FIELDS`) or an
  option of the method's ``Options`` dataclass. An option whose name a core field also has is
  written ``<method>.<name>`` (``nestedkv.max_head_factor``); any option may be written that way.
* Values are typed from the field's metadata (:func:`veloxquant_mlx.options.option`): ints, floats,
  ``true`` / ``false``, strings, ``none`` where the field allows None, tuples in parentheses
  (``prior=(0.4,0.4,0.2)``).
* ``full`` is mlx-lm's own cache; it takes only ``kv_bits`` and ``kv_group_size``.

This module types and names the fields; ``KVCacheConfig`` validates their values.
"""

from __future__ import annotations

import dataclasses

from .options import RECALL_BITS, RECALL_TIERS, format_value, parse_value
from .registry import FULL, get_method

# Budget allocation across the KV heads of one layer (the "allocation" axis of score x allocation x
# selection): "uniform" gives every head ``budget`` rows; "ada" is Ada-KV (Feng et al., NeurIPS 2025).
ALLOCATIONS = ("uniform", "ada")

# When eviction runs while the prompt is read (see docs/architecture.md "When eviction runs"):
# "end": hold the prompt, compress once when it ends (right after the first single-token step; under
#        mlx_lm.generate the prompt's last token, which attends to everything), then evict through decode. The paper's prefill +
#        decode setting: the question is in the window before anything is scored. Peak = the prompt's KV.
# "stream": also evict at every prompt chunk (mlx_lm.generate: every prefill_step_size tokens), scored
#        before the question has arrived. Peak = budget + one chunk + headroom per layer.
# "offload": page the prompt: every chunk attends exactly to every earlier row, read back a block at a time
#        from a file the cache owns (caches/pages.py), and the method compresses once when the prompt ends,
#        as under "end". Peak = one chunk + one block of rows + the method's per-row state.
PROMPT_EVICTIONS = ("end", "stream", "offload")

# Quantized kept rows (mlx-lm's QuantizedKVCache layout; see caches/quant.py). 2 bits is left out on
# purpose: at equal memory it tends to collapse ("More Tokens, Lower Precision", arXiv 2412.12706).
KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts


def _field(kind, low=None, high=None, choices=None, allow_none=False):
    return dict(kind=kind, low=low, high=high, low_open=False, choices=choices, allow_none=allow_none)


# KVCacheConfig's own fields, in the order ``str(config)`` writes them (``None`` for recent, kv_group_size:
# the method's / the bits' default).
CORE_FIELDS = {
    "budget": _field(int, low=1), "n_sink": _field(int, low=0), "recent": _field(int, low=0, allow_none=True),
    "seed": _field(int, low=0), "head_dim": _field(int, low=1, allow_none=True),
    "allocation": _field(str, choices=ALLOCATIONS), "floor_alpha": _field(float, low=0.0, high=1.0),
    "max_head_factor": _field(float, low=1.0, allow_none=True),
    "prompt_eviction": _field(str, choices=PROMPT_EVICTIONS),
    "kv_bits": _field(int, choices=KV_BITS, allow_none=True),
    "kv_group_size": _field(int, choices=KV_GROUP_SIZES, allow_none=True),
    "recall": _field(str, choices=RECALL_TIERS, allow_none=True), "recall_page": _field(int, low=1, high=1024),
    "recall_bits": _field(int, choices=RECALL_BITS), "recall_dir": _field(str, allow_none=True),
    "recall_pages": _field(int, low=1), "recall_window": _field(int, low=1),
    "recall_every": _field(int, low=1, allow_none=True), "recall_hold": _field(bool),
    "page_dir": _field(str, allow_none=True), "page_block": _field(int, low=1),
}

# What ``full`` (mlx-lm's KVCache, or its QuantizedKVCache) takes.
FULL_FIELDS = ("kv_bits", "kv_group_size")


def _option_keys(method: str) -> dict:
    """``{key: (option name, metadata)}`` of a method's options, both the plain and the
    ``<method>.<name>`` spelling (only the latter for an option a core field shadows)."""
    keys = {}
    for f in dataclasses.fields(get_method(method).Options):
        meta = {**_field(type(f.default) if f.default is not None else float), **f.metadata}
        keys[f"{method}.{f.name}"] = (f.name, meta)
        if f.name not in CORE_FIELDS:
            keys[f.name] = (f.name, meta)
    return keys


def option_key(method: str, name: str) -> str:
    """How a spec writes option ``name`` of ``method``: plain, or qualified when a core field shadows it."""
    return f"{method}.{name}" if name in CORE_FIELDS else name


def valid_keys(method: str) -> list:
    """The keys a spec of ``method`` accepts (its options first, then the core fields)."""
    if method == FULL:
        return list(FULL_FIELDS)
    opts = [option_key(method, f.name) for f in dataclasses.fields(get_method(method).Options)]
    return opts + list(CORE_FIELDS)


def _split_items(text: str) -> list:
    """``a=1,b=(1,2),c=x`` -> ["a=1", "b=(1,2)", "c=x"] (commas inside parentheses stay)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [s.strip() for s in items if s.strip()]


def parse_spec(spec: str, given: dict | None = None) -> tuple:
    """``(method, core fields, options)`` of a spec string, values typed.

    ``given``: fields set separately (typed values, same keys as the spec, e.g. a CLI flag or the
    evaluation's budget). A key in both must have the same value; otherwise ValueError.
    Raises ValueError naming the bad key (with the valid ones) or the bad value."""
    if not isinstance(spec, str):
        raise TypeError(f"a method spec must be a string, got {type(spec).__name__}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    opt_keys = {} if name == FULL else _option_keys(name)  # unknown method -> ValueError listing the known ones
    core_keys = FULL_FIELDS if name == FULL else tuple(CORE_FIELDS)
    core, options, seen = {}, {}, {}

    def put(key, value, typed, where):
        if key in opt_keys:
            field, meta = opt_keys[key]
            target = options
        elif key in core_keys:
            field, meta, target = key, CORE_FIELDS[key], core
        else:
            raise ValueError(f"bad method spec {spec!r}: unknown key {key!r}; valid keys for {name}: "
                             f"{', '.join(valid_keys(name))}")
        if not typed:
            try:
                value = parse_value(value, meta["kind"], meta.get("allow_none", False))
            except ValueError as e:
                raise ValueError(f"bad value in method spec {spec!r}: {key}={value}: {e}") from None
        ident = (target is options, field)
        if ident in seen and seen[ident][1] != value:
            raise ValueError(f"{key} is given twice with different values: {seen[ident][0]} {seen[ident][1]!r} "
                             f"and {where} {value!r}")
        seen[ident] = (where, value)
        target[field] = value

    for item in _split_items(rest):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad method spec {spec!r}: {item!r} is not key=value "
                             f"(valid keys for {name}: {', '.join(valid_keys(name))})")
        put(key.strip(), value.strip(), False, f"{spec!r}:")
    for key, value in (given or {}).items():
        put(key, value, True, "separately:")
    return name, core, options


def format_spec(method: str, core: dict, options: dict) -> str:
    """The spec string of ``method`` with these fields (options first, then core fields in
    :data:`CORE_FIELDS` order); :func:`parse_spec` reads it back."""
    items = [f"{option_key(method, k)}={format_value(v)}" for k, v in options.items()]
    items += [f"{k}={format_value(core[k])}" for k in CORE_FIELDS if k in core]
    return method + (":" + ",".join(items) if items else "")
