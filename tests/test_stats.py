"""The report's statistics (Wilson intervals, exact McNemar) and the needle block-cut measurement."""

from __future__ import annotations

import math

import pytest

from lab.stats import binom_cdf, fmt_ci, mcnemar_exact, paired, wilson


@pytest.mark.parametrize("k,n,lo,hi", [
    (8, 10, 0.4902, 0.9433),    # textbook values (Newcombe 1998 style tables)
    (0, 10, 0.0, 0.2775),
    (10, 10, 0.7225, 1.0),
    (50, 100, 0.4038, 0.5962),
    (1, 150, 0.0012, 0.0368),
])
def test_wilson_known_values(k, n, lo, hi):
    a, b = wilson(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_wilson_properties():
    assert wilson(0, 0) == (0.0, 1.0)
    # Symmetric under k -> n - k, contains the point estimate, narrows with n.
    for k, n in [(3, 17), (40, 150), (149, 150)]:
        lo, hi = wilson(k, n)
        lo2, hi2 = wilson(n - k, n)
        assert lo == pytest.approx(1 - hi2) and hi == pytest.approx(1 - lo2)
        assert lo < k / n < hi
    assert wilson(75, 150)[1] - wilson(75, 150)[0] < wilson(5, 10)[1] - wilson(5, 10)[0]
    with pytest.raises(ValueError):
        wilson(5, 4)
    assert fmt_ci(8, 10) == "80.0 [49.0, 94.3]"


def test_mcnemar_exact_against_hand_binomial():
    # b=1, c=9: 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * (1 + 10) / 1024.
    assert mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert mcnemar_exact(9, 1) == mcnemar_exact(1, 9)
    # b=0, c=5: 2 / 32; b=2, c=12: 2 * (1 + 14 + 91) / 2**14.
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact(2, 12) == pytest.approx(2 * (1 + 14 + 91) / 2 ** 14)
    assert mcnemar_exact(5, 5) == 1.0 and mcnemar_exact(0, 0) == 1.0
    assert binom_cdf(3, 6) == pytest.approx(sum(math.comb(6, i) for i in range(4)) / 64)


def test_paired_counts_only_common_prompts():
    a = {1: True, 2: True, 3: False, 4: False, 5: True, 9: True}
    b = {1: True, 2: False, 3: True, 4: False, 5: False, 8: False}
    r = paired(a, b)
    assert (r["n"], r["both"], r["only_a"], r["only_b"], r["neither"]) == (5, 1, 2, 1, 1)
    assert r["p"] == pytest.approx(1.0)


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
