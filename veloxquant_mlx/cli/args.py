"""Argument helpers shared by the subcommands (and scripts): the cache flags every command takes,
the config they describe, method specs, and loading a model by its command-line name.
"""

from __future__ import annotations

import argparse
import dataclasses

from ..config import KVCacheConfig
from ..registry import FULL, get_method, methods


class CLIError(Exception):
    """A user-facing error: printed as one line."""


def parse_value(kind, allow_none):
    """An argparse ``type=`` for an option of ``kind`` (bool: true/false; tuple: comma separated;
    ``none`` / ``inf`` is None when ``allow_none``)."""

    def parse(text):
        if allow_none and text.lower() in ("none", "inf"):
            return None
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
        if kind is tuple:
            return tuple(float(x) for x in text.split(","))
        return kind(text)

    return parse


def add_method_options(parser):
    """``--<method>-<option>`` for every option of every registered method (read from its Options)."""
    group = parser.add_argument_group("method options (only the chosen --method's apply)")
    for name in methods():
        for f in dataclasses.fields(get_method(name).Options):
            meta = f.metadata
            kind = meta.get("kind", type(f.default))
            flag = f"--{name}-{f.name.replace('_', '-')}"
            group.add_argument(flag, dest=f"opt__{name}__{f.name}", default=argparse.SUPPRESS,
                               metavar=f.name.upper(),
                               type=parse_value(kind, meta.get("allow_none", False)),
                               help=f"{meta.get('doc') or f.name} (default {f.default!r})")


def add_cache_args(parser, default_method="nexus"):
    """The cache flags every command takes (method, budget or density, sinks, recent, seed, Ada-KV, prompt
    policy, method options); :func:`config_from_args` turns them into a config."""
    parser.add_argument("--method", default=default_method,
                        help=f"eviction method, or '{FULL}' for mlx-lm's full KVCache (default {default_method})")
    parser.add_argument("--budget", type=int, default=None, help="tokens kept per KV head per layer")
    parser.add_argument("--density", type=float, default=None,
                        help="budget as a fraction of the prompt length (instead of --budget)")
    parser.add_argument("--n-sink", type=int, default=None, help="leading tokens never evicted")
    parser.add_argument("--recent", type=int, default=None, help="trailing tokens never evicted")
    parser.add_argument("--cache-seed", type=int, default=None, help="seed of the eviction randomness")
    parser.add_argument("--allocation", choices=("uniform", "ada"), default=None,
                        help="budget across KV heads: uniform, or Ada-KV head-adaptive (needs a per-head score)")
    parser.add_argument("--floor-alpha", type=float, default=None, help="Ada-KV guaranteed floor fraction")
    parser.add_argument("--prompt-eviction", choices=("end", "stream"), default=None,
                        help="end (default): hold the prompt, compress once when it ends, then evict "
                             "through decode; stream: also evict at every prefill chunk (peak = budget + chunk)")
    parser.add_argument("--kv-bits", type=int, default=None,
                        help="store the kept rows quantized, 4 or 8 bits (mlx-lm's QuantizedKVCache layout, read by "
                             "its quantized attention); with --method full: mlx-lm's QuantizedKVCache")
    parser.add_argument("--kv-group-size", type=int, default=64,
                        help="quantization group along head_dim: 32, 64 (default) or 128")
    add_method_options(parser)


def config_from_args(args, prompt_len: int):
    """KVCacheConfig from CLI flags, or None for the full cache."""
    extra = {k: v for k, v in vars(args).items() if k.startswith("opt__")}
    if args.method == FULL:
        if extra:
            raise CLIError(f"--method {FULL} takes no method options (got {_flags(extra)})")
        _check_full_kv_bits(args)
        return None
    get_method(args.method)  # unknown method -> ValueError listing the known ones
    wrong = {k: v for k, v in extra.items() if k.split("__")[1] != args.method}
    if wrong:
        raise CLIError(f"{_flags(wrong)} do(es) not apply to --method {args.method}")
    if args.budget is not None and args.density is not None:
        raise CLIError("give --budget or --density, not both")
    budget = args.budget
    if args.density is not None:
        if not 0.0 < args.density <= 1.0:
            raise CLIError(f"--density must be in (0, 1], got {args.density}")
        budget = max(int(round(args.density * prompt_len)), 1)
    options = {k.split("__")[2]: v for k, v in extra.items()}
    alloc = {k: v for k, v in (("allocation", args.allocation), ("floor_alpha", args.floor_alpha),
                               ("prompt_eviction", getattr(args, "prompt_eviction", None)),
                               ("kv_bits", getattr(args, "kv_bits", None)),
                               ("kv_group_size", getattr(args, "kv_group_size", None))) if v is not None}
    return KVCacheConfig(method=args.method, budget=budget, n_sink=args.n_sink, recent=args.recent,
                         seed=args.cache_seed, options=options, **alloc)


