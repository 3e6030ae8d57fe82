"""``eval speed --shared-prefill``: a cache prefilled in the shared pass decodes the same tokens and
holds the same KV bytes as the same cache prefilled alone."""

from __future__ import annotations

from conftest import make_tiny_model, random_prompt

from veloxquant_mlx.evaluation.results import method_specs
from veloxquant_mlx.evaluation.speed import measure_group

NAMES = ["kvcache", "rotating", "nexus", "snapkv", "h2o"]
KEYS = ("last_token", "kv_bytes_after_prefill", "kv_kept_bytes_after_prefill", "kv_bytes_end", "kv_kept_bytes_end")


def test_shared_prefill_cell_matches_the_cell_run_alone():
    model = make_tiny_model("llama", seed=3)
    tokens = [int(t) for t in random_prompt(600, seed=5)]
    specs = {s.name: s for s in method_specs(NAMES[2:])}
    run = dict(specs=specs, budget=120, decode_tokens=4, repeats=2, prefill_step=64)
    alone = measure_group(model, tokens, NAMES, **run)
    shared = measure_group(model, tokens, NAMES, **run, shared=True)
    for name in NAMES:
        assert "error" not in alone[name] and "error" not in shared[name], (alone[name], shared[name])
        assert {k: shared[name][k] for k in KEYS} == {k: alone[name][k] for k in KEYS}, name
        assert [s["kv_bytes"] for s in shared[name]["segments"]] == [s["kv_bytes"] for s in alone[name]["segments"]]
    assert all(shared[n].get("prefill_shared") for n in NAMES if n != "rotating")
    assert not shared["rotating"].get("prefill_shared")
    # the prompt is long enough that the methods evicted: equal bytes are not the trivial full cache
    assert shared["nexus"]["kv_kept_bytes_end"] < shared["kvcache"]["kv_kept_bytes_end"]
