"""One ranking across layers: each layer's share of a sequence's total budget (the non-uniform layer
budget of KVzip, paper Sec. 3, that kvzip ``layers="global"`` and kvzap ``layers="global"`` use).

Every layer's evictable rows (not the sinks, not the recent window) compete on one score scale; layer
``l`` keeps ``n_sink + recent + (its winners / its heads)`` rows per head, so the total stays
``layers x heads x budget``. Reads the L winner counts back once (the one host read of a global
compression, after the forward, never inside ``update_and_fetch``).
"""

from __future__ import annotations

import warnings

from ..ops.allocation import layer_winner_counts
from .storage import PAD_POSITION

_warned: set = set()


def global_layer_shares(caches: list, field: str, method: str):
    """Rows per head for each cache of one sequence (a list aligned with ``caches``), ranked by the
    per-row ``field`` (higher is kept); None where one ranking is not possible here (a batch of several
    sequences in one cache, tensor parallelism), warned once: then every layer keeps its own budget."""
    first = caches[0]
    why = None
    if first.stored("positions").shape[0] != 1:
        why = "a batch of several sequences in one cache"
    elif any(c.dist is not None for c in caches):
        why = "tensor parallelism"
    if why is not None:
        if (method, why) not in _warned:
            _warned.add((method, why))
            warnings.warn(f"{method} layers='global' is not supported with {why}: each layer keeps its own "
                          "budget", stacklevel=6)
        return None
    F = first.n_sink + first.recent
    scores, cands = [], []
    for c in caches:
        pos = c.stored("positions")
        forced = (pos < c.n_sink) | (pos >= c.offset - c.recent)
        scores.append(c.stored(field))
        cands.append((pos != PAD_POSITION) & ~forced)
    heads = [c.shape[1] for c in cands]
    n_total = sum(heads) * (first.budget - F)
    counts = layer_winner_counts(scores, cands, n_total).tolist()
    return [F + int(round(n / h)) for n, h in zip(counts, heads)]
