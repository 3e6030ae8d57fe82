"""A complete eviction method in one file: TOVA, keep the tokens the newest query attends to most.

The rule is Oren et al., "Transformers are Multi-State RNNs" (EMNLP 2024). Deviation: the paper
averages the newest query's attention over all heads of a layer; here each KV head ranks its own rows
by its query group's average (per-head budgets, like the other methods). Importing this file registers
it; tests/conftest.py does, so the whole test suite (contract, batching, save/load, memory,
distributed) runs it like a built-in method. See docs/add_a_method.md.
"""

import dataclasses

from veloxquant_mlx import EvictionCache, register
from veloxquant_mlx.ops import window_attention_probs
from veloxquant_mlx.options import option


@dataclasses.dataclass
class TOVAOptions:
    evict_every: int = option(32, low=1, small=4, doc="rows allowed above the budget before one eviction step")


@register("tova")
class TOVAKVCache(EvictionCache):
    """TOVA: keep sinks, the recent window and the tokens the newest query attends to most."""

    Options = TOVAOptions
    query_window = 1  # the newest query is the only one that scores

    def scores(self):
        q, q_pos, scale = self.observed_window()  # no query observed yet (no tap): the newest key stands in
        probs = window_attention_probs(q, self.stored("keys"), q_pos, self.stored("positions"), scale)
        return probs.mean(axis=(2, 3))  # (B, H, G, 1, rows) -> (B, H, rows)
