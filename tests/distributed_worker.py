"""One rank of the distributed checks (run by tests/test_distributed.py under ``mlx.launch``).

Every rank builds the same tiny random model twice: one copy stays whole (the single-process
reference, run on this rank alone) and one is split over the group (``model.shard`` for tensor
parallel, ``model.model.pipeline`` for pipeline parallel). For every case it generates greedily with
both and records, per case: the tokens of both runs, whether this rank's kept positions equal the
reference's rows for this rank's heads (or layers), the evictions and the bytes the caches exchanged.
A third run on the split model with ``group=False`` (caches that ignore the other ranks) shows what
a rank that does not combine its selection with the others would keep.

Usage: distributed_worker.py OUT_DIR   (runs tensor/llama, tensor/qwen3, pipeline/qwen2, 4-bit rows and the
paged prompt on tensor/llama)
"""

from __future__ import annotations

import json
import os
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, methods
from veloxquant_mlx.distributed import traffic
from veloxquant_mlx.options import small_options
from veloxquant_mlx.registry import get_method

from conftest import fit_tiny_scorer, forbid_host_sync, make_tiny_model

VOCAB = 128
PROMPT, DECODE, CHUNK = 64, 12, 32  # prompt chunks of 32: eviction during the prompt and in decode
# Cases also run on the split model with group=False (a rank that ignores the others): a head-combining
# selection must then differ from one process's, which shows the comparison can see a divergence.
NAIVE = ("nestedkv", "random", "h2o-ada", "nexus-topk", "h2o")


def make_model(arch: str, seed: int = 0):
    """Tiny fp32 model: 8 query heads, 4 KV heads (GQA 2), head_dim 16, 2 layers (2 KV heads per rank);
    "llama-hd32": head_dim 32, so quantized rows fit 32-element groups."""
    if arch == "llama-hd32":
        mx.random.seed(seed)
        model = llama.Model(llama.ModelArgs(
            model_type="llama", tie_word_embeddings=False, head_dim=32, hidden_size=128, num_hidden_layers=2,
            intermediate_size=128, num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
            vocab_size=VOCAB, max_position_embeddings=4096))
        mx.eval(model.parameters())
        fit_tiny_scorer(model)  # kvzap's scorer for this model (conftest)
        return model
    return make_tiny_model(arch, seed=seed, heads=8, kv_heads=4)


def cases(kind: str, arch: str):
    """(name, config or None for mlx-lm's KVCache)."""
    small = dict(budget=48, n_sink=4, seed=3, prompt_eviction="stream")
    # Every registered method with its own small= options (a new method joins without edits here).
    opts = {m: {f"{m}_{k}": v for k, v in small_options(get_method(m).Options).items()} for m in methods()}
    if kind == "tensor-q4":  # 4-bit kept rows (config.kv_bits), every method and the Ada variants
        q = dict(small, kv_bits=4, kv_group_size=32)
        out = [(m, KVCacheConfig(m, **q, **opts[m])) for m in methods()]
        out += [(m + "-ada", KVCacheConfig(m, allocation="ada", **q, **opts[m])) for m in ("nexus", "h2o")]
        return out + [("nestedkv-end", KVCacheConfig("nestedkv", budget=48, seed=3, nestedkv_window=16,
                                                     kv_bits=4, kv_group_size=32))]
    if kind == "tensor-offload":  # the paged prompt on 2 ranks; run() compares it with one process under "end"
        paged = dict(small, prompt_eviction="offload", page_block=16)
        return [(m, KVCacheConfig(m, **paged, **opts[m])) for m in methods()]
    out = [("full", None), ("nexus-no-eviction", KVCacheConfig("nexus", budget=512, seed=3, **opts["nexus"]))]
    for m in methods():
        out.append((m, KVCacheConfig(m, **small, **opts[m])))
    if kind == "pipeline":
        return [c for c in out if c[0] in ("full", "nexus", "pyramidkv", "random", "h2o")]
    ada = [m for m in methods() if get_method(m).supports_allocation("ada")] if arch == "llama" else ["nexus"]
    for m in ada:
        out.append((m + "-ada", KVCacheConfig(m, allocation="ada", **small, **opts[m])))
    if arch != "llama":
        return out
    out += [("nexus-per-head", KVCacheConfig("nexus", nexus_per_head=True, **small, **opts["nexus"])),
            ("nexus-vectors", KVCacheConfig("nexus", nexus_head_average="vectors", **small, **opts["nexus"])),
            ("nexus-topk", KVCacheConfig("nexus", nexus_n_samples=None, **small, **opts["nexus"])),
            ("nexus-prior", KVCacheConfig("nexus", nexus_key_prior=0.5, **small, **opts["nexus"])),
            ("nestedkv-end", KVCacheConfig("nestedkv", budget=48, seed=3, **opts["nestedkv"]))]
    return out


