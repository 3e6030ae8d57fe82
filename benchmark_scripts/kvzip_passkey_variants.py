"""KVzip variants on ONE passkey prompt of the evaluation (bundled SmolLM2, 1K tokens, 20 %): which
budget split keeps the needle (per-layer uniform / Ada, recent window off, layers="global", the paper's
global + Ada without floor), with the key tokens' kept fraction. A diagnostic, not a grid.

    python benchmark_scripts/kvzip_passkey_variants.py text 0.7 > figures/kvzip/passkey_text07_variants.txt
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from veloxquant_mlx.platform.blas import reexec_with_openblas  # noqa: E402
reexec_with_openblas(num_threads=1)
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.evaluation.passkey import extract_digits
from veloxquant_mlx.evaluation.results import load_eval_model
from veloxquant_mlx.evaluation.retrieval import make_prompt, shared_prefill_generate, key_token_spans
model, tok, _ = load_eval_model("bundled")
hay, depth = sys.argv[1], float(sys.argv[2])
tokens, pos = make_prompt(tok, hay, 1024, depth, "67767")
b = round(0.2 * len(tokens))
variants = {"kvzip": {}, "kvzip-ada0": dict(allocation="ada", floor_alpha=0.0), "kvzip-ada": dict(allocation="ada"),
            "kvzip-r0": dict(recent=0), "kvzip-global": dict(kvzip_layers="global"),
            "kvzip-global-ada0": dict(kvzip_layers="global", allocation="ada", floor_alpha=0.0)}
named = {}
for k, v in variants.items():
    cfg = KVCacheConfig("snapkv", budget=b) if v is None else KVCacheConfig("kvzip", budget=b, **v)
    named[k] = KVCacheBuilder.for_model(model, cfg)
spans = key_token_spans(tok, tokens, pos, "67767")
out = shared_prefill_generate(model, tokens, named, 10, eos_ids=(tok.eos_token_id,), needle_spans=spans)
for k in ["__full__"] + list(variants):
    r = out[k]
    t = tok.decode(r["tokens"]) if "tokens" in r else r
    print(k, extract_digits(t) == "67767", repr(t[:25]), json.dumps(r.get("needle"))[:300])
