"""RULER-style variable tracking (``vt``): chains of assignments hidden in noise."""

from __future__ import annotations

import re

from ..passkey import GRASS
from .base import Instance, Turn, register_task
from .filler import depths as _depths, insert as _insert, rng_for as _rng, values as _values


@register_task("vt")
def vt(length, index, seed, n_facts=3, hops: int = 4, chains: int = 2):
    """Variable tracking: ``chains`` chains ``VAR A = v; VAR B = VAR A; ...`` (``hops`` links each) in
    noise; the question gives chain 0's value and wants every name bound to it (the other chain's
    names are wrong answers)."""
    rng = _rng("vt", length, index, seed)
    names = []
    while len(names) < chains * (hops + 1):
        w = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if w not in names:
            names.append(w)
    vals = _values(rng, chains, 5)
    stmts, chain_names = [], []
    for c in range(chains):
        nm = names[c * (hops + 1):(c + 1) * (hops + 1)]
        chain_names.append(nm)
        stmts.append([f"VAR {nm[0]} = {vals[c]}."] + [f"VAR {nm[j]} = VAR {nm[j - 1]}." for j in range(1, hops + 1)])
    # Interleave the chains in order of appearance; each statement gets its own depth.
    order = [s for pair in zip(*stmts) for s in pair]
    depths = _depths(rng, len(order))
    noise = re.split(r"(?<=[.!?])\s+", GRASS.strip())
    turn = Turn(f"Find every variable that is assigned the value {vals[0]} in the text above.",
                f"Following the chain of assignments, the variables assigned the value {vals[0]} are:",
                tuple(chain_names[0]), "words", 8 * (hops + 1), tuple(n for ch in chain_names[1:] for n in ch))
    preface = "Memorize the variable assignments hidden in the following text.\n\n"

    def make(n):
        units = [noise[i % len(noise)] for i in range(n)]
        return Instance("vt", length, index, preface, _insert(units, order, depths), (turn,),
                        (("depths", tuple(depths)), ("hops", hops), ("chains", chains)))

    return make, 100_000
