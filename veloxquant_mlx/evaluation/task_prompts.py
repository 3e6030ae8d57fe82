"""Prompt rendering and scoring for :mod:`.tasks`.

Rendering follows the CLI: with a chat template, the user message goes through
``apply_chat_template(..., add_generation_prompt=True)``; without one (a base model), the plain
text. The assistant's reply is started with the turn's ``reply_prefix`` (RULER's answer prefix, so
a small model answers instead of chatting). A later turn is the conversation re-rendered with the
previous reply, minus what the cache already holds: the new user turn, fed as one multi-token input
the way ``serve`` continues a stored conversation.
"""

from __future__ import annotations

import re


def _has_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "has_chat_template", False))


def _user(inst, k: int) -> str:
    t = inst.turns[k]
    return inst.preface + inst.context + "\n\n" + t.question if k == 0 else t.question


def render_text(tokenizer, inst, replies: list) -> str:
    """The conversation text up to the prompt of turn ``len(replies)`` (its reply prefix included);
    ``replies`` are the earlier assistant replies (reply prefix + generated text)."""
    k = len(replies)
    if _has_template(tokenizer):
        msgs = []
        for i in range(k + 1):
            msgs.append({"role": "user", "content": _user(inst, i)})
            if i < k:
                msgs.append({"role": "assistant", "content": replies[i]})
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return text + inst.turns[k].reply_prefix
    parts = []
    for i in range(k + 1):
        parts.append(_user(inst, i) + "\n" + (replies[i] if i < k else inst.turns[k].reply_prefix))
    return "\n\n".join(parts)


def render_first(tokenizer, inst) -> list:
    """Token ids of the first prompt (special tokens as the tokenizer adds them, e.g. a BOS)."""
    return list(tokenizer.encode(render_text(tokenizer, inst, [])))


def split_question(tokenizer, inst) -> tuple:
    """(context ids, question ids) of the first prompt with the question left out of the context
    (kvpress's default: compress the context, then ask): the rendered first prompt cut where its
    question starts; the question part carries the rest of the template and the reply prefix."""
    text = render_text(tokenizer, inst, [])
    cut = text.rfind("\n\n" + inst.turns[0].question)
    if cut < 0:
        raise ValueError("the rendered prompt does not hold the question; cannot leave it out")
    return (list(tokenizer.encode(text[:cut])), list(tokenizer.encode(text[cut:], add_special_tokens=False)))


def continuation(tokenizer, inst, replies: list, last_token: int, eos_ids=()) -> list:
    """Token ids that continue a cache holding turn ``len(replies) - 1``'s prompt and its reply up to
    (not including) the reply's last token ``last_token``: that token, then the end of the reply as
    the template writes it and turn ``len(replies)``'s user message and reply prefix.

    The text is the re-rendered conversation minus the rendered prefix, so the tokens match what a
    server re-tokenizing the whole conversation would append (up to token boundaries at the seam)."""
    prev = render_text(tokenizer, inst, replies[:-1]) + replies[-1][len(inst.turns[len(replies) - 1].reply_prefix):]
    full = render_text(tokenizer, inst, replies)
    if not full.startswith(prev):
        raise ValueError("the chat template does not extend the previous turn's text; cannot continue the cache")
    rest = full[len(prev):]
    if last_token in eos_ids:
        eos_text = tokenizer.decode([last_token])
        if eos_text and rest.startswith(eos_text):
            rest = rest[len(eos_text):]
    return [int(last_token)] + list(tokenizer.encode(rest, add_special_tokens=False))


def reply_text(tokenizer, inst, k: int, out_tokens: list, eos_ids=()) -> str:
    """The assistant reply of turn ``k``: its prefix + the generated text (without a final EOS)."""
    toks = out_tokens[:-1] if out_tokens and out_tokens[-1] in eos_ids else out_tokens
    return inst.turns[k].reply_prefix + tokenizer.decode(toks)


# ---- scoring ---------------------------------------------------------------------------------

def found_items(text: str, kind: str) -> list:
    """Numbers (digit runs) or words (alphabetic runs, lower-cased unless upper-case names) in order."""
    if kind in ("number", "numbers"):
        return re.findall(r"\d+", text)
    return [w if w.isupper() else w.lower() for w in re.findall(r"[A-Za-z]+", text)]


def score(turn, output: str) -> dict:
    """{"correct": bool, "recall": float, "found": [...]} for one reply (the generated text only).

    "number": the first number of the reply equals the expected one. "numbers"/"words": every
    expected item is returned (recall 1) and none of the turn's ``wrong`` items is."""
    items = found_items(output, turn.kind)
    if turn.kind == "number":
        ok = bool(items) and items[0] == turn.expected[0]
        return {"correct": ok, "recall": float(ok), "found": items[:1]}
    exp = {e if e.isupper() or turn.kind == "numbers" else e.lower() for e in turn.expected}
    got = set(items)
    recall = len(exp & got) / len(exp)
    bad = got & set(turn.wrong)
    return {"correct": recall == 1.0 and not bad, "recall": round(recall, 4), "found": sorted(got & (exp | bad))}
