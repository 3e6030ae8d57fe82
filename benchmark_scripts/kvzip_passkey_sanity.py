"""A quick real-model sanity check of kvzip (not a test, not the quality grid): passkey prompts of the
evaluation (``veloxquant_mlx.evaluation.retrieval.make_prompt``) on the bundled SmolLM2-135M, whole
prompt (question included) compressed to ``--density`` of its length, greedy decode; the needle found
by the full cache and by kvzip (one shared prefill per prompt, as the evaluation does).

    python benchmark_scripts/kvzip_passkey_sanity.py        # -> figures/kvzip/passkey_sanity.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CELLS = [("grass", 0.1), ("text", 0.3), ("grass", 0.5), ("text", 0.7), ("grass", 0.9)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--key", default="67767")
    p.add_argument("--methods", nargs="+", default=["kvzip"])
    p.add_argument("--out", default=str(ROOT / "figures" / "kvzip" / "passkey_sanity.json"))
    args = p.parse_args(argv)
    from veloxquant_mlx.platform.blas import reexec_with_openblas

    reexec_with_openblas(num_threads=1)
    from veloxquant_mlx.evaluation.passkey import extract_digits
    from veloxquant_mlx.evaluation.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.results import load_eval_model, make_caches, method_specs
    from veloxquant_mlx.evaluation.retrieval import make_prompt, shared_prefill_generate

    model, tok, desc = load_eval_model("bundled")
    specs = method_specs(args.methods)
    rows = []
    for hay, depth in CELLS:
        tokens, pos = make_prompt(tok, hay, args.context, depth, args.key)
        budget = max(int(round(args.density * len(tokens))), 16)
        named = {s.name: make_caches(model, s, budget) for s in specs}
        t0 = time.perf_counter()
        out = shared_prefill_generate(model, tokens, named, 12, eos_ids=(tok.eos_token_id,))
        row = {"haystack": hay, "depth": depth, "tokens": len(tokens), "needle_pos": pos, "budget": budget,
               "seconds": time.perf_counter() - t0}
        for name, r in [("full", out["__full__"])] + [(s.name, out[s.name]) for s in specs]:
            text = tok.decode(r["tokens"]) if "tokens" in r else r.get("error", "")
            row[name] = {"text": text, "found": extract_digits(text) == args.key}
        rows.append(row)
        print(hay, depth, {k: (v["found"], v["text"][:30]) for k, v in row.items() if isinstance(v, dict)},
              flush=True)
    summary = {name: sum(r[name]["found"] for r in rows) for name in ["full"] + [s.name for s in specs]}
    res = {"experiment": "kvzip passkey sanity", "model": desc, "context": args.context, "density": args.density,
           "key": args.key, "rows": rows, "found": summary, "of": len(rows),
           "provenance": provenance(command_line(), labels=["full"] + [s.name for s in specs])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print("found:", summary, "of", len(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
