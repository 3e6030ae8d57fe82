"""RULER-style common-words extraction (``cwe``): the most frequent words of a numbered list."""

from __future__ import annotations

import random
import re

from ..passkey import prose_paragraphs
from .base import Instance, Turn, register_task
from .filler import rng_for as _rng


def cwe_vocabulary() -> tuple:
    """Lower-case words of 4-9 letters from the prose (sorted, deterministic)."""
    words = set()
    for p in prose_paragraphs(False):
        words.update(w for w in re.findall(r"\b[a-z]{4,9}\b", p))
    return tuple(sorted(words))


@register_task("cwe")
def cwe(length, index, seed, n_facts=3, n_common: int = 10, f_common: int = 6, f_rare: int = 2):
    """Common-words extraction: a numbered list where ``n_common`` words occur ``f_common`` times
    and the others ``f_rare`` times; the answer is the ``n_common`` most frequent words."""
    rng = _rng("cwe", length, index, seed)
    vocab = list(cwe_vocabulary())
    rng.shuffle(vocab)
    common, rare = vocab[:n_common], vocab[n_common:]
    turn_wrong = tuple(rare[:2000])
    q = f"What are the {n_common} most common words in the list above?"
    turn = Turn(q, f"The {n_common} words that occur most often in the list are:", tuple(common), "words",
                5 * n_common, turn_wrong)
    preface = "Below is a numbered list of words. Some words appear more often than others.\n\n"

    def make(n):  # n = number of rare words
        items = common * f_common + rare[:n] * f_rare
        r = random.Random(f"cwe-order|{length}|{index}|{seed}|{n}")
        r.shuffle(items)
        ctx = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return Instance("cwe", length, index, preface, ctx, (turn,), (("n_rare", n), ("f_common", f_common),
                                                                     ("f_rare", f_rare)))

    return make, len(rare)
