"""KVzap's cost: prefill with kvzap / kvzip / a plain KVCache, and decode with kvzap vs mlx-lm's
RotatingKVCache(max_size=budget), side by side in one run.

On the bundled SmolLM2-135M (fp32, its shipped scorer), a prose prompt of each context is fed exactly as
``mlx_lm.generate`` feeds it (all but the last token in chunks of 2048, the last token alone, then
``mx.eval`` of the caches' state). Decode: ``--decode`` greedy tokens after that prefill, timed alone
(per token), kvzap at the same budget as the rotating cache. Every round runs every variant, the order
alternating between rounds; medians and per-round ratios are reported. OpenBLAS is preloaded (1 thread)
unless ``--no-fast-blas``.

    python benchmark_scripts/bench_kvzap.py --contexts 2048 --rounds 3   # -> figures/kvzap/cost.json
    python benchmark_scripts/bench_kvzap.py --model twin:twins/qwen --warmup full   # a GPU: random weights
    python benchmark_scripts/bench_kvzap.py --needle-rank                # the passkey's rank under the scorer

``--model twin:FOLDER`` times a random-weight twin (``python -m veloxquant_mlx.models.twin``): the model's
shapes and tokenizer without its weights, for a machine the weights cannot reach. kvzap then runs the
shipped scorer of the model the twin was made from (its identity rewritten to the twin's): the same
matmuls on random hidden states, so the cost is the model's and the kept rows mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from _common import add_publish, route_outputs

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--decode", type=int, default=64, help="decode tokens timed after the prefill")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--no-kvzip", action="store_true", help="leave kvzip's prefill out (it is the slow one)")
    p.add_argument("--no-fast-blas", action="store_true")
    p.add_argument("--model", default="bundled", help="bundled | gemma3-270m | qwen2.5-coder-1.5b | twin:FOLDER[:dtype]")
    p.add_argument("--warmup", choices=("short", "full"), default="short",
                   help="untimed run before the rounds: kvzap on 256 tokens (short), or every variant at each "
                        "context (full: a GPU compiles kernels per shape)")
    p.add_argument("--decode-methods", nargs="+", default=["kvzap"],
                   help="labels whose decode is timed against the rotating cache (their prefill too)")
    p.add_argument("--needle-rank", action="store_true", help="instead: how each scorer's predictions track the "
                   "true KVzip+ scores on passkey prompts (1K, depth 0.02): Spearman, and the needle's keep share")
    p.add_argument("--scorer", nargs="*", default=[], help="--needle-rank: scorer files to compare (default: "
                   "the shipped SmolLM2 scorer)")
    p.add_argument("--out", default=str(ROOT / "figures" / "kvzap" / "cost.json"))
    add_publish(p)
    return route_outputs(p.parse_args(argv), "out")


def prefill(model, tokens, caches, step):
    import mlx.core as mx

    x = mx.array(tokens)[None]
    n = x.shape[1]
    t0 = time.perf_counter()
    for s in range(0, n - 1, step):
        model(x[:, s:min(s + step, n - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    logits = model(x[:, n - 1:], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    return time.perf_counter() - t0, logits


def decode(model, logits, caches, n):
    """(seconds per token, host seconds per token) of ``n`` greedy steps, pipelined as mlx_lm.generate does
    (async_eval). The host's share is the time in the model call and async_eval, which on a GPU bounds a
    step when the kernels are shorter than building them."""
    import mlx.core as mx

    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)
    build = 0.0
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        logits = model(tok, cache=caches)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.async_eval(tok)
        build += time.perf_counter() - t
    mx.eval(tok)
    return (time.perf_counter() - t0) / n, build / n


def twin_scorer(model) -> None:
    """kvzap on a random-weight twin: a copy of the shipped scorer fitted for the twin's source model (same
    architecture and shapes), its identity rewritten to the twin's, in a folder that kvzap searches first."""
    import tempfile

    from veloxquant_mlx.methods.kvzap.scorer import (SCORER_PATH_ENV, SHIPPED_DIR, load_scorer, model_identity,
                                                    save_scorer)

    ident = model_identity(model)
    shape = {k: v for k, v in ident.items() if k != "weights_sha256"}
    for f in sorted(SHIPPED_DIR.glob("*.safetensors")):
        weights, meta, _ = load_scorer(f)
        if {k: v for k, v in meta["identity"].items() if k != "weights_sha256"} == shape:
            out = Path(tempfile.mkdtemp(prefix="twin-scorer-"))
            save_scorer(out / f.name, weights, ident, meta["fit"], {**meta["provenance"], "twin_of": f.name},
                        meta["quality"])
            os.environ[SCORER_PATH_ENV] = str(out)
            print(f"kvzap on the twin: the shipped {f.name}, identity rewritten", flush=True)
            return
    print("no shipped kvzap scorer has the twin's shapes: kvzap will refuse", flush=True)


