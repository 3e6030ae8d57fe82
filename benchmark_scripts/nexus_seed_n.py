"""How much the reservoir's seed moves Nexus's one-shot prompt compression, against n (Eq. 6).

For a few passkey prompts on the bundled model, the prompt is fed as mlx_lm.generate feeds it into
Nexus caches (prompt_eviction="end", 20% budget) and the block weights w of the one-shot
compression are recorded per layer. The selection is then redrawn with many reservoir seeds for
each n (and top-K, n = None) on exactly those weights, and we count how often the layer keeps a
whole occurrence of the key (every block holding one of the two key spans). Output: the mean over
layers of that probability and the seed-to-seed spread of the fraction of layers that keep it.
Cheap: one prompt pass per prompt; the redraws are a batched top-k.

    python benchmark_scripts/nexus_seed_n.py   (re-runs itself with OpenBLAS preloaded, 1 thread)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", nargs="+", default=["grass:0.3", "grass:0.7", "text:0.3", "text:0.7"],
                    help="HAYSTACK:DEPTH (1K tokens, first passkey key)")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--seeds", type=int, default=2000)
    ap.add_argument("--ns", default="1,2,5,20,100,none")
    ap.add_argument("--out", default="figures/eval_v2/nexus_seed_n.json")
    args = ap.parse_args(argv)

    from veloxquant_mlx.platform.blas import describe, reexec_with_openblas

    reexec_with_openblas()  # OpenBLAS (1 thread) preloaded; returns when already preloaded / none installed
    import mlx.core as mx
    import numpy as np

    from veloxquant_mlx.evaluation.results import load_eval_model, make_caches, method_specs, quiet_cache_warnings
    from veloxquant_mlx.evaluation.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.retrieval import key_token_spans, make_keys, make_prompt
    from veloxquant_mlx.evaluation.speed import prefill
    from veloxquant_mlx.methods.nexus.ops import forced_blocks, select_blocks

    quiet_cache_warnings()
    model, tok, desc = load_eval_model("bundled", False)
    key = make_keys(1)[0]
    ns = [None if x == "none" else int(x) for x in args.ns.split(",")]
    spec = method_specs(["nexus"])[0]
    out = {"model": desc, "blas": describe(), "density": args.density, "seeds": args.seeds, "key": key, "prompts": {}}
    t0 = time.time()
    for p in args.prompts:
        hay, depth = p.split(":")
        toks, pos = make_prompt(tok, hay, 1024, float(depth), key)
        spans = key_token_spans(tok, toks, pos, key)
        budget = max(int(round(args.density * len(toks))), 1)
        caches = make_caches(model, spec, budget, seed=0)
        rec = {}
        for li, c in enumerate(caches):
            orig = c.block_weights

            def wrapped(c=c, li=li, orig=orig):
                w = orig()
                if li not in rec:  # the one-shot compression (the first eviction)
                    rec[li] = (w, c._rows, c.budget, c.n_sink, c.recent, c.options.block_size)
                return w

            c.block_weights = wrapped
        prefill(model, mx.array(toks), caches, 2048)
        per_n = {}
        for n in ns:
            whole = []  # (layers, seeds) bool
            for li in sorted(rec):
                w, N, budget_l, n_sink, recent, b = rec[li]
                mask, _, forced_rows = forced_blocks(N, b, n_sink, recent)
                n_keep = int(mask.sum().item()) + max((budget_l - forced_rows) // b, 0)
                need = [sorted({q // b for q in s}) for s in spans]
                S = args.seeds if n is not None else 1
                wt = mx.broadcast_to(w, (S, *w.shape[1:]))
                blocks = np.array(select_blocks(wt, mask, n_keep, n, mx.random.key(li)))  # (S, 1, k)
                kept = [set(r.tolist()) for r in blocks.reshape(S, -1)]
                ok = np.array([any(all(bk in k for bk in nd) for nd in need) for k in kept])
                whole.append(np.broadcast_to(ok, (args.seeds,)))
            whole = np.array(whole)  # (layers, seeds)
            frac = whole.mean(axis=0)  # per seed: fraction of layers keeping a whole key occurrence
            per_n["topk" if n is None else str(n)] = {
                "p_whole_mean_over_layers": round(float(whole.mean()), 4),
                "layers_keeping_whole_frac_mean": round(float(frac.mean()), 4),
                "layers_keeping_whole_frac_sd_over_seeds": round(float(frac.std()), 4),
                "p_seed_keeps_whole_in_every_layer": round(float((frac == 1.0).mean()), 4),
                "p_seed_keeps_whole_in_no_layer": round(float((frac == 0.0).mean()), 4)}
        out["prompts"][p] = {"prompt_tokens": len(toks), "budget": budget, "key_spans": spans, "per_n": per_n}
        print(p, json.dumps(per_n), flush=True)
        out["wall_s"] = round(time.time() - t0, 1)
        out["provenance"] = provenance(command_line(), ["nexus"])
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))  # after every prompt: a cut run keeps its prompts
    print(f"wrote {args.out} ({out['wall_s']} s)")


if __name__ == "__main__":
    main()
