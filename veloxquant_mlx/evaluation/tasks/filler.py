"""Seeded building blocks of the task generators: word lists, keys, values, prose filler, and the
placement of facts at depths in a haystack."""

from __future__ import annotations

import random
import re

from ..passkey import prose_paragraphs

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

def rng_for(task: str, length: int, index: int, seed: int) -> random.Random:
    return random.Random(f"{task}|{length}|{index}|{seed}")


def keys(rng, n: int) -> list:
    out = []
    while len(out) < n:
        k = f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"
        if k not in out:
            out.append(k)
    return out


def values(rng, n: int, digits: int = 5) -> list:
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


def insert(units: list, needles: list, depths: list) -> str:
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


def depths(rng, n: int) -> list:
    """``n`` sorted depths in (0.05, 0.95), one per equal stratum, so facts spread over the text."""
    return sorted(round(0.05 + 0.9 * (i + rng.random()) / n, 3) for i in range(n))