def attended_rows(caches) -> dict:
    """Rows one decode step attends to, summed over layers and KV heads: ``attended`` (storage as wide as
    each layer's widest head, padding included: what attention reads) and ``real`` (padding left out)."""
    import numpy as np

    from veloxquant_mlx.caches import PAD_POSITION

    attended = real = 0
    for c in caches:
        if getattr(c, "positions", None) is not None:  # an eviction cache: (B, H, rows) positions
            pos = np.array(c.positions[..., :c.size()])
            attended, real = attended + pos[0].size, real + int((pos[0] != PAD_POSITION).sum())
        elif getattr(c, "keys", None) is not None:  # mlx-lm's caches: every stored row is real
            n = c.keys.shape[1] * min(c.offset, c.keys.shape[2])
            attended, real = attended + n, real + n
    return {"attended": attended, "real": real}


def needle_rank(scorers: list) -> int:
    """``--needle-rank``: does a scorer rank the passkey's tokens as KVzip+ itself does? Per haystack (1K,
    depth 0.02), the true KVzip+ scores of every row (kvzip normalize="plus", per layer: the fit's target)
    beside each scorer's predictions from the same forward's hidden states; printed per scorer: the mean
    Spearman of prediction and truth over (layer, head) pairs, and the share of (layer, head) pairs whose
    top 99 / 176 free rows hold each needle token, by prediction and by truth (docs/methods/kvzap.md)."""
    import numpy as np

    from veloxquant_mlx.evaluation.kvzap_fit import kvzip_plus_rows
    from veloxquant_mlx.evaluation.needle import key_token_spans
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.methods.kvzap.scorer import SHIPPED_DIR, load_scorer
    from veloxquant_mlx.methods.kvzap.fit import log_targets, predict, spearman
    from veloxquant_mlx.models import load_model

    model, tok = load_model()
    scorers = scorers or [str(SHIPPED_DIR / "smollm2-135m.safetensors")]
    for hay in ("grass", "text"):
        toks, pos = make_prompt(tok, hay, 1024, 0.02, "67767")
        needle = [p for s in key_token_spans(tok, toks, pos, "67767") for p in s]
        rows = kvzip_plus_rows(model, tok, toks)  # {layer: (x, true KVzip+ y)}; NaN: sinks, one row per head
        free = np.arange(4, len(toks) - 102)

        def keep_share(scores, picks):  # share of (layer, head) pairs whose top picks hold a needle token
            out = []
            for i, sc in scores.items():
                for h in range(sc.shape[1]):  # a report over a few heads, offline
                    top = set(free[np.argsort(-np.nan_to_num(sc[free, h], nan=-np.inf), kind="stable")][:picks].tolist())
                    out.append(np.mean([t in top for t in needle]))
            return float(np.mean(out))

        truth = {i: log_targets(y) for i, (_, y) in rows.items()}
        print(f"{hay}: {len(toks)} tokens, needle tokens {needle}; KVzip+ itself keeps them in "
              f"{keep_share(truth, 99):.3f} / {keep_share(truth, 176):.3f} of pairs (99 / 176 picks)", flush=True)
        for path in scorers:
            weights = load_scorer(path)[0]
            pred = {i: predict(x, weights[i]) for i, (x, _) in rows.items()}
            rho = []
            for i, (_, y) in rows.items():
                for h in range(y.shape[1]):
                    ok = ~np.isnan(y[:, h])
                    ok[:4] = False
                    rho.append(spearman(pred[i][ok, h], truth[i][ok, h]))
            print(f"  {Path(path).name}: Spearman {np.nanmean(rho):.3f}; keeps the needle in "
                  f"{keep_share(pred, 99):.3f} / {keep_share(pred, 176):.3f} of pairs", flush=True)
    return 0


