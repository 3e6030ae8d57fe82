"""The lab's passkey / perplexity / speed report (lab/report*.py) and its `python -m lab eval` / `report`
commands on ``--quick`` runs (moved from tests/test_evaluation.py with the code they test)."""

from __future__ import annotations

import json

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from lab import report  # noqa: E402
from lab.report_paired import needle_cut_summary  # noqa: E402
from lab.report_passkey import PasskeyGrid, _passkey_tables, passkey_coverage  # noqa: E402
from veloxquant_mlx.evaluation import results as R  # noqa: E402


def _counts(paired):
    return paired["n"], paired["only_a"], paired["only_b"], paired["p"]


def _passkey_reading(data, figs_dir):
    """(the passkey section's headline numbers, the reading as data keyed by (regime, density))."""
    pk = _passkey_tables(data, [], figs_dir, [])
    return pk, {(r["regime"], r["density"]): r for r in report.passkey_reading(pk, data)}

def test_cli_quick_end_to_end(tmp_path):
    """The lab's eval (the package's harness, stamped, then the report) and its report command."""
    from lab.cli import main as lab_main

    def _run(*argv):
        assert lab_main(list(argv)) == 0

    out, md = str(tmp_path / "eval"), str(tmp_path / "results.md")
    common = ["--quick", "--out-dir", out, "--results-md", md, "--no-progress"]
    pk = ["eval", "passkey", *common, "--methods", "full", "nexus", "snapkv", "streaming",
          "--contexts", "640", "--densities", "0.2", "--depths", "0.5", "--n-keys", "1",
          "--haystacks", "grass", "text", "--regimes", "prefill", "decode"]
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    cells = data["cells"]
    # per haystack: full (1) + nexus (2 regimes) + snapkv (prefill-only: 1) + streaming (2)
    assert len(cells) == 12
    assert not any(c["method"] == "snapkv" and c["regime"] == "decode" for c in cells.values())
    assert all("correct" in c and c["prompt_tokens"] > 600 for c in cells.values())
    assert data["meta"]["quick"] is True and "openblas_preloaded" in data["meta"]["machine"]
    # Resume: nothing is re-run; a deleted cell is re-run alone.
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    assert data["runs"][-1]["ran"] == 0
    victim = next(iter(data["cells"]))
    del data["cells"][victim]
    (tmp_path / "eval" / "passkey.json").write_text(json.dumps(data))
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    assert data["runs"][-1]["ran"] == 1 and victim in data["cells"]

    _run("eval", "perplexity", *common, "--methods", "full", "nexus", "streaming", "--densities", "0.2",
         "--n-tokens", "640")
    ppl = json.loads((tmp_path / "eval" / "perplexity.json").read_text())["cells"]
    assert len(ppl) == 3 and all(c.get("ppl", 0) > 1 for c in ppl.values())

    _run("eval", "speed", *common, "--methods", "kvcache", "rotating", "nexus", "--repeats", "3",
         "--decode-tokens", "8")
    sp = json.loads((tmp_path / "eval" / "speed.json").read_text())["cells"]
    assert len(sp) == 1
    per = next(iter(sp.values()))["per_cache"]
    assert set(per) == {"kvcache", "rotating", "nexus"}
    for r in per.values():
        assert len(r["segments"]) == 3 and r["decode_tps"] > 0 and r["prefill_tps"] > 0
    assert per["nexus"]["kv_bytes_end"] < 0.5 * per["kvcache"]["kv_bytes_end"]
    assert per["nexus"]["kv_bytes_end"] <= per["nexus"]["kv_bytes_after_prefill"] * 1.2  # bounded in decode
    # KVCache grows: its kept rows every token, its allocation in steps of 256 rows (640 + 24 stays in 768)
    assert per["kvcache"]["kv_kept_bytes_end"] > per["kvcache"]["kv_kept_bytes_after_prefill"]
    assert per["kvcache"]["kv_bytes_end"] >= per["kvcache"]["kv_bytes_after_prefill"]

    assert "provenance" in json.loads((tmp_path / "eval" / "speed.json").read_text())
    _run("report", "--out-dir", out, "--results-md", md)
    text = (tmp_path / "results.md").read_text()
    for needle in ("Passkey accuracy", "Streaming perplexity", "Decode throughput", "KV memory", "Reading"):
        assert needle in text
    # Coverage is counted from the cells: grass 640 prefill-only at 20% = nexus, snapkv, streaming on 1 prompt.
    cov = passkey_coverage(json.loads((tmp_path / "eval" / "passkey.json").read_text()))
    assert cov[("grass", 640, "prefill", 0.2)] == {"prompts": 1, "methods": 3, "cells": 3, "errors": 0}
    assert cov[("text", 640, "decode", 0.2)] == {"prompts": 1, "methods": 2, "cells": 2, "errors": 0}
    for fig in ("passkey_accuracy_vs_density.png", "passkey_accuracy_by_depth.png", "perplexity_vs_density.png",
                "speed_memory_vs_context.png"):
        assert (tmp_path / "eval" / fig).exists()

