"""Does kvzap's scorer rank the passkey high? For one passkey prompt per haystack (1K, depth 0.02, the
evaluation's key), the share of (layer, KV head) pairs whose predicted score puts each needle token among
the top ``picks`` free rows (not a sink, not in the recent window), for the shipped SmolLM2 scorer.
``picks`` 99 is what budget 205 leaves beside kvzap's window of 102; 176 is what kvzip's window of 25
would leave. A plain forward's hidden states (the hidden-state tap), no eviction.

    python benchmark_scripts/kvzap_needle_rank.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from veloxquant_mlx.platform.blas import reexec_with_openblas

    reexec_with_openblas(num_threads=1)
    import numpy as np

    from veloxquant_mlx.evaluation.kvzap_collect import hidden_states
    from veloxquant_mlx.evaluation.needle import key_token_spans
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.methods.kvzap import SHIPPED_DIR, load_scorer
    from veloxquant_mlx.models import load_model

    model, tok = load_model()
    weights = load_scorer(SHIPPED_DIR / "smollm2-135m.safetensors")[0]
    for hay in ("grass", "text"):
        toks, pos = make_prompt(tok, hay, 1024, 0.02, "67767")
        needle = [p for s in key_token_spans(tok, toks, pos, "67767") for p in s]
        xs = hidden_states(model, toks, sorted(weights))
        free = np.arange(4, len(toks) - 102)
        ranks = []
        for i, (w, b) in weights.items():
            pred = (xs[i] @ np.array(w) + np.array(b)).T
            for h in range(pred.shape[0]):  # a report over a few heads, offline
                order = free[np.argsort(-pred[h, free], kind="stable")]
                where = {int(t): int(np.flatnonzero(order == t)[0]) for t in needle if 4 <= t < len(toks) - 102}
                ranks.append(where)
        for picks in (99, 176):
            share = np.mean([np.mean([r < picks for r in where.values()]) for where in ranks])
            print(f"{hay}: {len(toks)} tokens, needle tokens {needle}: kept by {share:.3f} of (layer, head) "
                  f"pairs with {picks} picks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
