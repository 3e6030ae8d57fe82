"""Why does KVzip lose prose needles on Gemma 3 270M? Probes on one or more passkey prompts.

1. **Does the model reconstruct?** A plain mlx-lm forward of (repeat prompt + context) over the
   prompt's own ``KVCache``: the fraction of context tokens predicted exactly (teacher forcing). If
   the model cannot copy, the reconstruction's attention means little.
2. **How sharp are the scores?** Quantiles of every row's reconstruction score per layer and KV
   head, read as the default ``kvzip`` cache compresses (before it evicts). A score near 1 for most
   rows means the pass attended to nearly every row once (copying), so the ranking says little.
3. **What do the caches answer?** ``kvzip`` at several budgets and settings (the one-pass and the
   two-pass attention, per-layer uniform budgets, a longer recent window) next to ``nexus`` and
   ``nestedkv``, 6 greedy tokens each, through the evaluation's generate path.

    python benchmark_scripts/kvzip_gemma_probe.py                      # -> figures/kvzip/gemma_probe.json
    python benchmark_scripts/kvzip_gemma_probe.py --model bundled --out /tmp/smollm2_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = [  # (name, method, density, extra KVCacheConfig fields)
    ("kvzip", "kvzip", 0.2, {}),
    ("kvzip two passes", "kvzip", 0.2, {"kvzip_pass_attention": "separate"}),
    ("kvzip per-layer uniform", "kvzip", 0.2, {"kvzip_layers": "each", "allocation": "uniform"}),
    ("kvzip recent=128", "kvzip", 0.2, {"recent": 128}),
    ("kvzip 40 %", "kvzip", 0.4, {}),
    ("nexus", "nexus", 0.2, {}),
    ("nestedkv", "nestedkv", 0.2, {}),
]


QUANTILES = [0.1, 0.5, 0.9, 0.99]


def _recording(cache, sink: list, np):
    """Wrap one cache's ``compress`` to append its rows' score quantiles per head to ``sink``."""
    original = cache.compress

    def compress(*args, **kwargs):
        s = np.array(cache.stored("zip_score"))[0][:, :cache.offset]  # (heads, rows) before eviction
        sink.append(np.round(np.quantile(s, QUANTILES, axis=-1).T, 4).tolist())
        return original(*args, **kwargs)

    return compress


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--haystack", default="text", choices=("text", "grass"))
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5])
    ap.add_argument("--key", default="67767")
    ap.add_argument("--out", default=str(ROOT / "figures" / "kvzip" / "gemma_probe.json"))
    a = ap.parse_args(argv)

    from veloxquant_mlx.platform.blas import reexec_with_openblas

    reexec_with_openblas(num_threads=1)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.evaluation.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.methods.kvzip.cache import KVzipCache
    from veloxquant_mlx.evaluation.speed import greedy_generate
    from veloxquant_mlx.methods.kvzip.model_pass import PassPrompt

    quiet_cache_warnings()
    model, tok, desc = load_eval_model(a.model)
    pp = PassPrompt(tok)
    rows = []
    for depth in a.depths:
        toks, _ = make_prompt(tok, a.haystack, 1024, depth, a.key)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(toks)[None], cache=cache))
        head = pp.first + pp.suffix
        pred = np.array(mx.argmax(model(mx.array(head + toks)[None], cache=cache)[0], axis=-1))
        copy = float((pred[len(head) - 1:len(head) - 1 + len(toks)] == np.array(toks)).mean())
        row = {"depth": depth, "prompt_tokens": len(toks), "copy_accuracy": round(copy, 4), "answers": {},
               "score_quantiles": {"q": QUANTILES, "per_layer": []}}
        seen = row["score_quantiles"]["per_layer"]
        for name, method, density, extra in VARIANTS:
            cfg = KVCacheConfig(method, budget=max(int(round(density * len(toks))), 1), **extra)
            caches = KVCacheBuilder.for_model(model, cfg, tokenizer=tok)
            if name == "kvzip":  # record the scores each layer compresses by, before it evicts
                for c in caches:
                    if isinstance(c, KVzipCache):
                        c.compress = _recording(c, seen, np)
            out = tok.decode(greedy_generate(model, toks, caches, 6, 2048)["tokens"])
            KVCacheBuilder.uninstall(model)
            row["answers"][name] = {"output": out, "correct": a.key in out}
            print(f"depth {depth}: {name:24s} {out!r}", flush=True)
        print(f"depth {depth}: copy accuracy of the reconstruction {copy:.3f}", flush=True)
        for i, q in enumerate(seen):
            print(f"depth {depth}: kvzip layer {i} score quantiles {QUANTILES} per head: {q}", flush=True)
        rows.append(row)
    out = {"experiment": "kvzip probe", "model": desc, "haystack": a.haystack, "key": a.key,
           "repeat_prompt": tok.decode(pp.first + pp.suffix), "rows": rows,
           "provenance": provenance(command_line(), ["full", "kvzip", "kvzip-each", "nexus", "nestedkv"])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