def test_reading_compares_methods_only_where_all_of_them_ran(tmp_path):
    """A method that errors on one haystack (budget too small) must not be averaged over fewer prompts
    than the others: the generated reading compares on the columns where every runnable method ran."""
    cells = {}

    def put(method, hay, ctx, depth, correct=None, error=None):
        c = {"method": method, "haystack": hay, "context": ctx, "depth": depth, "key": "1", "seed": 0,
             "regime": "prefill", "density": None if method == R.FULL else 0.1,
             "prefill_only_method": method == R.FULL}
        c.update({"error": error} if error else {"correct": correct})
        cells[R.cell_id(**c)] = c

    for depth in (0.1, 0.5):
        for ctx in (1024, 2048):
            put(R.FULL, "grass", ctx, depth, True)
            put("snapkv", "grass", ctx, depth, ctx == 1024)  # 100% at 1K, 0% at 2K
        put("nexus", "grass", 1024, depth, error="ValueError: nexus budget too small")
        put("nexus", "grass", 2048, depth, depth == 0.1)  # 50% at 2K
    put("snapkv-ada", "grass", 1024, 0.1, False)  # opt-in Ada row on one prompt only
    data = {"cells": cells, "grid": {}, "meta": {}}
    pk, reading = _passkey_reading(data, tmp_path)
    r = reading[("prefill", 0.1)]
    assert (r["columns"], r["prompts"], r["winners"], r["best"]) == (["grass 2K"], 2, ["nexus"], 0.5)
    assert r["not_run"] == [] and r["rows"] == {"nexus": 0.5, "snapkv": 0.0}
    # 1 prompt only Nexus got right, none only SnapKV: the reading reports it and calls no winner.
    assert _counts(r["paired"]["snapkv"]) == (2, 1, 0, 1.0) and r["ahead"] == r["behind"] == []
    # The partial Ada run neither joins nor shrinks the main table; it gets its own paired table.
    tables = PasskeyGrid(data).tables
    assert tables[(0.1, "prefill", ("grass", 1024))][0]["snapkv"] == (2, 2, 0)
    assert tables[(0.1, "prefill", ("grass", 2048))][0]["snapkv"] == (0, 2, 0)
    assert "snapkv-ada" not in tables[(0.1, "prefill", ("grass", 1024))][0]
    assert pk[("ada", "prefill", 0.1)] == {"snapkv": (1.0, 0.0, 1)}

def test_reading_calls_a_difference_only_where_mcnemar_supports_it(tmp_path):
    """Nexus right on 10 prompts where H2O fails (p = 2/1024) and SnapKV equal but on other prompts
    (2/2 discordant, p = 1): the reading says ahead of h2o only; the paired table and the block-cut
    table carry the counts."""
    cells = {}

    def put(method, i, correct, cut=None):
        c = {"method": method, "haystack": "grass", "context": 1024, "depth": i / 20, "key": "1", "seed": 0,
             "regime": "prefill", "density": None if method == R.FULL else 0.2,
             "prefill_only_method": method in (R.FULL, "snapkv"), "correct": correct}
        if cut is not None:
            c.update(needle_cut_frac=cut, needle_kept_frac=1 - cut, needle_whole_frac=1 - cut)
        cells[R.cell_id(**c)] = c

    for i in range(12):
        put(R.FULL, i, True, 0.0)
        put("nexus", i, i < 10, 0.0 if i < 10 else 0.5)  # the two misses are cut
        put("h2o", i, False, 0.3)
        put("snapkv", i, 2 <= i < 12)  # 10/12 on other prompts: 2 discordant each way
    data = {"cells": cells, "grid": {}, "meta": {}}
    _, reading = _passkey_reading(data, tmp_path)
    r = reading[("prefill", 0.2)]
    assert (r["ahead"], r["behind"], r["undecided"]) == (["h2o"], [], ["full", "snapkv"])
    h2o = r["paired"]["h2o"]
    assert (h2o["n"], h2o["both"], h2o["only_a"], h2o["only_b"], h2o["neither"]) == (12, 0, 10, 0, 2)
    assert h2o["p"] == pytest.approx(2 / 1024) and _counts(r["paired"]["snapkv"]) == (12, 2, 2, 1.0)
    assert (r["full"], r["prompts"], set(r["winners"]), r["best"]) == (1.0, 12, {"nexus", "snapkv"}, 10 / 12)
    # Block cut: nexus cut on 2 prompts (both wrong), intact on 10 (all right).
    cut = needle_cut_summary(list(cells.values()), "prefill", 0.2)["nexus"]
    assert (cut["n"], cut["cut"], cut["nocut"]) == (12, (0, 2), (10, 10))
    assert cut["cut_mean"] == pytest.approx(1 / 12) and cut["cut_any"] == pytest.approx(2 / 12)
    assert (tmp_path / "passkey_accuracy_ci.png").exists()
    # The reservoir-n study (figures/eval/nexus_seed_n.json) gets its own table when present.
    per = {n: {"p_whole_mean_over_layers": p, "layers_keeping_whole_frac_sd_over_seeds": 0.05}
           for n, p in (("1", 0.47), ("topk", 0.7))}
    (tmp_path / "nexus_seed_n.json").write_text(json.dumps({"seeds": 10, "prompts": {"grass:0.5": {"per_n": per}}}))
    (tmp_path / "passkey.json").write_text(json.dumps(data))
    text = report.write_report(tmp_path, tmp_path / "r.md").read_text()
    assert "| grass:0.5 | 47 ± 5 | 70 ± 5 |" in text  # the one rendered-markdown check (a snapshot row)

