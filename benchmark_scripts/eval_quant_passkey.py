"""Passkey with quantized kept rows (issue 22): 20 % at fp / 8-bit / 4-bit, paired on the same prompts,
plus the equal-memory curve (one method at several densities at each row storage).

Two stages on the published 1K grid (grass and text haystacks, depths 0.02..0.98, 3 keys):
  A  20 %: full, nexus, nestedkv, snapkv, each as fp, -8bit and -4bit rows (full-*bit: mlx-lm's own
     QuantizedKVCache, no eviction);
  B  (--curve) the curve method at --curve-densities, fp / -8bit / -4bit.
Every prompt gets one shared prefill pass per row storage (fp, 8-bit, 4-bit); --spread order keeps
a run cut short by --time-budget balanced over depths and haystacks. Resumable: rerun to add prompts.

  python -m veloxquant_mlx --fast-blas eval passkey ...   (the CLI, one stage)
  python benchmark_scripts/eval_quant_passkey.py --model bundled --out-dir figures/eval/quant \
      --out-name passkey_paired.json --curve nestedkv --time-budget 1800
  python benchmark_scripts/eval_quant_passkey.py --model bundled --out-dir figures/eval/quant \
      --out-name passkey_g32.json --methods full nexus nestedkv --bits=-4bit-g32 --dequantized-prefill
  (a suffix that starts with "-" needs the = form)
"""

from __future__ import annotations

import sys

from veloxquant_mlx.platform.blas import reexec_with_openblas

BITS = ("", "-8bit", "-4bit")
DEPTHS_25 = [round(0.02 + 0.04 * i, 2) for i in range(25)]
DEPTHS_13 = [round(0.02 + 0.08 * i, 2) for i in range(13)]


def plan(methods, curve, curve_densities, depths, bits=BITS):
    base = {"contexts": [1024], "haystacks": ["grass", "text"], "regimes": ["prefill"], "depths": depths,
            "n_keys": 3, "seeds": [0]}
    stages = [{**base, "name": "A: 20%, fp / 8-bit / 4-bit", "densities": [0.2],
               "methods": [m + b for m in methods for b in bits]}]
    if curve:
        stages.append({**base, "name": "B: equal-memory curve", "densities": list(curve_densities),
                       "methods": [curve + b for b in bits]})
    return stages


def main(argv=None) -> int:
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.eval import _md_path
    from veloxquant_mlx.evaluation import retrieval
    from veloxquant_mlx.evaluation.report import write_report

    import argparse

    own = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    own.add_argument("--methods", nargs="+", default=["full", "nexus", "nestedkv", "snapkv"])
    own.add_argument("--bits", nargs="+", default=list(BITS), help="label suffixes: '' -8bit -4bit -4bit-g32 ...")
    own.add_argument("--curve", default=None, help="method for the equal-memory curve (stage B)")
    own.add_argument("--curve-densities", nargs="+", type=float, default=[0.1, 0.35, 0.5])
    own.add_argument("--depths", choices=("25", "13"), default="25", help="the SmolLM2 (25) or Gemma (13) grid")
    own.add_argument("--dequantized-prefill", action="store_true",
                     help="quantized passes read the stored rows dequantized through float attention (faster on "
                          "the CPU, not what a lone mlx_lm.generate run computes; cells say quant_prefill)")
    a, rest = own.parse_known_args(argv)
    stages = plan(a.methods, a.curve, a.curve_densities, DEPTHS_25 if a.depths == "25" else DEPTHS_13, a.bits)
    labels = list(dict.fromkeys(m for st in stages for m in st["methods"]))
    args = build_parser().parse_args(["eval", "passkey", "--spread", "--max-new-tokens", "8", *rest,
                                      "--methods", *labels])
    args.plan = stages
    args.dequantized_prefill = a.dequantized_prefill
    rc = retrieval.run(args)
    if not args.no_report:
        write_report(args.out_dir, _md_path(args))
    return rc


if __name__ == "__main__":
    reexec_with_openblas()
    sys.exit(main())