def main(argv=None):
    args = parse_args(argv)
    if not args.no_fast_blas:
        from veloxquant_mlx.platform.blas import reexec_with_openblas

        reexec_with_openblas(num_threads=1)
    if args.needle_rank:
        return needle_rank(args.scorer)
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    from veloxquant_mlx.evaluation.labels import make_caches, method_specs
    from veloxquant_mlx.platform.blas import blas_info
    from veloxquant_mlx.config import budget_for
    from lab.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.retrieval import prose_text
    from veloxquant_mlx.evaluation.results import load_eval_model

    model, tokenizer, desc = load_eval_model(args.model, quick=False)
    if args.model.startswith("twin:"):
        twin_scorer(model)
    all_tokens = list(tokenizer.encode(prose_text(seed=0)))
    while len(all_tokens) < max(args.contexts):  # a twin's answers mean nothing: repeated prose is enough
        all_tokens += all_tokens
    rows = []
    out = Path(args.out)
    decoders = list(dict.fromkeys(args.decode_methods))
    names = ["plain", *decoders, "rotating"] + ([] if args.no_kvzip else ["kvzip"])

    def summarize(n, budget, pre, dec, host, rounds, widths):
        """The row of one context from the rounds so far, written at once: a run cut short keeps them."""
        med = {k: statistics.median(v) for k, v in pre.items()}
        row = {"context": n, "budget": budget, "rounds": rounds, "decode_tokens": args.decode,
               "prefill_s": pre, "decode_s_per_token": dec,
               "prefill_ratio_vs_plain": {k: med[k] / med["plain"] for k in med if k != "plain"},
               "prefill_ratio_by_round": {k: [a / b for a, b in zip(pre[k], pre["plain"])] for k in pre if k != "plain"},
               # tokens per second method / rotating: >= 1 means the method decodes at least as fast
               **({"decode_speed_vs_rotating": statistics.median(dec["rotating"]) / statistics.median(dec["kvzap"]),
                   "decode_speed_by_round": [b / a for a, b in zip(dec["kvzap"], dec["rotating"])]}
                  if "kvzap" in dec else {}),
               "decode_speed_vs_rotating_by_method": {
                   k: statistics.median(dec["rotating"]) / statistics.median(v) for k, v in dec.items() if k != "rotating"},
               "attended_rows_after_decode": widths,
               "host_build_s_per_token": host}
        done = [x for x in rows if x["context"] != n] + [row]
        rows[:] = done
        print(f"{n} after {rounds} round(s): prefill / plain {row['prefill_ratio_vs_plain']}; decode speed / "
              f"rotating {row['decode_speed_vs_rotating_by_method']}", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"experiment": "kvzap cost", "model": desc, "density": args.density,
                                   "device": str(mx.default_device()), "warmup": args.warmup,
                                   "rows": rows, "provenance": {**provenance(command_line(), labels=["full", *(k for k in names if k not in ("plain", "rotating"))]),
                                   "load_average_at_end": os.getloadavg(), "mlx": mx.__version__,
                                   **blas_info()}}, indent=1))

    for n in args.contexts:
        if len(all_tokens) < n:
            raise SystemExit(f"prose gives {len(all_tokens)} tokens, need {n}")
        tokens, budget = all_tokens[:n], budget_for(args.density, n)

        def build(name):
            if name == "plain":
                return make_prompt_cache(model)
            if name == "rotating":
                return [RotatingKVCache(max_size=budget, keep=4) if type(c) is KVCache else c
                        for c in make_prompt_cache(model)]
            return make_caches(model, method_specs([name])[0], budget)  # a label or a spec

        pre = {k: [] for k in names}
        dec = {k: [] for k in (*decoders, "rotating")}
        host = {k: [] for k in dec}
        widths = {}
        if args.warmup == "short":
            prefill(model, tokens[:256], build("kvzap"), args.prefill_step_size)
        else:
            for name in names:
                caches = build(name)
                _, logits = prefill(model, tokens, caches, args.prefill_step_size)
                if name in dec:
                    decode(model, logits, caches, 4)
                del caches
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                caches = build(name)
                s, logits = prefill(model, tokens, caches, args.prefill_step_size)
                pre[name].append(s)
                if name in dec:
                    per_token, host_per_token = decode(model, logits, caches, args.decode)
                    dec[name].append(per_token)
                    host[name].append(host_per_token)
                    widths[name] = attended_rows(caches)
            print(f"{n} round {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in pre.items()) + "; decode "
                  + ", ".join(f"{k} {v[-1] * 1e3:.1f} ms/tok" for k, v in dec.items()), flush=True)
            summarize(n, budget, pre, dec, host, r + 1, widths)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
