"""The statistics of the lab's reports (lab/stats.py; moved from tests/test_stats.py with the code)."""

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