def generate(model, prompt, caches):
    toks, lps = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=DECODE, prompt_cache=caches,
                                 prefill_step_size=CHUNK):
        toks.append(int(tok))
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, np.stack(lps)


def kept(caches):
    """Per layer: (H, rows) kept positions of batch row 0, -1 for padding (None for KVCache)."""
    return [np.array(c.kept_positions()[0]) if hasattr(c, "kept_positions") else None for c in caches]


def same_rows(a, b) -> bool:
    """Same set of kept positions per head (ragged widths may differ only by padding)."""
    if a.shape[0] != b.shape[0]:
        return False
    return all(np.array_equal(np.sort(a[h][a[h] >= 0]), np.sort(b[h][b[h] >= 0])) for h in range(a.shape[0]))


def syncs_in_hot_path(model, prompt, config) -> dict:
    """Prompt chunks and decode steps through the split model with every host sync patched to raise:
    the collectives are lazy graph nodes, so uniform-storage methods must run without one."""
    caches = build(model, config)
    x = mx.array(prompt)[None]
    try:
        with forbid_host_sync():
            for s in range(0, PROMPT, CHUNK):
                model(x[:, s:s + CHUNK], cache=caches)
            for _ in range(DECODE):
                out = model(x[:, -1:], cache=caches)
        clean = True
    except AssertionError:
        clean = False
    else:
        mx.eval(out, [c.state for c in caches])
    return {"clean": clean, "evictions": [c.evictions for c in caches], "traffic": traffic(caches)}


def build(model, config, group=None):
    if config is None:
        return [KVCache() for _ in model.layers]
    return KVCacheBuilder.for_model(model, config, group=group)


def run(kind, arch, group):
    rank = group.rank()
    ref_model, model = make_model(arch), make_model(arch)
    if kind.startswith("tensor"):
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    start = model.model.start_idx if kind == "pipeline" else 0
    prompt = np.random.default_rng(7).integers(0, VOCAB, size=PROMPT).tolist()
    results, full_lps = {}, None
    for name, config in cases(kind, arch):
        # the paged prompt is held to "end"'s rows and tokens: its reference holds the prompt whole
        ref_config = config.replace(prompt_eviction="end") if kind == "tensor-offload" else config
        ref_caches = build(ref_model, ref_config, group=False)
        ref_toks, ref_lps = generate(ref_model, prompt, ref_caches)
        caches = build(model, config)
        toks, lps = generate(model, prompt, caches)
        naive = build(model, config, group=False) if name in NAIVE and kind == "tensor" and arch == "llama" else None
        naive_toks = generate(model, prompt, naive)[0] if naive is not None else None
        ref_kept = kept(ref_caches)
        r = {"ref_tokens": ref_toks, "tokens": toks, "naive_tokens": naive_toks,
             "max_logprob_diff": float(np.abs(lps - ref_lps).max()), "traffic": traffic(caches)}
        if config is None:
            full_lps = lps
        elif full_lps is not None and lps.shape == full_lps.shape:  # the split model with this cache vs with mlx-lm's KVCache
            r["logprob_diff_vs_kvcache"] = float(np.abs(lps - full_lps).max())
        if config is not None:
            h_l = [c.positions.shape[1] for c in caches]
            if kind.startswith("tensor"):  # this rank's heads of every layer
                want = [k[rank * h:(rank + 1) * h] for k, h in zip(ref_kept, h_l)]
            else:  # this rank's layers, all heads
                want = ref_kept[start:start + len(caches)]
            r["kept_equal"] = all(same_rows(a, b) for a, b in zip(kept(caches), want))
            if naive is not None:
                r["naive_kept_equal"] = all(same_rows(a, b) for a, b in zip(kept(naive), want))
            r["evictions"] = [c.evictions for c in caches]
            r["ref_evictions"] = [c.evictions for c in ref_caches]
            r["layer_idx"] = [c.layer_idx for c in caches]
            r["tokens_seen"] = caches[0].offset
            r["kept_all"] = all(bool((k >= 0).sum(axis=-1).min() == caches[0].offset) for k in kept(caches))
            r["nbytes"] = sum(c.nbytes for c in caches)
            r["ref_nbytes"] = sum(c.nbytes for c in ref_caches)
        results[name] = r
    if kind == "tensor":
        results["hot_path"] = {name: syncs_in_hot_path(model, prompt, config)
                               for name, config in cases(kind, arch) if name in ("nexus", "random", "nexus-per-head")}
    return results


