"""Why our SnapKV / PyramidKV keep more needles than kvpress's (issue 21): the observation window and
the pooling kernel, one at a time, on the 20 prompts of the kvpress side by side (bundled SmolLM2, 1K,
20 %, one shared prefill per prompt). Ours: window 32, max-pool kernel 7; kvpress: window 64,
average-pool kernel 5.

    python benchmark_scripts/kvpress_window_pool_variants.py   # -> figures/kvpress/pooling_variants.json
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from veloxquant_mlx.platform.blas import reexec_with_openblas

reexec_with_openblas(num_threads=1)
from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.evaluation.passkey import extract_digits
from veloxquant_mlx.evaluation.provenance import command_line, provenance
from veloxquant_mlx.evaluation.results import load_eval_model
from veloxquant_mlx.evaluation.retrieval import make_prompt, shared_prefill_generate

model, tok, _ = load_eval_model("bundled")
V = {"snapkv-w64": ("snapkv", dict(snapkv_window=64)), "snapkv-k1": ("snapkv", dict(snapkv_kernel=1)),
     "pyramidkv-w64": ("pyramidkv", dict(pyramidkv_window=64)), "pyramidkv-k1": ("pyramidkv", dict(pyramidkv_kernel=1)),
     "snapkv-k5": ("snapkv", dict(snapkv_kernel=5)), "pyramidkv-k5": ("pyramidkv", dict(pyramidkv_kernel=5))}
res = {}
for d in [0.02, 0.82, 0.42, 0.22, 0.62, 0.1, 0.94, 0.54, 0.3, 0.74]:
    for hay in ("grass", "text"):
        tokens, _ = make_prompt(tok, hay, 1024, d, "67767")
        b = round(0.2 * len(tokens))
        named = {k: KVCacheBuilder.for_model(model, KVCacheConfig(m, budget=b, **kw)) for k, (m, kw) in V.items()}
        out = shared_prefill_generate(model, tokens, named, 8, eos_ids=(tok.eos_token_id,))
        for k in V:
            res.setdefault(k, {})[f"{hay}:{d}"] = extract_digits(tok.decode(out[k]["tokens"])) == "67767"
        print(d, hay, {k: res[k][f"{hay}:{d}"] for k in V}, flush=True)
        out = {"variants": {k: [m, kw] for k, (m, kw) in V.items()}, "correct": res,
               "provenance": provenance(command_line(), ["snapkv", "pyramidkv"])}
        (ROOT / "figures" / "kvpress" / "pooling_variants.json").write_text(json.dumps(out, indent=1))
