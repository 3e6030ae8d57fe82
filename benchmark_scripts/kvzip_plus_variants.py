"""Single-prompt kvzip variants on passkey prompts (scratch evidence, not a grid): the default, KVzip+
(plus), the BOS left out of the reconstructed text (nobos), per-layer uniform budgets (each), no recent
window (r0), 512-token reconstruction chunks (c512), 6 greedy tokens each.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/kvzip_plus_variants.py gemma3-270m kvzip,plus,nobos 0.1,0.5
"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.methods.kvzip import model_pass as mp
from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings
from veloxquant_mlx.evaluation.retrieval import make_prompt
from veloxquant_mlx.evaluation.speed import greedy_generate
quiet_cache_warnings()
name = sys.argv[1]; variants = sys.argv[2].split(","); depths = [float(x) for x in sys.argv[3].split(",")]
hay = sys.argv[4] if len(sys.argv) > 4 else "text"
model, tok, desc = load_eval_model(name)
orig_parts = mp.chunk_parts
def nobos_parts(prompt, take, lo, hi, overlap):
    parts = orig_parts(prompt, take, lo, hi, overlap)
    if lo == 0:
        parts[-1] = take(1, hi)
    return parts
V = {"kvzip": {}, "plus": {"kvzip_normalize": "plus"}, "nobos": {}, "plus_nobos": {"kvzip_normalize": "plus"},
     "each": {"kvzip_layers": "each", "allocation": "uniform"}, "plus_r0": {"kvzip_normalize": "plus", "recent": 0}, "r0": {"recent": 0}, "plus_c512": {"kvzip_normalize": "plus", "kvzip_chunk": 512}, "plus_each": {"kvzip_normalize": "plus", "kvzip_layers": "each", "allocation": "uniform"}}
for d in depths:
    toks, _ = make_prompt(tok, hay, 1024, d, "67767")
    line = []
    for v in variants:
        mp.chunk_parts = nobos_parts if "nobos" in v else orig_parts
        cfg = KVCacheConfig("kvzip", budget=int(round(0.2 * len(toks))), **V[v])
        caches = KVCacheBuilder.for_model(model, cfg, tokenizer=tok)
        t = time.time()
        out = tok.decode(greedy_generate(model, toks, caches, 6, 2048)["tokens"]); KVCacheBuilder.uninstall(model)
        line.append(f"{v}={'OK' if '67767' in out else 'no'} {out!r} ({time.time()-t:.0f}s)")
    print(f"{hay} depth {d}: " + " | ".join(line), flush=True)
