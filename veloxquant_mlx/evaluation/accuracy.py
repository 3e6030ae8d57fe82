"""Accuracy of an ``eval`` run's answers per cache, with Wilson 95 % intervals: what the run prints while
its cells finish and at its end (records with a boolean ``correct``: passkey, tasks)."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95% normal quantile

# The grid coordinates of a record that tell its cache apart: the method label, then those the run's
# cells differ in (a run of one density names none). passkey: density, regime; tasks: density, a fixed
# budget (budget_tokens), the question inside or outside what is compressed.
CACHE_FIELDS = ("method", "density", "budget_tokens", "regime", "question")


def wilson(k: int, n: int, z: float = Z95) -> tuple:
    """Wilson score interval (low, high) for ``k`` successes out of ``n`` trials, as fractions.

    ``n == 0`` gives (0, 1): no information."""
    if n < 0 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    lo, hi = centre - half, centre + half
    # Exact at the edges (rounding would otherwise leave 1e-17 residue).
    return (0.0 if k == 0 else max(lo, 0.0), 1.0 if k == n else min(hi, 1.0))


def accuracy_rows(records) -> list:
    """``[(cache label, right, answered)]`` over the records that hold an answer (a boolean ``correct``;
    errors are not answers), caches in the order they first appear."""
    answered = [r for r in records if isinstance(r.get("correct"), bool)]
    # the full cache has no density or budget: only the values of the caches that have one count
    varying = [f for f in CACHE_FIELDS[1:] if len({repr(r.get(f)) for r in answered if r.get(f) is not None}) > 1]
    tally = {}
    for r in answered:
        key = (str(r.get("method")), *(r.get(f) for f in varying))
        right, n = tally.get(key, (0, 0))
        tally[key] = (right + r["correct"], n + 1)
    rows = []
    for key, (right, n) in tally.items():
        named = [f"{f.replace('_', ' ')} {v}" for f, v in zip(varying, key[1:]) if v is not None]
        rows.append((key[0] + (f" ({', '.join(named)})" if named else ""), right, n))
    return rows


def accuracy_line(rows) -> str:
    """One line: ``full 5/5 100% [57, 100] | nexus 3/5 60% [23, 88]`` (empty without answers)."""
    return " | ".join(f"{label} {right}/{n} {_interval(right, n, 0)}" for label, right, n in rows)


def accuracy_table(rows) -> str:
    """One line per cache: answers right / answered, the accuracy and its Wilson 95 % interval."""
    if not rows:
        return ""
    width = max(len(label) for label, _, _ in rows)
    return "\n".join(["accuracy (right / answered, Wilson 95 % interval):"] +
                     [f"  {label:{width}s} {right:>5d}/{n:<5d} {_interval(right, n, 1)}" for label, right, n in rows])


def _interval(right: int, n: int, digits: int) -> str:
    lo, hi = wilson(right, n)
    return f"{100 * right / n:.{digits}f}% [{100 * lo:.{digits}f}, {100 * hi:.{digits}f}]"
