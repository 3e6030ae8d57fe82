"""report_recall: per-turn outcomes, the paired counts against the method without recall, and the
resident-bytes points, on a hand-made follow-up result."""

from lab import report_recall as rr


def _cell(turns, resident):
    return {"turns": [{"correct": t} for t in turns], "resident_bytes_end": resident}


DATA = {"setting": {"length": 2048, "density": 0.2}, "prompts": [
    {"index": 0, "cells": {"full": _cell([1, 1], 100), "nexus": _cell([1, 0], 20),
                           "nexus-recall-disk": _cell([1, 1], 30)}},
    {"index": 1, "cells": {"full": _cell([1, 1], 100), "nexus": _cell([1, 1], 40),
                           "nexus-recall-disk": _cell([0, 1], 50)}},
]}


def test_all_turns_and_points():
    every = rr.all_turns(DATA)
    assert every["nexus"] == {0: False, 1: True}
    assert every["nexus-recall-disk"] == {0: True, 1: False}
    pts = {n: (b, acc, k) for n, b, acc, k in rr.resident_points(DATA)}
    assert pts["nexus"] == (30, 0.5, 2)
    assert pts["full"] == (100, 1.0, 2)


def test_table_pairs_against_no_recall():
    lines = rr.table(DATA)
    row = next(line for line in lines if line.startswith("| nexus-recall-disk"))
    # turn 1: recall lost prompt 1; turn 2: recall gained prompt 0
    assert "+0/-1" in row and "+1/-0" in row
