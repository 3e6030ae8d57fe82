"""Planted-anomaly benchmark suite: determinism, that the generators plant what they claim, and
sanity floors on the results (lab.planted)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from veloxquant_mlx import methods
from lab import planted as P

# --quick-sized, further reduced so two runs fit the test budget.
TINY = P.SuiteConfig(seeds=(0, 1), nested_small=(320,), nested_small_budgets=(16, 128), nested_paper=(),
                     bridge_budgets=(320,), erosion_decode=256, erosion_budgets=(256,), heavy_n=1024,
                     heavy_budgets=(256,))


@pytest.fixture(scope="module")
def tiny_runs():
    variants = P.method_variants()
    a = P.run_suite(TINY, variants)
    b = P.run_suite(TINY, variants)
    return a, b


def test_two_runs_identical_apart_from_ms(tiny_runs):
    a, b = tiny_runs
    ja, jb = P.to_json(a), P.to_json(b)
    # the suite's wall time covers every scenario's generation and every cell it timed
    timed = sum(sc["generate_ms"] + sum(c["wall_ms"] for cells in sc["cells"].values() for c in cells.values())
                for sc in a["scenarios"].values())
    assert a["total_ms"] >= timed > 0
    assert P.strip_ms(json.loads(ja)) == P.strip_ms(json.loads(jb))
    # the serialisation itself is canonical: re-dumping the stripped dicts gives the same bytes
    assert (json.dumps(P.strip_ms(json.loads(ja)), sort_keys=True)
            == json.dumps(P.strip_ms(json.loads(jb)), sort_keys=True))
    # timings only ever live in *_ms fields
    flat = json.dumps(P.strip_ms(json.loads(ja)))
    assert "wall" not in flat and "generate_ms" not in flat


def test_every_registered_method_and_ablations_present(tiny_runs):
    a, _ = tiny_runs
    labels = set(a["variants"])
    assert set(methods()) <= labels
    if "nexus" in methods():
        assert {"nexus_topk", "nexus_nowalk"} <= labels
        assert a["variants"]["nexus_topk"]["options"] == {"n_samples": None}
        assert a["variants"]["nexus_nowalk"]["options"] == {"lam": 0.0}
    for sc in a["scenarios"].values():
        for v in labels:
            for b in sc["budgets"]:
                cell = sc["cells"][v][str(b)]
                assert "error" in cell or 0.0 <= cell["retention_mean"] <= 1.0


def test_errors_are_recorded_not_raised():
    bad = P.Variant("broken", "streaming", (("no_such_option", 1),))
    cfg = P.SuiteConfig(seeds=(0,), nested_small=(320,), nested_small_budgets=(24,), only=("nested_small",))
    res = P.run_suite(cfg, [bad, P.Variant("streaming", "streaming")])
    cells = res["scenarios"]["nested_global_N320"]["cells"]
    assert "error" in cells["broken"]["24"] and "retention_mean" in cells["streaming"]["24"]
    assert len(res["errors"]) == 3  # one per geometry


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bridge_hub_has_no_peak_but_top_coattention(seed):
    sc = P.make_bridge(seed)
    info = sc.info
    assert info["hub_never_peak"]  # no window query puts its largest block mass on the hub
    assert info["hub_mass_over_row_peak_max"] < 0.2  # ... not even close to a peak
    assert info["hub_coattention_rank"] == 1  # highest mean pairwise co-attention of all blocks
    assert info["hub_direct_rank"] > 1  # but the direct score ranks it below the distractors
    assert info["hub_direct_score"] < info["distractor_direct_score_mean"]


@pytest.mark.parametrize("seed", [0, 1])
def test_heavy_hitters_get_the_highest_cumulative_attention(seed):
    sc = P.make_heavy(seed, n=1024)
    cum = P.cumulative_attention(sc, stride=4)
    top = np.argsort(-cum)[: len(sc.planted["heavy"])]
    assert set(top.tolist()) == set(sc.planted["heavy"].tolist())


@pytest.mark.parametrize("kind", P.NESTED_KINDS)
def test_nested_geometries_plant_the_right_anomaly(kind):
    sc = P.make_nested(kind, 512, seed=3)
    an = sc.info["anomaly"]
    if kind == "global":
        assert an["global"]["rank"] == 1
    elif kind == "episodic":
        assert an["episodic"]["rank"] == 1
        assert an["global"]["rank"] > 100  # the global mean is cancelled: not a global outlier
    else:
        assert an["current"]["rank"] <= 3
        assert an["global"]["rank"] > 20
        assert sc.prompt_len - 8 <= sc.info["planted_pos"] < sc.prompt_len


def test_erosion_subtle_blocks_fluctuate_around_background():
    sc = P.make_erosion(0, n_decode=1024)
    frac = sc.info["frac_steps_below_background"]
    assert 0.05 < frac < 0.5  # above a background block on average, regularly below it
    assert sc.total_len - sc.prompt_len == 1024 and len(sc.planted["subtle"]) == 96


def test_generators_are_deterministic():
    a, b = P.make_bridge(5), P.make_bridge(5)
    assert np.array_equal(a.keys, b.keys) and np.array_equal(a.queries, b.queries)
    assert not np.array_equal(a.keys, P.make_bridge(6).keys)


def _cell(res, key, variant, budget):
    return res["scenarios"][key]["cells"][variant][str(budget)]


def test_streaming_keeps_recency_and_loses_global_outlier(tiny_runs):
    a, _ = tiny_runs
    assert _cell(a, "nested_recency_N320", "streaming", 16)["retention_mean"] == 1.0
    assert _cell(a, "nested_global_N320", "streaming", 16)["retention_mean"] == 0.0


def test_attention_method_keeps_heavy_hitters(tiny_runs):
    a, _ = tiny_runs
    assert _cell(a, "heavy_N1024", "h2o", 256)["retention_mean"] >= 0.99
    assert _cell(a, "heavy_N1024", "streaming", 256)["retention_mean"] <= 0.2


def test_survival_curve_and_recall_reported(tiny_runs):
    a, _ = tiny_runs
    cell = _cell(a, "erosion_T256", "streaming", 256)
    surv = cell["survival"]
    assert surv["decode_step"][-1] == 256 and len(surv["decode_step"]) == len(surv["retention_mean"])
    assert surv["retention_mean"][-1] == 0.0  # a sliding window forgets the prompt
    assert 0.0 <= cell["recall_mean"] <= 1.0


def test_markdown_table_regenerates(tmp_path, tiny_runs):
    a, _ = tiny_runs
    path = tmp_path / "bench.md"
    path.write_text("# Bench\n\nintro\n")
    P.update_markdown(str(path), P.round_floats(a))
    P.update_markdown(str(path), P.round_floats(a))  # idempotent: replaces its own block
    text = path.read_text()
    assert text.count(P.TABLE_BEGIN) == 1 and text.startswith("# Bench\n\nintro\n")
    block = text.split(P.TABLE_BEGIN, 1)[1].split(P.TABLE_END, 1)[0]
    assert block.strip("\n") == P.markdown_tables(P.round_floats(a)).strip("\n")  # the generator's block, whole