def test_speed_table_limit_column_pairs_rounds():
    """×limit is decode tok/s over RotatingKVCache's, paired round by round (median [min–max]), not a
    ratio of medians: a cache that is 2× the limit in one round and 0.5× in another reads 1.00× [0.50–2.00]."""
    from lab.report_perf import _speed_block, limit_ratios

    def rec(tps):
        return {"decode_tps": sorted(tps)[1], "prefill_tps": 10.0, "segments": [{"decode_tps": t} for t in tps],
                "kv_bytes_after_prefill": 1, "kv_bytes_end": 1, "kv_kept_bytes_end": 1}

    med = {("kvcache", 1024): rec([4.0, 4.0, 4.0]), ("rotating", 1024): rec([10.0, 4.0, 8.0]),
           ("h2o", 1024): rec([5.0, 8.0, 8.0])}
    assert limit_ratios(med[("h2o", 1024)], med[("rotating", 1024)]) == [0.5, 2.0, 1.0]
    lines = []
    _speed_block(med, lines, [1024], ["kvcache", "rotating", "h2o"], with_peak=False)
    head = lines[0].split(" | ")
    row = lines[4].split(" | ")
    assert lines[4].startswith("| h2o |")
    assert row[head.index("1K ×limit")] == "1.00× [0.50–2.00]"
    assert lines[3].split(" | ")[head.index("1K ×limit")] == "1.00× [1.00–1.00]"
    # CPU time recorded by both: the ratio uses it (the wall clock mostly measures the machine's load)
    for m in med.values():
        for i, seg in enumerate(m["segments"]):
            seg["decode_cpu_tps"] = 3.0 if m is med[("h2o", 1024)] else 4.0
    assert limit_ratios(med[("h2o", 1024)], med[("rotating", 1024)]) == [0.75, 0.75, 0.75]
    lines = []
    _speed_block(med, lines, [1024], ["kvcache", "rotating", "h2o"], with_peak=False)
    assert "1K ×limit (CPU time)" in lines[0] and "| 0.75× [0.75–0.75] |" in lines[4]
    # no limit cache in the run: no ×limit column at all
    lines = []
    _speed_block({k: v for k, v in med.items() if k[0] != "rotating"}, lines, [1024], ["kvcache", "h2o"],
                 with_peak=False)
    assert "×limit" not in lines[0]


def test_decode_reading_ranks_only_methods_that_evict_during_the_prompt(tmp_path):
    """In the prefill + decode regime a prefill-only method (snapkv) holds the whole prompt and its row is
    copied from the prefill-only regime; the reading must not call it the best bounded method."""
    cells = {}

    def put(method, regime, depth, correct, prefill_only):
        c = {"method": method, "haystack": "grass", "context": 1024, "depth": depth, "key": "1", "seed": 0,
             "regime": regime, "density": None if method == R.FULL else 0.2, "prefill_only_method": prefill_only,
             "correct": correct}
        cells[R.cell_id(**c)] = c

    for depth in (0.1, 0.5):
        put(R.FULL, "prefill", depth, True, True)
        put("snapkv", "prefill", depth, True, True)  # 100%, copied into the decode regime
        put("nexus", "prefill", depth, True, False)
        put("nexus", "decode", depth, depth == 0.5, False)  # 50%
        put("h2o", "prefill", depth, False, False)
        put("h2o", "decode", depth, False, False)  # 0%
    _, reading = _passkey_reading({"cells": cells, "grid": {}, "meta": {}}, tmp_path)
    dec = reading[("decode", 0.2)]
    assert (dec["winners"], dec["best"], dec["unbounded"]) == (["nexus"], 0.5, ["snapkv"])
    assert "snapkv" not in dec["paired"] and _counts(dec["paired"]["h2o"]) == (2, 1, 0, 1.0)
    # The prefill-only reading still ranks snapkv.
    pre = reading[("prefill", 0.2)]
    assert (set(pre["winners"]), pre["best"], pre["unbounded"]) == ({"snapkv", "nexus"}, 1.0, [])
