"""Where a passkey's key tokens sit in the prompt, and how each (layer, head)'s kept set treats them
(a needle cut at a block boundary answers wrong although most of it is kept)."""

from __future__ import annotations

import re


def key_token_spans(tokenizer, tokens, needle_pos: int, key: str, window: int = 64) -> list:
    """Prompt positions of the key's tokens, one list per occurrence of ``key`` in the needle.

    Tokens from a few before ``needle_pos`` to ``window`` after it are decoded one by one; a token
    belongs to an occurrence when its text overlaps the occurrence's characters."""
    lo, hi = max(needle_pos - 4, 0), min(needle_pos + window, len(tokens))
    text, starts = "", []
    for i in range(lo, hi):
        starts.append(len(text))
        text += tokenizer.decode([tokens[i]])
    ends = starts[1:] + [len(text)]
    spans = []
    for m in re.finditer(re.escape(key), text):
        s = [lo + j for j in range(len(starts)) if starts[j] < m.end() and ends[j] > m.start()]
        if s:
            spans.append(s)
    return spans


def needle_cut_stats(caches, spans: list) -> dict:
    """How the kept set of every (layer, head) treats the key's token spans.

    ``needle_cut_frac``: fraction of (layer, head) pairs where some occurrence is cut (some of its
    tokens kept, some evicted); ``needle_kept_frac``: mean fraction of the key tokens kept;
    ``needle_whole_frac``: fraction of pairs that keep at least one occurrence whole. A cache without
    ``kept_positions`` (mlx-lm's KVCache) keeps everything."""
    import numpy as np

    if not spans:
        return {}
    n_tok = sum(len(s) for s in spans)
    cut = kept = whole = pairs = 0
    for c in caches:
        kp = getattr(c, "kept_positions", None)
        if kp is None:
            pairs += 1
            kept += 1.0
            whole += 1
            continue
        arr = np.array(kp())
        if arr.size == 0:
            continue
        for row in arr.reshape(-1, arr.shape[-1]):
            have = set(int(v) for v in row if v >= 0)
            counts = [sum(p in have for p in s) for s in spans]
            pairs += 1
            cut += any(0 < k < len(s) for k, s in zip(counts, spans))
            whole += any(k == len(s) for k, s in zip(counts, spans))
            kept += sum(counts) / n_tok
    if pairs == 0:
        return {}
    return {"needle_cut_frac": round(cut / pairs, 4), "needle_kept_frac": round(kept / pairs, 4),
            "needle_whole_frac": round(whole / pairs, 4), "needle_key_tokens": [list(s) for s in spans]}
