"""One prompt pass feeding several cache lists at once (the shared prefill of ``eval passkey`` and
``eval tasks``): under ``prompt_eviction="end"`` nothing is evicted before the prompt ends, so every
list sees exactly what it would see alone. The cells of one such pass are stored together."""

from __future__ import annotations

import time

import mlx.core as mx

from ..decode import feed_prompt
from .results import now


def _any_sub(flag: str) -> property:
    """True when any sub-cache's ``flag`` is."""
    return property(lambda self: any(getattr(c, flag, False) for c in self.subs.values()))


def _to_subs_that(flag: str, name: str) -> property:
    """A value set on the fan-out goes to ``name`` of every sub-cache whose ``flag`` is true (it reads None)."""

    def hand_on(self, value) -> None:
        for c in self.subs.values():
            if getattr(c, flag, False):
                setattr(c, name, value)

    return property(lambda self: None, hand_on)


class FanOutCache:
    """One layer's cache that feeds every prefill step to several caches at once.

    Attention uses the primary (full ``KVCache``) rows; every sub-cache receives the same keys,
    values and (through the query tap) queries and evicts on its own. For a prompt fed as ONE chunk
    into empty caches this is exactly the computation each sub-cache would see alone (its fetch is
    just the new rows), so the prefill-only regime needs one forward pass per prompt instead of one
    per method. A sub-cache that raises is dropped and its error recorded."""

    pass_due = False  # the shared prefill holds the prompt ("end"): no compression waits for a model pass

    def __init__(self, primary, subs: dict, dequantize: bool = False):
        self.primary = primary
        self.subs = dict(subs)
        self.errors: dict = {}
        self.dequantize = dequantize

    def __getattr__(self, name):
        # A quantized primary's bits / group_size make mlx-lm's attention take its quantized path
        # (exactly what each cache would get alone), unless its rows are read dequantized.
        if name in ("bits", "group_size") and not self.__dict__.get("dequantize", True):
            return getattr(self.__dict__["primary"], name)
        raise AttributeError(name)

    @property
    def offset(self):
        return self.primary.offset

    def make_mask(self, *a, **k):
        return self.primary.make_mask(*a, **k)

    def _each(self, fn_name, *args):
        for name, c in list(self.subs.items()):
            fn = getattr(c, fn_name, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception as e:
                self.errors[name] = f"{type(e).__name__}: {e}"
                del self.subs[name]

    def update_and_fetch(self, keys, values):
        self._each("update_and_fetch", keys, values)
        k, v = self.primary.update_and_fetch(keys, values)
        if isinstance(k, tuple) and self.dequantize:
            # Opt-in shortcut: the stored 4/8-bit values through the float attention path. mlx-lm's
            # quantized attention reads the same values, but its CPU kernel has no BLAS (~6x slower
            # at 1K); the summation order differs, and on a real model that changes some answers.
            gs, bits = self.primary.group_size, self.primary.bits
            k, v = (mx.dequantize(*k, group_size=gs, bits=bits), mx.dequantize(*v, group_size=gs, bits=bits))
        return k, v

    def observe_queries(self, queries, scale=None):
        self._each("observe_queries", queries, scale)

    # the model-pass wrapper's token ids and the hidden-state tap's attention input, each for the sub-caches
    # whose method reads it; and whether the wrapper drives this forward
    needs_ids, input_ids = _any_sub("needs_ids"), _to_subs_that("needs_ids", "input_ids")
    needs_hidden, attention_input = _any_sub("needs_hidden"), _to_subs_that("needs_hidden", "attention_input")

    @property
    def pass_driven(self) -> bool:
        return any(getattr(c, "pass_driven", False) for c in self.subs.values())

    @pass_driven.setter
    def pass_driven(self, on: bool) -> None:
        for c in self.subs.values():
            if hasattr(c, "pass_driven"):
                c.pass_driven = on

    def attention_mask(self, mask, queries):
        return mask

    @property
    def state(self):
        return [self.primary.state] + [c.state for c in self.subs.values()]


def _arrays(tree):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(tree) if isinstance(v, mx.array)]


def shared_pass(model, x, primary, named: dict, prefill_step: int, dequantize: bool = False) -> tuple:
    """All but the last prompt id of ``x`` once through ``primary`` (one layer cache each) and every
    cache list of ``named`` ({name: per-layer caches}). Returns (seconds, {name: error} of the lists
    that raised)."""
    fans = [FanOutCache(primary[i], {n: cs[i] for n, cs in named.items()}, dequantize) for i in range(len(primary))]
    t0 = time.perf_counter()
    feed_prompt(model, x, fans, prefill_step)
    mx.eval(_arrays([f.state for f in fans]))
    errors = {}
    for f in fans:
        for n, e in f.errors.items():
            errors.setdefault(n, e)
    return time.perf_counter() - t0, errors


def run_shared_cells(store, my: str, run_group, missing: dict | None = None) -> dict:
    """The cells that share one pass with cell ``my``: ``run_group()`` returns {cell id: record}; every
    record but ``my``'s is stored at once (resumable), each timed as an equal share of the pass.
    Returns ``my``'s record (``missing`` when the group lacks it: another worker holds the cell)."""
    t = time.perf_counter()
    recs = run_group()
    share = (time.perf_counter() - t) / max(len(recs), 1)
    for cid, r in recs.items():
        r["cell_s"] = round(share, 3)
        r["finished"] = now()
        if cid != my:
            store.put(cid, r)
    return dict(recs[my] if my in recs or missing is None else missing)