def batched_checks(group) -> dict:
    """mlx-lm's batch_generate (BatchEvictionCache of per-row caches) on the split model against each
    prompt generated alone by one process."""
    from mlx_lm.generate import batch_generate

    from conftest import tiny_tokenizer

    ref_model, model = make_model("llama"), make_model("llama")
    model.shard(group)
    mx.eval(model.parameters())
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (56, 40)]
    out = {}
    for name, config in cases("tensor", "llama"):
        if name not in ("nexus", "h2o-ada", "kvzip-ada"):
            continue
        alone = [generate(ref_model, p, KVCacheBuilder.for_model(ref_model, config, group=False))[0][:8]
                 for p in prompts]
        KVCacheBuilder.install(model, config)
        try:
            res = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=8, prefill_step_size=CHUNK,
                                 return_token_ids=True)
        finally:
            KVCacheBuilder.uninstall(model)
        got = [list(t) for t in getattr(res, "token_ids", None) or []]
        out[name] = {"alone": alone, "batched": got}
    return out


def top_k_checks(group) -> dict:
    """HeadShard.top_k_mask over 2 ranks against one process's stable argsort ranking of all heads,
    on scores with many ties (and -0.0 next to 0.0), an int k and a per-batch-row k."""
    from veloxquant_mlx.caches.shard import HeadShard

    d, rng, bad, n = HeadShard(group), np.random.default_rng(11), [], 0
    for trial in range(6):
        B, H, R = 2, 4, int(rng.integers(3, 30))
        s = (rng.integers(-4, 4, size=(B, H, R)) * 0.25).astype(np.float32)
        s[0, 0, :2] = -0.0
        mem = rng.random((B, H, R)) < 0.8
        S = mx.where(mx.array(mem), mx.array(s), -mx.inf)
        rank = mx.argsort(mx.argsort(-S.reshape(B, H * R), axis=-1), axis=-1).reshape(B, H, R)
        for k in (int(rng.integers(0, H * R + 2)), mx.array(rng.integers(0, H * R, size=(B,)).astype(np.int32))):
            want = (rank < (k if isinstance(k, int) else k[:, None, None])) & mx.array(mem)
            h = H // group.size()
            sl = slice(group.rank() * h, (group.rank() + 1) * h)
            got = d.top_k_mask(mx.array(s[:, sl]), mx.array(mem[:, sl]), k)
            n += 1
            if not np.array_equal(np.array(got), np.array(want[:, sl])):
                bad.append(trial)
    return {"checked": n, "bad": bad}


def main():
    out_dir = sys.argv[1]
    group = mx.distributed.init()
    runs = {f"{kind}/{arch}": run(kind, arch, group)
            for kind, arch in (("tensor", "llama"), ("tensor", "qwen3"), ("pipeline", "qwen2"),
                               ("tensor-q4", "llama-hd32"), ("tensor-offload", "llama"))}
    runs["top_k"] = top_k_checks(group)
    try:
        runs["batched"] = batched_checks(group)
    except Exception as e:  # reported (and failed) by the test, the other checks still come back
        runs["batched"] = {"error": f"{type(e).__name__}: {e}"}
    with open(os.path.join(out_dir, f"rank{group.rank()}.json"), "w") as f:
        json.dump({"rank": group.rank(), "size": group.size(), "runs": runs}, f)


if __name__ == "__main__":
    main()
