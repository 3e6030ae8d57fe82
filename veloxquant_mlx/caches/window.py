"""The observation window: the newest ``size`` queries the tap handed a cache (its method's ``Needs.window``).

A full window is a ring: one query overwrites the oldest row in place (one write per decode step); a
longer input replaces it with a copy of its last ``size`` queries (never a slice: a view would pin the
whole chunk's queries).
"""

from __future__ import annotations

import mlx.core as mx


class QueryWindow:
    def __init__(self, size: int):
        self.size = size
        self.q = None  # (B, H_q, <= size, D)
        self.at = 0  # a full ring: the row the next query overwrites (its oldest)

    def add(self, queries: mx.array) -> None:
        """Keep the newest ``size`` of the window's queries and these (B, H_q, S, D)."""
        W, S, q = self.size, queries.shape[2], self.q
        if q is not None and S == 1 and q.shape[2] == W:  # a full ring: overwrite the oldest
            i = self.at
            q[:, :, i:i + 1] = queries
            self.at = i + 1 if i + 1 < W else 0
        elif q is None or S >= W:
            self.q, self.at = mx.contiguous(queries[:, :, -W:, :]), 0
        else:  # one concatenate (a new array) of the rows still in the window and the new ones
            q = self.ordered()
            self.q, self.at = mx.concatenate([q[:, :, max(q.shape[2] + S - W, 0):], queries], 2), 0

    def ordered(self):
        """(B, H_q, W, D) the window's queries, oldest first (None before any)."""
        q, at = self.q, self.at
        if q is None or not at:
            return q
        return mx.concatenate([q[:, :, at:], q[:, :, :at]], axis=2)

    def load(self, q) -> None:
        self.q, self.at = q, 0
