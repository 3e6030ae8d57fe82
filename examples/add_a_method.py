"""A complete eviction method in one file: TOVA, keep the tokens the newest query attends to most.

The rule is Oren et al., "Transformers are Multi-State RNNs" (EMNLP 2024). Deviation: the paper
averages the newest query's attention over all heads of a layer; here each KV head ranks its own rows
by its query group's average (per-head budgets, like the other methods). Importing this file registers
it; tests/conftest.py does, so the whole test suite (contract, batching, save/load, memory,
distributed) runs it like a built-in method. See docs/add_a_method.md.
"""

import dataclasses

from veloxquant_mlx import Method, Needs, register
from veloxquant_mlx.options import evict_every


@dataclasses.dataclass
class TOVAOptions:
    evict_every: int = evict_every()


@register("tova")
class TOVA(Method):
    """TOVA: keep sinks, the recent window and the tokens the newest query attends to most."""

    Options = TOVAOptions
    needs = Needs(window=1)  # the newest query is the only one that scores

    def scores(self, view):
        # the window's softmax attention (B, H, G, 1, rows), averaged over the GQA group and the one query
        # (no query seen yet, no tap: the newest key stands in)
        return view.window_attention(lambda probs: probs.mean(axis=(2, 3)))