def _check_full_kv_bits(args):
    """--method full --kv-bits: mlx-lm's own QuantizedKVCache; same supported values as ours."""
    from ..config import KV_BITS, KV_GROUP_SIZES

    bits = getattr(args, "kv_bits", None)
    if bits is not None and bits not in KV_BITS:
        raise CLIError(f"--kv-bits {bits} is not supported: use one of {list(KV_BITS)} (or leave it out)")
    if getattr(args, "kv_group_size", 64) not in KV_GROUP_SIZES:
        raise CLIError(f"--kv-group-size {args.kv_group_size} is not supported: use one of {list(KV_GROUP_SIZES)}")


def _flags(extra):
    return ", ".join("--" + k[5:].replace("__", "-").replace("_", "-") for k in extra)


def parse_method_spec(spec: str, budget: int) -> KVCacheConfig:
    """``name`` or ``name:option=value,option=value`` (e.g. ``nexus:n_samples=none``) -> config."""
    name, _, rest = spec.partition(":")
    cls = get_method(name)
    fields = {f.name: f for f in dataclasses.fields(cls.Options)}
    options = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in fields:
            raise CLIError(f"bad method spec {spec!r}: expected {name}:option=value with option in "
                           f"{sorted(fields)}")
        meta = fields[key].metadata
        try:
            options[key] = parse_value(meta.get("kind", str), meta.get("allow_none", False))(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise CLIError(f"bad value in method spec {spec!r}: {e}") from None
    return KVCacheConfig(method=name, budget=budget, options=options)


def load_model_for_cli(spec):
    """(model, tokenizer) for a --model value: 'bundled' (or None), 'gemma3-270m', a .gguf or mlx-lm path."""
    from ..models import load_model  # deferred: loading mlx-lm models is slow to import

    return load_model(None if spec in (None, "bundled") else spec)


def fmt_bytes(n):
    """``123 B``, ``4.0 KiB``, ... ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


# -- compressed documents (`compress` writes them, `generate --prompt-cache` continues them) -------------
DOCUMENT_FORMAT = "veloxquant-compressed-document/1"


def load_compressed_document(model, tokenizer, path: str):
    """A fresh copy of a compressed document's caches, ready to continue (query tap and model pass
    installed, this rank's head shard attached), and the file's metadata."""
    from ..distributed import attach, resolve_group
    from ..model_pass import install_model_pass
    from ..prompt_cache import load_prompt_cache
    from ..tap import install_query_tap

    caches, meta = load_prompt_cache(path, return_metadata=True)
    if meta.get("format") != DOCUMENT_FORMAT:
        raise CLIError(f"{path!r} was not written by `compress` (format {meta.get('format')!r})")
    install_query_tap(model)
    if any(getattr(c, "needs_model_pass", False) for c in caches):
        install_model_pass(model, tokenizer)
    attach(caches, resolve_group(model, None))
    for c in caches:
        if hasattr(c, "continue_on_purpose"):
            c.continue_on_purpose()  # continuing the document is the point
    return caches, meta


def question_tokens(tokenizer, meta: dict, question: str) -> list:
    """The question as the continuation of the document's turn (no second BOS), then the rest of the
    chat template's turn that ``compress`` kept in the metadata."""
    return list(tokenizer.encode("\n\n" + question + meta.get("turn_tail", ""), add_special_tokens=False))
