"""``python -m veloxquant_mlx demo``: passkey retrieval, the full cache against eviction methods."""

from __future__ import annotations

import sys
import time

from ..platform.blas import blas_hint, describe
from ..builder import KVCacheBuilder
from ..config import KVCacheConfig, budget_for
from ..evaluation.passkey import extract_digits, make_passkey_prompt
from ..registry import FULL
from .args import CLIError, check_context, fmt_bytes, load_model_for_cli, ranged


def demo_row(model, tokenizer, tokens, config, bar, prefill_step_size, max_tokens=8) -> dict:
    """One demo row through mlx_lm.stream_generate; ``bar`` (tqdm) advances through the prompt.

    ``allocated_bytes`` is ``sum(c.nbytes)`` over the layers' caches (the buffers really held);
    ``peak_bytes`` is MLX's process peak during this row (model weights included)."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

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


    for spec in args.methods:
        KVCacheConfig.parse(spec, budget=10**6)  # reject bad specs before loading the model (budget: --density's)
    if not 0.0 < args.density <= 1.0:
        raise CLIError(f"--density must be in (0, 1], got {args.density}")
    hint = None if getattr(args, "blas_hint_shown", False) else blas_hint()
    if hint:  # before the slow work, not after it
        print(f"note: {hint}. Without it this demo takes several minutes.", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    model, tokenizer = load_model_for_cli(args.model)
    key = "68043"
    tokens, pos = make_passkey_prompt(tokenizer, args.context, args.depth, key)
    check_context(model, len(tokens), 8, args.allow_past_context)  # the prompt and its 8-token answer
    budget = budget_for(args.density, len(tokens))
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
            config = None if method == FULL else KVCacheConfig.parse(method, budget=budget)
            out = demo_row(model, tokenizer, tokens, config, bar, args.prefill_step_size)
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
              f"{fmt_bytes(out['allocated_bytes']):>12s} {out['allocated_bytes'] / full_alloc:>6.2f}x "
              f"{fmt_bytes(out['peak_bytes']):>11s} {out['prompt_tps']:>13.1f} {out['generation_tps']:>12.1f}")
    print(f"KV allocated: sum of the caches' nbytes after {len(tokens)} prompt + 8 generated tokens; "
          f"peak memory: MLX's process peak during the row (weights included). "
          f"Total {time.perf_counter() - t0:.0f} s.")
    return 0


def add_parser(sub):
    d = sub.add_parser("demo", help="passkey retrieval: full cache vs Nexus vs SnapKV at 20%% density",
                       description="Passkey retrieval on one prompt: the full cache against eviction methods.")
    d.add_argument("--model", default="bundled", help="'bundled', 'gemma3-270m', a .gguf path, or an mlx-lm "
                   "model path")
    d.add_argument("--context", type=ranged(int, 64), default=1000,
                   help="prompt length in tokens, >= 64 (within the model's context unless --allow-past-context)")
    d.add_argument("--depth", type=ranged(float, 0.0, 1.0), default=0.5,
                   help="where the key sits (0 = start, 1 = end)")
    d.add_argument("--density", type=float, default=0.2, help="fraction of the prompt each eviction method keeps")
    d.add_argument("--allow-past-context", action="store_true",
                   help="run a prompt longer than the model's context (refused otherwise)")
    d.add_argument("--methods", nargs="+", default=["nexus", "snapkv"],
                   help="methods compared with the full cache: name or name:option=value,... "
                        "(e.g. nexus:n_samples=none h2o nestedkv)")
    d.add_argument("--prefill-step-size", type=ranged(int, 1), default=256,
                   help="prompt chunk size (default 256: a live progress bar and less attention work; the "
                        "caches still compress once when the prompt ends)")
    d.set_defaults(func=cmd_demo)
    return d
