"""Offline, seeded task generators for the generate-path evaluation (``eval tasks``).

Two families, re-implemented from their published descriptions (no code or prose copied):

* **RULER-style synthetic tasks** (Hsieh et al., 2024, "RULER: What's the Real Context Size of
  Your Long-Context Language Models?", Section 3): needle single / multikey / multivalue /
  multiquery, variable tracking and common-words extraction.
* **The follow-up turn**: a prose haystack hides 2-4 facts; turn 1 asks for one, and every later
  turn continues the SAME cache (the new user turn fed as one multi-token input, as ``serve``'s
  multi-turn reuse does) and asks for another.

An instance is a context, a preface and a list of :class:`Turn` (question, the start of the
assistant's reply and the expected answers). :func:`build` fits the number of filler units so the
rendered first prompt (chat template, question and reply prefix included) is at most ``length``
tokens of the model's own tokenizer and as close to it as one filler unit allows. Prompt rendering
and scoring live in :mod:`.task_prompts`.
"""

from __future__ import annotations

import dataclasses
import random
import re

from .passkey import GRASS, prose_paragraphs
from .task_prompts import render_first

# Own word lists for keys: "<adjective>-<noun>" gives 2,048 distinct keys.
_ADJ = ("amber", "brave", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen", "lively",
        "mellow", "noble", "odd", "pale", "quiet", "rapid", "silent", "tall", "upper", "vivid", "wild", "young",
        "bitter", "clever", "damp", "empty", "fancy", "golden", "hasty", "lucky")
_NOUN = ("anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket",
         "kettle", "lantern", "meadow", "needle", "orchard", "pepper", "quarry", "rabbit", "saddle", "tiger",
         "umbrella", "valley", "walnut", "yacht", "zebra", "basket", "cactus", "desert", "feather", "glacier",
         "hammer", "insect", "jungle", "ladder", "mirror", "nectar", "oyster", "pillow", "river", "sparrow",
         "tunnel", "violin", "window", "bridge", "castle", "forest", "helmet", "marble", "pebble", "rocket",
         "spider", "timber", "velvet", "wagon", "blossom", "canyon", "dragon", "ember", "fossil", "gravel",
         "hornet", "iron", "lemon", "magnet")

TASKS = ("followup", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe")

_PREFACE_NEEDLE = ("Some special magic numbers are hidden inside the following text. Read it carefully and "
                   "remember them: I will ask about the numbers afterwards.\n\n")
_NEEDLE = "The special magic number for {key} is {value}."


@dataclasses.dataclass(frozen=True)
class Turn:
    """One question. ``kind``: "number" (the first number of the reply must equal ``expected[0]``),
    "numbers" or "words" (every expected item must be returned and no item of ``wrong``)."""

    question: str
    reply_prefix: str
    expected: tuple
    kind: str
    max_new_tokens: int
    wrong: tuple = ()  # answers present in the prompt that are wrong for this question


@dataclasses.dataclass(frozen=True)
class Instance:
    task: str
    length: int  # target length (tokens)
    index: int
    preface: str
    context: str
    turns: tuple
    info: tuple = ()  # sorted (key, value) pairs: depths, counts

    @property
    def answers_in_text(self) -> bool:
        """Every expected answer of every turn occurs in the context (a sanity check)."""
        return all(a in self.context for t in self.turns for a in t.expected)


def _rng(task: str, length: int, index: int, seed: int) -> random.Random:
    return random.Random(f"{task}|{length}|{index}|{seed}")


def _keys(rng, n: int) -> list:
    out = []
    while len(out) < n:
        k = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if k not in out:
            out.append(k)
    return out


def _values(rng, n: int, digits: int = 5) -> list:
    out = []
    while len(out) < n:
        v = str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))
        if v not in out:
            out.append(v)
    return out


def prose_sentences(seed: int) -> list:
    """Digit-free prose sentences (Python docs paragraphs, shuffled by ``seed``, then split)."""
    paras = list(prose_paragraphs(False))
    random.Random(seed).shuffle(paras)
    return [s for p in paras for s in re.split(r"(?<=[.!?])\s+", p) if s]


def long_filler(seed: int, passes: int = 3) -> list:
    """Sentences for a haystack: the prose shuffled by ``seed``, then reshuffled passes after it (one
    pass is about 20K tokens; 32K-token prompts need more). A prompt that fits in the first pass is
    the same as with one pass."""
    return [s for k in range(passes) for s in prose_sentences(seed + k * 104729)]


def _insert(units: list, needles: list, depths: list) -> str:
    """Join ``units`` with each needle placed on a unit boundary at its depth (0..1)."""
    slots = {}
    for nd, d in zip(needles, depths):
        slots.setdefault(int(round(d * len(units))), []).append(nd)
    out = []
    for i in range(len(units) + 1):
        out.extend(slots.get(i, []))
        if i < len(units):
            out.append(units[i])
    return " ".join(out)


def _depths(rng, n: int) -> list:
    """``n`` sorted depths in (0.05, 0.95), one per equal stratum, so facts spread over the text."""
    return sorted(round(0.05 + 0.9 * (i + rng.random()) / n, 3) for i in range(n))


# ---- the generators: each returns a function n_units -> Instance ---------------------------------

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


def _vt(length, index, seed, hops: int = 4, chains: int = 2):
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


def cwe_vocabulary() -> tuple:
    """Lower-case words of 4-9 letters from the prose (sorted, deterministic)."""
    words = set()
    for p in prose_paragraphs(False):
        words.update(w for w in re.findall(r"\b[a-z]{4,9}\b", p))
    return tuple(sorted(words))


def _cwe(length, index, seed, n_common: int = 10, f_common: int = 6, f_rare: int = 2):
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


def generator(task: str, length: int, index: int, seed: int = 0, n_facts: int = 3):
    """(make(n_units) -> Instance, max_units) for one prompt."""
    if task == "followup":
        if not 2 <= n_facts <= 4:
            raise ValueError(f"followup wants 2-4 facts, got {n_facts}")
        return _needle_task(task, length, index, seed, n_facts, 1, n_facts, followup=True)
    if task == "niah_single":
        return _needle_task(task, length, index, seed, 1, 1, 1)
    if task == "niah_multikey":
        return _needle_task(task, length, index, seed, 4, 1, 1)
    if task == "niah_multivalue":
        return _needle_task(task, length, index, seed, 1, 4, 1)
    if task == "niah_multiquery":
        return _needle_task(task, length, index, seed, 4, 1, 4)
    if task == "vt":
        return _vt(length, index, seed)
    if task == "cwe":
        return _cwe(length, index, seed)
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def build(tokenizer, task: str, length: int, index: int, seed: int = 0, n_facts: int = 3) -> tuple:
    """(Instance, first-turn prompt tokens): the most filler whose rendered first prompt has at most
    ``length`` tokens (binary search over filler units; the tokenizer measures every candidate)."""
    make, hi = generator(task, length, index, seed, n_facts)

    def size(n):
        return len(render_first(tokenizer, make(n)))

    lo = 0
    if size(0) > length:
        raise ValueError(f"{task}: length {length} is below the task's fixed part ({size(0)} tokens)")
    hi = min(hi, 4 * length)  # a unit is at least one token
    if size(hi) <= length:
        raise ValueError(f"{task}: not enough filler for {length} tokens")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if size(mid) <= length:
            lo = mid
        else:
            hi = mid
    inst = make(lo)
    return inst, render_first(tokenizer, inst)
