"""Schedule: when a cache evicts, and to how many rows.

``config.prompt_eviction`` and the method's ``prefill_only`` decide: ``"end"`` holds the prompt and
compresses it once when it ends (right after its first single-token step), ``"stream"`` also evicts when a
prompt chunk passes the threshold, ``"offload"`` pages the prompt (``caches.pages``) and compresses once
at its end as ``"end"`` does. Decode-bounded methods evict once the stored rows pass the threshold
(the rows kept plus the slack: amortized), prefill-only ones only append after the prompt.

The schedule also says where a cache stands between prompt and decode (``open``, ``ending``,
``saw_decode``), and what an eviction keeps: the budget, a compression's own target, or the share a
ranking across layers gave the layer.
"""

from __future__ import annotations

import contextlib


class Schedule:
    def __init__(self, policy: str, prefill_only: bool, budget: int, slack: int, decode_step: int):
        self.policy, self.prefill_only, self.budget, self.slack = policy, prefill_only, budget, slack
        self.decode_step = decode_step  # rows a prefill-only method's buffer gets after its compression
        self.saw_decode = False  # a single-token step ran: a new prompt after it reuses the cache
        self.open = False  # prompt text arrived since the last single-token step
        self.ending = False  # this single-token step ends the prompt: compress after its attention
        self.compressing = False  # inside the one-shot compression's eviction
        self.target = None  # rows per head that compression keeps, when not the budget
        self.floor = 0  # rows right after the last eviction (above the keep only for ragged storage)
        self.share = None  # rows per head a ranking across layers gave this layer (decode keeps it)

    @contextlib.contextmanager
    def compressing_to(self, target: int | None = None):
        """The one-shot compression's eviction, to ``target`` rows per head (None: the keep)."""
        self.compressing, self.target = True, target
        try:
            yield
        finally:
            self.compressing, self.target = False, None

    def keep(self) -> int:
        """Rows per head an eviction keeps: a compression's target, else the layer's share, else the budget."""
        if self.target is not None:
            return self.target
        return self.budget if self.share is None else self.share

    def threshold(self) -> int:
        """Stored rows above which a decode-bounded method evicts: the rows it keeps (or the last eviction's,
        ragged heads) plus the slack."""
        return max(self.keep(), self.floor) + self.slack

    def headroom(self, kept: int) -> int:
        """Rows allocated beyond the ``kept`` ones after an eviction: up to the threshold plus the token that
        crosses it (decode-bounded), or one decode step of rows (prefill-only: decode appends)."""
        if self.prefill_only:
            return self.decode_step
        return max(self.keep(), kept) + self.slack + 1 - kept

    def compresses_at_end(self) -> bool:
        """Compress once when the prompt ends? Prefill-only methods always; decode-bounded ones under
        ``"end"`` (the paper's prefill + decode setting) and ``"offload"``."""
        return self.prefill_only or self.policy in ("end", "offload")

    def streams(self) -> bool:
        """Prompt chunks evict as they stream in (``"stream"``, a decode-bounded method)."""
        return self.policy == "stream" and not self.prefill_only

    def evicts_during(self, S: int) -> bool:
        """Does a step of S new rows evict past the threshold? Prompt chunks (S > 1) only under ``"stream"``;
        single tokens only for decode-bounded methods."""
        return self.policy == "stream" if S > 1 else not self.prefill_only
