"""The needle block-cut measurement of the passkey harness (the report's statistics: lab/tests/test_report_stats.py)."""

from __future__ import annotations

import pytest


class _FakeCache:
    def __init__(self, rows):
        self.rows = rows

    def kept_positions(self):
        import numpy as np

        return np.array(self.rows)  # (B, H, rows), -1 = padding


def test_needle_cut_stats_counts_cut_heads():
    pytest.importorskip("mlx.core")
    from veloxquant_mlx.evaluation.retrieval import needle_cut_stats

    spans = [[10, 11, 12], [20, 21, 22]]
    caches = [
        _FakeCache([[[10, 11, 12, 0], [10, 11, 5, -1]]]),   # head 0: first whole; head 1: first cut
        _FakeCache([[[1, 2, 3, 4], [20, 21, 22, 12]]]),     # head 0: nothing; head 1: second whole, first cut
    ]
    s = needle_cut_stats(caches, spans)
    assert s["needle_cut_frac"] == pytest.approx(2 / 4)
    assert s["needle_whole_frac"] == pytest.approx(2 / 4)
    assert s["needle_kept_frac"] == pytest.approx((3 / 6 + 2 / 6 + 0 + 4 / 6) / 4, abs=1e-4)

    class _Plain:  # mlx-lm's KVCache: keeps everything
        pass

    assert needle_cut_stats([_Plain()], spans)["needle_cut_frac"] == 0.0
    assert needle_cut_stats(caches, []) == {}


def test_key_token_spans_find_both_occurrences():
    pytest.importorskip("mlx.core")
    from veloxquant_mlx.evaluation.results import ByteTokenizer
    from veloxquant_mlx.evaluation.retrieval import key_token_spans, make_prompt

    tok = ByteTokenizer()
    toks, pos = make_prompt(tok, "grass", 640, 0.5, "40718")
    spans = key_token_spans(tok, toks, pos, "40718")
    assert len(spans) == 2 and all(len(s) == 5 for s in spans)  # one byte per digit
    assert all(tok.decode([toks[i] for i in s]) == "40718" for s in spans)
    assert pos <= spans[0][0] < spans[1][0]
