"""RULER-style needle tasks and the follow-up turn (re-implemented from their published descriptions:
Hsieh et al., 2024, "RULER: What's the Real Context Size of Your Long-Context Language Models?",
Section 3; no code or prose copied).

Needle tasks (single / multikey / multivalue / multiquery) hide "special magic number" facts in a
prose haystack and ask for some of them. The follow-up turn hides 2-4 facts; turn 1 asks for one,
and every later turn continues the SAME cache (the new user turn fed as one multi-token input, as
``serve``'s multi-turn reuse does) and asks for another.
"""

from __future__ import annotations

from .base import Instance, Turn, register_task
from .filler import depths as _depths, insert as _insert, keys as _keys, long_filler, rng_for as _rng, values as _values

_PREFACE_NEEDLE = ("Some special magic numbers are hidden inside the following text. Read it carefully and "
                   "remember them: I will ask about the numbers afterwards.\n\n")
_NEEDLE = "The special magic number for {key} is {value}."


def _needle_task(task, length, index, seed, n_keys, n_values, n_asked, followup=False):
    rng = _rng(task, length, index, seed)
    keys = _keys(rng, n_keys)
    vals = _values(rng, n_keys * n_values)
    facts = [(keys[i // n_values], vals[i]) for i in range(len(vals))]
    rng.shuffle(facts)
    depths = _depths(rng, len(facts))
    filler = long_filler(seed * 7919 + index)
    needles = [_NEEDLE.format(key=k, value=v) for k, v in facts]
    asked = keys[:n_asked]
    if followup:
        turns = tuple(Turn(f"What is the special magic number for {k} mentioned in the text?",
                           f"The special magic number for {k} mentioned in the text is",
                           (dict(facts)[k],), "number", 10, tuple(v for kk, v in facts if kk != k))
                      for k in asked)
    elif n_values > 1:  # multivalue: one key, every value
        k = asked[0]
        turns = (Turn(f"What are all the special magic numbers for {k} mentioned in the text?",
                      f"The special magic numbers for {k} mentioned in the text are",
                      tuple(v for kk, v in facts if kk == k), "numbers", 12 * n_values,
                      tuple(v for kk, v in facts if kk != k)),)
    elif n_asked > 1:  # multiquery: several keys at once
        names = ", ".join(asked[:-1]) + " and " + asked[-1]
        turns = (Turn(f"What are all the special magic numbers for {names} mentioned in the text?",
                      f"The special magic numbers for {names} mentioned in the text are",
                      tuple(dict(facts)[k] for k in asked), "numbers", 12 * n_asked,
                      tuple(v for kk, v in facts if kk not in asked)),)
    else:  # single / multikey (the other keys are distractors)
        k = asked[0]
        turns = (Turn(f"What is the special magic number for {k} mentioned in the text?",
                      f"The special magic number for {k} mentioned in the text is",
                      (dict(facts)[k],), "number", 10, tuple(v for kk, v in facts if kk != k)),)

    def make(n):
        return Instance(task, length, index, _PREFACE_NEEDLE, _insert(filler[:n], needles, depths), turns,
                        (("depths", tuple(depths)), ("facts", len(facts))))

    return make, len(filler)


@register_task("followup")
def followup(length, index, seed, n_facts):
    if not 2 <= n_facts <= 4:
        raise ValueError(f"followup wants 2-4 facts, got {n_facts}")
    return _needle_task("followup", length, index, seed, n_facts, 1, n_facts, followup=True)


@register_task("niah_single")
def niah_single(length, index, seed, n_facts):
    return _needle_task("niah_single", length, index, seed, 1, 1, 1)


@register_task("niah_multikey")
def niah_multikey(length, index, seed, n_facts):
    return _needle_task("niah_multikey", length, index, seed, 4, 1, 1)


@register_task("niah_multivalue")
def niah_multivalue(length, index, seed, n_facts):
    return _needle_task("niah_multivalue", length, index, seed, 1, 4, 1)


@register_task("niah_multiquery")
def niah_multiquery(length, index, seed, n_facts):
    return _needle_task("niah_multiquery", length, index, seed, 4, 1, 4)
