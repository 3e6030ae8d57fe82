"""Which Gemma 3 global layer does the passkey answer need? kvzip (default) with the needle rows' scores
forced to the top in one layer at a time (an oracle, not a method), on prose passkey prompts.

    python -m veloxquant_mlx.platform.blas benchmark_scripts/kvzip_needle_layer_oracle.py 0.3,0.5
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlx.core as mx

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.methods.kvzip.cache import KVzipCache
from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings
from veloxquant_mlx.evaluation.retrieval import make_prompt
from veloxquant_mlx.evaluation.speed import greedy_generate

quiet_cache_warnings()
model, tok, desc = load_eval_model("gemma3-270m")
orig = KVzipCache.compress
FORCE = set()
NEEDLE = []


def comp(self, budget=None):
    if self.layer_idx in FORCE:
        s = self.row_extras["zip_score"]
        idx = mx.array(NEEDLE)
        s[:, :, idx] = 10.0
        self.row_extras["zip_score"] = s
    return orig(self, budget)


KVzipCache.compress = comp
needle = tok.encode(" 67767", add_special_tokens=False)
for d in [float(x) for x in sys.argv[1].split(",")]:
    toks, _ = make_prompt(tok, "text", 1024, d, "67767")
    NEEDLE[:] = [i + k for i in range(len(toks)) if toks[i:i + len(needle)] == needle for k in range(-1, len(needle))]
    line = []
    for force in [(), (5,), (11,), (17,), (5, 11, 17)]:
        FORCE.clear(); FORCE.update(force)
        caches = KVCacheBuilder.for_model(model, KVCacheConfig("kvzip", budget=int(round(0.2 * len(toks)))), tokenizer=tok)
        out = tok.decode(greedy_generate(model, toks, caches, 6, 2048)["tokens"]); KVCacheBuilder.uninstall(model)
        line.append(f"force{force}={'OK' if '67767' in out else 'no'} {out!r}")
    print(f"depth {d} needle rows {NEEDLE}: " + " | ".join(line), flush=True)
