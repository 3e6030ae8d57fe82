"""Recall under mx.distributed: two tensor-parallel ranks (mlx.launch --backend ring -n 2) equal one
process. Each rank holds the cold tier of its own KV heads; the ranks and a whole-model reference run
the same two turns (a prompt that evicts, a follow-up that recalls) and must generate the same tokens
and keep, hot and cold, exactly the reference's rows for the rank's heads.

This file is also the rank's script: ``python tests/test_recall_distributed.py OUT_DIR``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest

PROMPT, FOLLOW, DECODE, CHUNK = 64, 16, 6, 32


def cases():
    from conftest import small_config

    base = dict(budget=24, n_sink=4, recent=8, seed=3, recall_page=8, recall_pages=2)
    out = {}
    for m in ("snapkv", "nexus", "h2o", "pyramidkv"):
        for tier in ("memory", "disk"):
            extra = {"recall_dir": tempfile.gettempdir()} if tier == "disk" else {}
            out[f"{m}-{tier}"] = small_config(m, recall=tier, **base, **extra)
    out["snapkv-memory-every3"] = small_config("snapkv", recall="memory", recall_every=3, **base)
    return out


def two_turns(model, caches, prompt, follow):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    toks, lps = [], []
    for turn in (prompt, follow):
        for c in caches:
            c.continue_on_purpose()
        for tok, lp in generate_step(mx.array(turn), model, max_tokens=DECODE, prompt_cache=caches,
                                     prefill_step_size=CHUNK):
            toks.append(int(tok))
            lps.append(np.array(lp.astype(mx.float32)))
    return toks, np.stack(lps)


def per_head_sets(caches, cold):
    """Per layer and KV head (batch row 0): the sorted positions held hot (or cold)."""
    from test_recall import cold_positions, hot_positions

    get = cold_positions if cold else hot_positions
    return [[sorted(int(p) for p in h) for h in get(c)[0]] for c in caches]


def rank_main(out_dir):
    import mlx.core as mx

    from veloxquant_mlx import KVCacheBuilder
    from distributed_worker import VOCAB, make_model

    group = mx.distributed.init()
    rank = group.rank()
    ref_model, model = make_model("llama-hd32"), make_model("llama-hd32")  # 4 KV heads: 2 per rank
    model.shard(group)
    mx.eval(model.parameters())
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, VOCAB, size=PROMPT).tolist()
    follow = rng.integers(0, VOCAB, size=FOLLOW).tolist()
    results = {}
    for name, config in cases().items():
        ref = KVCacheBuilder.for_model(ref_model, config, group=False)
        ref_toks, ref_lps = two_turns(ref_model, ref, prompt, follow)
        caches = KVCacheBuilder.for_model(model, config)
        toks, lps = two_turns(model, caches, prompt, follow)
        h = caches[0].positions.shape[1]
        mine = slice(rank * h, (rank + 1) * h)
        results[name] = {
            "tokens": toks, "ref_tokens": ref_toks, "max_logprob_diff": float(np.abs(lps - ref_lps).max()),
            "hot_equal": per_head_sets(caches, False) == [s[mine] for s in per_head_sets(ref, False)],
            "cold_equal": per_head_sets(caches, True) == [s[mine] for s in per_head_sets(ref, True)],
            "recalls": [c.cold.recalls for c in caches], "ref_recalls": [c.cold.recalls for c in ref],
            "evictions": [c.evictions for c in caches], "heads": h, "ref_heads": ref[0].positions.shape[1],
            "cold_pages": [c.cold.n_pages for c in caches]}
        for c in (*caches, *ref):
            if config.recall == "disk":
                c.cold.free()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "size": group.size(), "runs": results}, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    import mlx.core as mx

    exe = shutil.which("mlx.launch") or shutil.which("mlx.launch", path=os.path.dirname(sys.executable))
    if exe is None:
        pytest.skip("mlx.launch is not on PATH (it comes with the mlx package): cannot start two ranks")
    if not mx.distributed.is_available():
        pytest.skip("this MLX build has no distributed backend")
    out = tmp_path_factory.mktemp("recall_distributed")
    port = random.randint(20000, 60000)
    here = os.path.abspath(__file__)
    repo = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    cmd = [exe, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--python", sys.executable,
           here, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0 or not all((out / f"rank{r}.json").exists() for r in range(2)):
        pytest.fail(f"mlx.launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in res] == [2, 2]
    return res


@pytest.mark.integration
def test_two_ranks_with_recall_equal_one_process(ranks):
    assert set(ranks[0]["runs"]) == set(cases())
    for r in ranks:
        for name, c in r["runs"].items():
            assert c["heads"] * 2 == c["ref_heads"], name  # each rank holds half the KV heads
            assert all(p > 0 for p in c["cold_pages"]), (name, "the prompt must evict whole pages")
            assert min(c["recalls"]) >= 1 and c["recalls"] == c["ref_recalls"], (name, c["recalls"])
            assert c["tokens"] == c["ref_tokens"], (r["rank"], name)
            # Decode-time recalls quantize rows whose last bits differ between the split model's and the
            # whole model's reductions: a 4-bit level can flip, so those logprobs differ by more.
            tol = 2e-2 if "every" in name else 1e-4
            assert c["max_logprob_diff"] < tol, (r["rank"], name, c["max_logprob_diff"])
            assert c["hot_equal"] and c["cold_equal"], (r["rank"], name)
    every = ranks[0]["runs"]["snapkv-memory-every3"]
    assert min(every["recalls"]) > min(ranks[0]["runs"]["snapkv-memory"]["recalls"])  # decode recalls too


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rank_main(sys.argv[1])
