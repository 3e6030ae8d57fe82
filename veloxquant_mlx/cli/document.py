"""Compressed documents: ``compress`` writes them, ``generate --prompt-cache`` continues them (a fresh
copy each run), and the cache flags given with one must match what the file holds."""

from __future__ import annotations

import json
import sys

from ..config_spec import parse_spec
from .args import _FLAG_KEYS, CLIError, _cli_value, given_flags

DOCUMENT_FORMAT = "veloxquant-compressed-document/1"


def load_compressed_document(model, tokenizer, path: str):
    """A fresh copy of a compressed document's caches, ready to continue (query tap and model pass
    installed, this rank's head shard attached), and the file's metadata."""
    import warnings

    from ..builder import KVCacheBuilder
    from ..caches.cache import continue_on_purpose
    from ..prompt_cache import load_prompt_cache

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        caches, meta = load_prompt_cache(path, return_metadata=True, model=model)
    for w in seen:  # e.g. a file from before checksums: one line, not a warnings traceback
        print(f"warning: {w.message}", file=sys.stderr)
    if meta.get("format") != DOCUMENT_FORMAT:
        raise CLIError(f"{path!r} was not written by `compress` (format {meta.get('format')!r})")
    try:
        KVCacheBuilder.attach(model, caches, tokenizer)  # taps, model pass, this rank's head shard
    except ValueError as e:
        raise CLIError(str(e)) from None
    continue_on_purpose(caches)  # continuing the document is the point
    return caches, meta


def question_tokens(tokenizer, meta: dict, question: str) -> list:
    """The question as the continuation of the document's turn (no second BOS), then the rest of the
    chat template's turn that ``compress`` kept in the metadata."""
    return list(tokenizer.encode("\n\n" + question + meta.get("turn_tail", ""), add_special_tokens=False))


def describe_file_config(cfg) -> str:
    """One line for a compressed document's config (a dict or its JSON)."""
    cfg = json.loads(cfg) if isinstance(cfg, str) else (cfg or {})
    rows = "float rows" if cfg.get("kv_bits") is None else f"{cfg['kv_bits']}-bit rows in groups of {cfg.get('kv_group_size')}"
    return (f"{cfg.get('method')} (budget {cfg.get('budget')}/head, {rows}, n_sink {cfg.get('n_sink')}, "
            f"recent {cfg.get('recent')}, prompt_eviction {cfg.get('prompt_eviction')})")


def check_flags_against_file(args, meta: dict, path: str) -> None:
    """Refuse cache flags that differ from what a compressed document holds: the file's caches are
    continued as they are, so such a flag would be silently ignored. Flags equal to the file's pass."""
    cfg = meta.get("config")
    cfg = json.loads(cfg) if isinstance(cfg, str) else (cfg or {})
    given = given_flags(args)
    bad = []
    if "method" in given:  # the spec's name and each of its fields
        try:
            name, core, opts = parse_spec(args.method)
        except ValueError as e:
            raise CLIError(str(e)) from None
        held = {**(cfg.get("options") or {}), **cfg} if name == cfg.get("method") else {}
        if not held:
            bad.append(f"--method {args.method} (file: {cfg.get('method')})")
        for k, v in {**opts, **core}.items() if held else ():
            if (list(v) if isinstance(v, tuple) else v) != held.get(k):
                bad.append(f"{k}={_cli_value(v)} in --method (file: {_cli_value(held.get(k))})")
    for dest, key in _FLAG_KEYS:
        if dest in given and getattr(args, dest) != cfg.get(key):
            bad.append(f"--{dest.replace('_', '-')} {getattr(args, dest)} (file: {_cli_value(cfg.get(key))})")
    if "density" in given:
        bad.append(f"--density {args.density} (file: budget {cfg.get('budget')})")
    options = cfg.get("options") or {}
    for k in sorted(k for k in given if k.startswith("opt__")):
        _, method, field = k.split("__")
        value = getattr(args, k)
        held = options.get(field) if method == cfg.get("method") else None
        if method != cfg.get("method") or (list(value) if isinstance(value, tuple) else value) != held:
            bad.append(f"--{method}-{field.replace('_', '-')} {value} (file: "
                       f"{held if method == cfg.get('method') else 'method ' + str(cfg.get('method'))})")
    if bad:
        raise CLIError(f"{path} holds {describe_file_config(cfg)}; these flags conflict with it: {', '.join(bad)}. Leave "
                       "them out (the file's settings apply), or compress the document again with them")
