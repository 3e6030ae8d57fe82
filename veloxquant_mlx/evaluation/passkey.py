"""Passkey / needle prompts: a key hidden at a chosen depth inside filler text, asked for at the end."""

from __future__ import annotations

import functools
import random
import re

GRASS = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
          "I will quiz you about the important information there.\n")
_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_needle(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def make_passkey_prompt(tokenizer, n_tokens: int, depth: float, key: str, filler: str = GRASS,
                        needle: str | None = None, question: str = _QUESTION) -> tuple[list, int]:
    """Token ids of a prompt of about ``n_tokens`` tokens with the needle at ``depth`` (0..1).

    Returns (tokens, needle_token_position). Filler repeats (or is cut) to fill the budget; the
    needle sits on a sentence boundary so it is not split oddly.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    needle = needle or passkey_needle(key)
    fixed = len(tokenizer.encode(_INTRO + needle + question))
    if n_tokens <= fixed + 8:
        raise ValueError(f"n_tokens={n_tokens} is too small for the passkey template ({fixed} tokens)")
    per = max(len(tokenizer.encode(filler)), 1)
    reps = -(-(n_tokens - fixed) // per) + 1
    text = filler * reps
    sentences = re.split(r"(?<=[.!?])\s+", text)
    body_tokens = n_tokens - fixed
    # Grow the filler sentence by sentence until the token budget is met.
    pieces, count = [], 0
    for s in sentences:
        if count >= body_tokens:
            break
        pieces.append(s)
        count += len(tokenizer.encode(" " + s))
    cut = int(round(depth * len(pieces)))
    before, after = " ".join(pieces[:cut]), " ".join(pieces[cut:])
    head = _INTRO + (before + " " if before else "")
    tokens = tokenizer.encode(head + needle + after + question)
    needle_pos = len(tokenizer.encode(head))
    return tokens, needle_pos


def extract_digits(text: str) -> str:
    m = re.search(r"\d+", text)
    return m.group(0) if m else ""


@functools.lru_cache(maxsize=4)
def prose_paragraphs(allow_digits: bool = False) -> tuple:
    """Prose paragraphs from ``pydoc_data.topics`` (code blocks and, by default, digits removed)."""
    from pydoc_data.topics import topics

    paras = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.strip("\n").splitlines()
            if not lines or any(l.startswith((" ", "\t", ">>>")) for l in lines):
                continue  # indented = code / grammar / tables
            p = " ".join(l.strip() for l in lines)
            if len(p) < 80 or p.count(".") < 1 or "*" in p or "::" in p:
                continue
            if not allow_digits and re.search(r"\d", p):
                continue
            letters = sum(ch.isalpha() or ch == " " for ch in p) / len(p)
            if letters < 0.85:
                continue
            paras.append(p)
    return tuple(paras)


def prose_text(seed: int = 0, min_chars: int = 200_000, allow_digits: bool = False) -> str:
    """Deterministically shuffled prose paragraphs joined into one text."""
    paras = list(prose_paragraphs(allow_digits))
    random.Random(seed).shuffle(paras)
    out, n = [], 0
    for p in paras:
        out.append(p)
        n += len(p) + 1
        if n >= min_chars:
            break
    return " ".join(out)
