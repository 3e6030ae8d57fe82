"""The lab's tasks and long-context reports (lab/report_tasks.py, lab/report_long.py; moved from
tests/test_tasks.py with the code they test)."""

from __future__ import annotations

import pytest


def test_report_counts_and_pairs(tmp_path):
    import json

    from lab.report_tasks import outcomes, table, write_tasks_report

    cells = {}
    for i in range(6):
        for m, ok in (("full", True), ("nexus", i < 2), ("nexus-prompt-topk", i < 5)):
            d = None if m == "full" else 0.2
            turns = [{"turn": 0, "correct": ok}, {"turn": 1, "correct": ok and i % 2 == 0}]
            cells[f"f{i}{m}"] = {"task": "followup", "length": 2048, "index": i, "density": d, "method": m,
                                 "turns": turns, "correct": all(t["correct"] for t in turns)}
            cells[f"n{i}{m}"] = {"task": "niah_single", "length": 2048, "index": i, "density": d, "method": m,
                                 "turns": turns[:1], "correct": ok}
    data = {"meta": {"model": "m"}, "grid": {"methods": ["full", "nexus", "nexus-prompt-topk"]}, "cells": cells}
    per = outcomes(data)[0.2]
    assert sum(per["niah_single 2K"]["nexus"].values()) == 2 and len(per["niah_single 2K"]["full"]) == 6
    assert sum(per["followup 2K turn 2"]["nexus-prompt-topk"].values()) == 3
    text = "\n".join(table(data, 0.2))
    assert "33.3 [9.7–70.0] (2/6)" in text
    assert "| nexus vs nexus-prompt-topk | " in text and "0 / 3 (n=6), p=0.25" in text
    (tmp_path / "tasks.json").write_text(json.dumps(data))
    md = write_tasks_report(tmp_path).read_text()
    assert "## density 0.2" in md and (tmp_path / "tasks_0.2.png").exists()

@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_long_report_counts_prompts_and_pairs_with_rotating(tmp_path):
    import json

    from veloxquant_mlx.cli import main

    t, s = tmp_path / "t", tmp_path / "s"
    assert main(["eval", "tasks", "--quick", "--out-dir", str(t), "--no-progress", "--tasks",
                 "niah_single", "--lengths", "700", "--n-prompts", "2", "--methods", "full", "rotating", "nexus"]) == 0
    assert main(["eval", "speed", "--quick", "--out-dir", str(s), "--no-progress", "--methods",
                 "kvcache", "rotating", "nexus", "--contexts", "640", "--repeats", "2", "--decode-tokens", "4"]) == 0
    md = tmp_path / "long.md"
    from lab.cli import main as lab_main

    assert lab_main(["long-report", "--tasks", str(t), str(tmp_path / "missing"), "--speed", str(s),
                     "--md", str(md), "--figs", str(tmp_path / "figs")]) == 0
    text = md.read_text()
    cells = json.loads((t / "tasks.json").read_text())["cells"]
    k = sum(c["correct"] for c in cells.values() if c["method"] == "nexus")
    row = next(line for line in text.splitlines() if line.startswith("| nexus |"))
    assert row.endswith(f"({k}/2) |") and "| nexus vs rotating |" in text and "| full vs rotating |" in text
    assert "## Speed and memory against context length" in text and "| rotating |" in text
    assert (tmp_path / "figs" / "speed_memory_vs_context.png").exists() and (tmp_path / "figs" / "tasks_0.2.png").exists()

def test_long_report_pairs_question_inside_and_left_out():
    from lab.report_long import question_pairs

    cells = {}
    for i in range(4):
        for q, ok in (("in", True), ("out", i < 1)):
            c = {"task": "niah_single", "length": 4096, "index": i, "density": 0.2, "method": "nexus",
                 "turns": [{"turn": 0, "correct": ok}], "correct": ok}
            if q == "out":
                c["question"] = "out"
            cells[f"{i}{q}"] = c
    text = "\n".join(question_pairs({"cells": cells, "grid": {}}, 0.2))
    assert "| nexus | 4→1/4: 3 / 0, p=0.25 |" in text
