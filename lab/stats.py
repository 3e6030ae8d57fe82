"""Small statistics for the passkey report: Wilson score intervals and the exact McNemar test.

Pure Python (no scipy): the report runs anywhere the package does.
"""

from __future__ import annotations

import math

# The package's own: eval prints the same intervals while it runs as the report does.
from veloxquant_mlx.evaluation.accuracy import Z95, wilson  # noqa: F401 (re-exported)


def binom_cdf(k: int, n: int, p: float = 0.5) -> float:
    """P(X <= k) for X ~ Binomial(n, p)."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts ``b`` (only A right) and ``c``
    (only B right): the binomial test of min(b, c) out of b + c at 1/2, doubled, capped at 1.
    No discordant pair gives p = 1."""
    if b < 0 or c < 0:
        raise ValueError("discordant counts must be >= 0")
    n = b + c
    if n == 0:
        return 1.0
    return min(1.0, 2.0 * binom_cdf(min(b, c), n, 0.5))


def paired(a: dict, b: dict) -> dict:
    """Paired comparison of two methods on the prompts both ran: ``a`` and ``b`` map a prompt key
    to correct (bool). Returns n, both, only_a, only_b, neither and the exact McNemar p."""
    common = sorted(set(a) & set(b), key=repr)
    both = sum(1 for k in common if a[k] and b[k])
    only_a = sum(1 for k in common if a[k] and not b[k])
    only_b = sum(1 for k in common if b[k] and not a[k])
    return {"n": len(common), "both": both, "only_a": only_a, "only_b": only_b,
            "neither": len(common) - both - only_a - only_b, "p": mcnemar_exact(only_a, only_b)}


def fmt_ci(k: int, n: int) -> str:
    """'83.3 [74.1, 89.7]' (percent, Wilson 95%)."""
    if n == 0:
        return "–"
    lo, hi = wilson(k, n)
    return f"{100 * k / n:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def fmt_p(p: float) -> str:
    if p < 0.001:
        return "<0.001"
    return f"{p:.3f}" if p < 0.1 else f"{p:.2f}"
