"""Why are kvzip's row scores saturated on Gemma 3 270M? The candidates, one at a time, on passkey prompts.

For every KVzip layer (Gemma 3: the 3 global layers; the 15 sliding layers keep mlx-lm's
RotatingKVCache and are not scored) the reconstruction pass's scoring inputs (the tap's queries, the
chunk's stored keys, the pass's own keys, the softmax scale) are captured and re-scored in numpy:

* **scale**: the scale the tap hands over, against 1/sqrt(head_dim) and query_pre_attn_scalar**-0.5;
* **precision**: the float32 score against a float64 re-computation;
* **soft-capping**: the model's attn_logit_softcapping (None: mlx-lm's Gemma 3 applies none);
* **sinks**: the probability mass on the 4 sink rows and on the pass's own keys, the BOS row's score;
* **copying**: for every row, which reconstruction query gives it its max. A row i whose max comes from
  the query that reads token i-1 (and so predicts token i) is being *copied*: a head that copies every
  row once gives every row a high max, whatever the row is worth later;
* **the window**: the pass input's length against the sliding window;
* **KVzip+** (normalize="plus"): the same quantiles and the needle rows' ranks with KVzap's
  normalisation, read from the cache as it compresses;
* the answers of ``kvzip`` and ``kvzip-plus`` (6 greedy tokens).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/kvzip_saturation_probe.py   # -> figures/kvzip/saturation_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QUANTILES = [0.1, 0.5, 0.9]


def _softmax_ctx(q, ctx, own, scale, np):
    """q (G, S, D), ctx (C, D), own (S, D) -> probabilities over ctx (G, S, C), mass on own keys (G, S)."""
    lc, lo = q @ ctx.T * scale, q @ own.T * scale
    S = q.shape[1]
    lo = np.where(np.tril(np.ones((S, S), bool))[None], lo, -np.inf)
    m = np.maximum(lc.max(-1, keepdims=True), lo.max(-1, keepdims=True))
    z = np.exp(lc - m).sum(-1, keepdims=True) + np.exp(lo - m).sum(-1, keepdims=True)
    return np.exp(lc - m) / z, np.exp(lo - m).sum(-1) / z[..., 0]


def _needle_rows(toks, needle):
    n = len(needle)
    return [i + k for i in range(len(toks) - n + 1) if toks[i:i + n] == needle for k in range(n)]


def _rank(s, np):
    return (-s).argsort().argsort()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--haystack", default="text", choices=("text", "grass"))
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7])
    ap.add_argument("--key", default="67767")
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--out", default=str(ROOT / "figures" / "kvzip" / "saturation_probe.json"))
    a = ap.parse_args(argv)

    from veloxquant_mlx.platform.blas import reexec_with_openblas

    reexec_with_openblas(num_threads=1)
    import mlx.core as mx
    import numpy as np

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.methods.kvzip import cache as kz
    from veloxquant_mlx.evaluation.provenance import command_line, provenance
    from veloxquant_mlx.evaluation.results import load_eval_model, quiet_cache_warnings
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.evaluation.speed import greedy_generate
    from veloxquant_mlx.methods.kvzip.model_pass import PassPrompt

    quiet_cache_warnings()
    model, tok, desc = load_eval_model(a.model)
    args = getattr(model, "args", None)
    config = {k: getattr(args, k, None) for k in ("head_dim", "query_pre_attn_scalar", "sliding_window",
                                                   "sliding_window_pattern", "attn_logit_softcapping",
                                                   "num_attention_heads", "num_key_value_heads")}
    stash, final = [], {}
    score_chunk, compress = kz.KVzipCache._score_chunk, kz.KVzipCache.compress

    def rec_chunk(self, queries, scale):
        lo, hi, _ = self._chunk
        stash.append((self.layer_idx, np.array(queries.astype(mx.float32))[0], float(scale),
                      np.array(self.stored("keys")[:, :, lo:hi].astype(mx.float32))[0],
                      np.array(self._own[0].astype(mx.float32))[0]))
        return score_chunk(self, queries, scale)

    def rec_compress(self, budget=None):
        final[self.layer_idx] = np.array(self.stored("zip_score"))[0][:, :self.offset]
        return compress(self, budget)

    kz.KVzipCache._score_chunk, kz.KVzipCache.compress = rec_chunk, rec_compress
    pp = PassPrompt(tok)
    needle = list(tok.encode(" " + a.key, add_special_tokens=False))
    rows = []
    for depth in a.depths:
        toks, _ = make_prompt(tok, a.haystack, 1024, depth, a.key)
        budget = max(int(round(a.density * len(toks))), 1)
        nrows = _needle_rows(toks, needle)
        row = {"depth": depth, "prompt_tokens": len(toks), "budget": budget, "needle_rows": nrows,
               "pass_input_tokens": len(pp.first) + len(pp.suffix) + len(toks), "layers": {}, "answers": {}}
        for label, extra in (("kvzip", {}), ("kvzip-plus", {"kvzip_normalize": "plus"})):
            stash.clear()
            final.clear()
            caches = KVCacheBuilder.for_model(model, KVCacheConfig("kvzip", budget=budget, **extra), tokenizer=tok)
            out = tok.decode(greedy_generate(model, toks, caches, 6, 2048)["tokens"])
            KVCacheBuilder.uninstall(model)
            kept = {c.layer_idx: sorted(set(np.array(c.kept_positions()[0]).ravel().tolist()) - {-1})
                    for c in caches if isinstance(c, kz.KVzipCache)}
            row["answers"][label] = {"output": out, "correct": a.key in out}
            print(f"depth {depth}: {label:10s} {out!r}", flush=True)
            for layer, s in final.items():
                d = row["layers"].setdefault(str(layer), {})
                rk = _rank(s[0], np)
                d[label] = {"score_quantiles": np.round(np.quantile(s[:, 4:], QUANTILES, axis=-1).T, 4).tolist(),
                            "needle_ranks": [int(rk[i]) for i in nrows],
                            "needle_rows_kept": sum(i in kept[layer] for i in nrows), "rows_kept": len(kept[layer])}
            if label != "kvzip":
                continue
            for layer, q, scale, ctx, own in stash:
                Hq, S, D = q.shape
                H = ctx.shape[0]
                G, C = Hq // H, ctx.shape[1]
                P = S - C  # the repeat prompt's tokens before the context's copy
                d = row["layers"][str(layer)]
                d["scale"] = {"used": scale, "1/sqrt(head_dim)": D ** -0.5,
                              "query_pre_attn_scalar**-0.5": (config["query_pre_attn_scalar"] or D) ** -0.5}
                heads = []
                for h in range(H):
                    qg = q[h * G:(h + 1) * G].astype(np.float64)
                    p, own_mass = _softmax_ctx(qg, ctx[h].astype(np.float64), own[h].astype(np.float64), scale, np)
                    s64 = p.max(axis=(0, 1))
                    p32, _ = _softmax_ctx(q[h * G:(h + 1) * G], ctx[h], own[h], np.float32(scale), np)
                    arg_q = p.max(0).argmax(0)
                    lag = arg_q - P - np.arange(C)  # -1: the query that reads token i-1 gives row i its max
                    heads.append({
                        "fp32_vs_fp64_max_abs_diff": float(np.abs(p32.max(axis=(0, 1)) - s64).max()),
                        "frac_rows_max_from_copy_query": round(float(np.mean(lag[4:] == -1)), 4),
                        "sink_mass_mean": round(float(p[..., :4].sum(-1).mean()), 4),
                        "own_keys_mass_mean": round(float(own_mass.mean()), 4),
                        "bos_row_score": round(float(s64[0]), 4)})
                d["plain_rescored"] = heads
        for layer, d in sorted(row["layers"].items()):
            print(f"depth {depth}: layer {layer}: " + json.dumps(d), flush=True)
        rows.append(row)
    scored = sorted(int(k) for k in rows[0]["layers"]) if rows else []
    out = {"experiment": "kvzip saturation probe", "model": desc, "model_config": config, "haystack": a.haystack,
           "key": a.key, "density": a.density, "scored_layers": scored, "n_layers": len(model.layers),
           "repeat_prompt": tok.decode(pp.first + pp.suffix), "chat_template_suffix_tokens": len(pp.suffix),
           "rows": rows, "provenance": provenance(command_line(), ["kvzip", "kvzip[normalize='plus']"])}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
