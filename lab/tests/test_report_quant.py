"""The lab's quantized-rows report and recall studies (lab/report_quant.py, lab/recall_followup.py,
lab/recall_cost.py; moved from tests/test_quant_eval.py with the code they test)."""

import pytest


def test_full_quantized_labels_fingerprint_as_full():
    from lab.provenance import key_of

    assert key_of("full-4bit") == key_of("full-8bit-g32") == "full"
    assert key_of("nexus-4bit-g32") == "nexus"

def _cell(method, density, depth, correct, nbytes):
    return {"haystack": "grass", "context": 1024, "depth": depth, "key": "1", "density": density,
            "regime": "prefill", "method": method, "seed": 0, "correct": correct, "kv_bytes_end": nbytes}

def test_quant_report_pairs_each_label_with_its_fp_method(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
    import bench_quality as Q

    from lab import report_quant as RQ

    assert (RQ.fp_label("nexus-4bit-g32"), RQ.storage("nexus-4bit-g32"), RQ.fp_label("full-8bit")) == \
        ("nexus", "4bit-g32", "full")
    stages = Q.plan(["full", "nexus"], "nestedkv", [0.1, 0.5], [0.1])
    assert stages[0]["methods"] == ["full", "full-8bit", "full-4bit", "nexus", "nexus-8bit", "nexus-4bit"]
    assert stages[1]["densities"] == [0.1, 0.5] and stages[1]["methods"][2] == "nestedkv-4bit"
    cells = []
    for i in range(6):  # nexus fp right on all 6; nexus-4bit wrong on 0..3; full right; full-4bit wrong on 0
        d = i / 10
        cells += [_cell("full", None, d, True, 1000), _cell("full-4bit", 0.2, d, i > 0, 160),
                  _cell("nexus", 0.2, d, True, 200), _cell("nexus-4bit", 0.2, d, i > 3, 40 + i)]
    cells.append(_cell("nexus", 0.2, 0.9, True, 200))  # a prompt the others lack: left out
    data = {"meta": {"model": "m"}, "cells": {str(i): c for i, c in enumerate(cells)}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    outs, nbytes, _ = RQ.index(str(path))
    t = RQ.table(outs, 0.2, ["full", "full-4bit", "nexus", "nexus-4bit"])
    assert t["n_prompts"] == 6
    assert t["rows"]["nexus-4bit"]["correct"] == 2
    assert t["rows"]["nexus-4bit"]["vs_fp"] == {"label": "nexus", "only_fp": 4, "only_quant": 0, "p": 0.125}
    assert t["rows"]["full-4bit"]["vs_fp"]["only_fp"] == 1
    # A second file (a later group-size run on the same prompts) joins with a comma.
    g32 = {f"g{i}": _cell("nexus-4bit-g32", 0.2, i / 10, True, 48) for i in range(6)}
    (tmp_path / "g.json").write_text(json.dumps({"meta": {}, "cells": g32}))
    both, _, _ = RQ.index(f"{path},{tmp_path / 'g.json'}")
    row = RQ.table(both, 0.2, ["nexus", "nexus-4bit", "nexus-4bit-g32"])["rows"]["nexus-4bit-g32"]
    assert row["vs_g64"] == {"label": "nexus-4bit", "only_g64": 0, "only_this": 4, "p": 0.125}
    assert row["vs_fp"]["label"] == "nexus"
    c = RQ.curve(outs, nbytes, "nexus", ("", "-4bit"), ("full", "full-4bit"), [0.2])
    pts = {p["label"]: p for p in c["points"]}
    assert c["n_prompts"] == 6 and c["kvcache_bytes"] == 1000
    assert pts["nexus-4bit"]["kv_bytes"] == pytest.approx(42.5) and pts["full-4bit"]["kv_vs_kvcache"] == 0.16

def _turns(correct, prefill_s):
    return [{"correct": c, **({} if k == 0 else {"turn_prefill_s": s})}
            for k, (c, s) in enumerate(zip(correct, prefill_s, strict=True))]

def test_recall_summary_counts_every_turn_and_refuses_to_resume_another_setting(tmp_path):
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
    import bench_quality as Q

    from lab import recall_followup as RF

    rows = [{"index": i, "cells": {
        "nexus": {"turns": _turns([True, False, True, False], [0, 1.0, 1.0, 2.0]), "resident_bytes_end": 10},
        "nexus-recall-disk": {"turns": _turns([True, True, i == 0, False], [0, 1.5, 1.2, 2.2]),
                              "resident_bytes_end": 12}}} for i in range(2)]
    s = RF.summarize({"prompts": rows})
    assert s["nexus"]["turn_correct"] == [2, 0, 2, 0] and s["nexus"]["all_turns"] == 0
    rec = s["nexus-recall-disk"]
    assert rec["turn_correct"] == [2, 2, 1, 0]
    assert rec["turns_lost_vs_no_recall"] == 1  # prompt 1 lost turn 3
    assert rec["turn2_prefill_ratio_median"] == 1.5
    assert rec["later_turns_prefill_ratio_median"] == 1.2  # 1.5, 1.2, 1.1 on each prompt
    out = tmp_path / "r.json"
    out.write_text(json.dumps({"prompts": rows, "setting": {"n_facts": 2, "length": 64, "density": 0.2}}))
    with pytest.raises(SystemExit, match="n_facts=2"):
        Q.recall_main(["--facts", "4", "--length", "64", "--prompts", "0", "--out", str(out)])

def test_recall_provenance_keeps_the_first_commit_and_marks_other_code_stale():
    from lab import recall_followup as RF

    a = {"commit": "aaa", "fingerprint": {"full": "f" * 12, "nexus": "n" * 12}}
    b = {"commit": "bbb", "fingerprint": {"full": "f" * 12, "nexus": "n" * 12}}
    first = RF.stamp_recall_provenance(None, a)
    assert first["commit"] == "aaa" and "first_commit" not in first and "stale_reason" not in first
    later = RF.stamp_recall_provenance(first, b)  # a commit between prompts, the same method code
    assert later["commit"] == "bbb" and later["first_commit"] == "aaa" and "stale_reason" not in later
    assert RF.stamp_recall_provenance(later, b)["first_commit"] == "aaa"
    moved = RF.stamp_recall_provenance(later, {"commit": "ccc", "fingerprint": {"full": "f" * 12, "nexus": "m" * 12}})
    assert "nexus" in moved["stale_reason"] and moved["first_commit"] == "aaa"

def test_recall_cost_tiers_name_each_page_count_and_refuse_none():
    from veloxquant_mlx.config import KVCacheConfig
    from lab.recall_cost import cost_tiers

    one = cost_tiers(["memory", "disk"], [8], 4)
    assert list(one) == ["none", "memory", "disk"]  # one page count: the tiers keep their names
    assert one["memory"] == {"recall": "memory", "recall_pages": 8, "recall_bits": 4, "recall_page": 32}
    assert one["disk"] == {"recall": "disk", "recall_pages": 8, "recall_bits": 4, "recall_page": 32}
    many = cost_tiers(["memory"], [1, 8], 2)
    assert list(many) == ["none", "memory-p1", "memory-p8"]
    assert KVCacheConfig(method="nexus", budget=256, **many["memory-p1"]).recall_pages == 1
    with pytest.raises(ValueError, match=">= 1"):
        cost_tiers(["memory"], [0, 8], 4)
