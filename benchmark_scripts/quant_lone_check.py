"""Lone runs of quantized passkey cells (exactly what mlx_lm.generate computes: each cache alone, mlx-lm's
quantized attention from the first chunk on), compared with the same cells of a shared-pass file.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/quant_lone_check.py \
        --against figures/eval/quant/passkey_paired.json --out figures/eval/quant/lone_check.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

CELLS = [("grass", 0.1, "nexus-reservoir-4bit"), ("grass", 0.1, "nestedkv-4bit"), ("grass", 0.02, "nexus-reservoir-4bit"),
         ("text", 0.02, "nexus-reservoir-4bit")]  # the Nexus cells ran the reservoir default of the time


def main(argv=None) -> int:
    from veloxquant_mlx.evaluation.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.results import load_eval_model, make_caches, method_specs
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.evaluation.speed import greedy_generate

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="figures/eval/quant/passkey_paired.json")
    ap.add_argument("--out", default="figures/eval/quant/lone_check.json")
    ap.add_argument("--key", default="67767")
    a = ap.parse_args(argv)
    shared = {(c["haystack"], c["depth"], c["key"], c["method"]): c
              for c in json.loads(Path(a.against).read_text())["cells"].values()
              if isinstance(c, dict) and "output" in c and c.get("density") in (0.2, None)}
    model, tok, _ = load_eval_model("bundled")
    rows = []
    for hay, depth, label in CELLS:
        toks, _ = make_prompt(tok, hay, 1024, depth, a.key)
        t = time.time()
        r = greedy_generate(model, toks, make_caches(model, method_specs([label])[0], max(int(round(0.2 * len(toks))), 1)),
                            8, 2048)
        s = shared.get((hay, depth, a.key, label), {})
        rows.append({"haystack": hay, "depth": depth, "key": a.key, "method": label, "lone_output": tok.decode(r["tokens"]),
                     "lone_kv_bytes_end": r["kv_bytes_end"], "shared_output": s.get("output"),
                     "shared_kv_bytes_end": s.get("kv_bytes_end"), "shared_quant_prefill": s.get("quant_prefill"),
                     "lone_s": round(time.time() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).write_text(json.dumps({"rows": rows, "provenance": provenance(command_line(), [c[2] for c in CELLS])},
                                      indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
