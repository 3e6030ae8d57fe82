"""Thin wrapper: `python benchmark_scripts/eval_passkey.py [--quick] [...]` ==
`python -m veloxquant_mlx [--fast-blas] eval passkey ...` (see `--help`). Results go to ./veloxquant_eval/passkey.json (the
published figures/eval/ with --out-dir figures/eval --publish, which also regenerates docs/results.md)
and the report beside them; finished cells are skipped on a re-run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from veloxquant_mlx.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    pre = ["--fast-blas"] if "--fast-blas" in argv else []
    argv = [a for a in argv if a != "--fast-blas"]
    sys.exit(main(pre + ["eval", "passkey"] + argv))
