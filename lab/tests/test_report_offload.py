"""The cold-tier table pairs a recall file's prompts with the offload file's by index, and only within one setting."""

from lab import report_offload

SETTING = {"model": "m", "length": 2048, "density": 0.2, "facts": 2}


def _file(setting, rows):
    return {"setting": setting, "prompts": [{"index": i, "correct": c, "errors": {}} for i, c in rows],
            "provenance": {"commit": "abc1234", "date": "2026-12-06", "command": "x"}}


def test_recall_table_pairs_prompts_both_files_ran(monkeypatch):
    offload = _file(SETTING, [(0, {"full": [1, 1], "s:end": [1, 0], "s:offload": [1, 1]}),
                              (1, {"full": [1, 1], "s:end": [1, 0], "s:offload": [1, 1]}),
                              (2, {"full": [1, 0], "s:end": [1, 0], "s:offload": [1, 0]})])
    recall = _file({**SETTING, "recall": "memory"},
                   [(0, {"full": [1, 1], "s:recall-memory": [1, 0]}),
                    (1, {"full": [1, 1], "s:recall-memory": [1, 1]}),
                    (5, {"full": [1, 1], "s:recall-memory": [1, 1]})])  # 5: not in the offload file
    monkeypatch.setattr(report_offload, "_load", lambda name: offload if name == "followup_m.json" else None)
    row = [ln for ln in report_offload.recall_table(recall).splitlines() if ln.startswith("| `s`")]
    assert row == ["| `s` | 2 | 2/2 | 0/2 | 1/2 | 2/2 | 1 / 0 (1.00) |"]


def test_recall_table_pairs_nothing_across_settings(monkeypatch):
    offload = _file({**SETTING, "density": 0.4}, [(0, {"full": [1, 1], "s:end": [1, 0], "s:offload": [1, 1]})])
    recall = _file({**SETTING, "recall": "disk"}, [(0, {"full": [1, 1], "s:recall-disk": [1, 0]})])
    monkeypatch.setattr(report_offload, "_load", lambda name: offload)
    assert not [ln for ln in report_offload.recall_table(recall).splitlines() if ln.startswith("| `s`")]
