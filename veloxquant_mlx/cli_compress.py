"""Compress once, ask many: ``python -m veloxquant_mlx compress`` and ``generate --prompt-cache``.

``compress`` reads a document, feeds it through the model exactly as ``mlx_lm.generate`` would
(all but the last token in prefill chunks, then the last token alone: the prompt's end, where KVzip
runs its reconstruction pass and every layer evicts to the budget) and saves the compressed caches
with ``save_prompt_cache``. ``generate --prompt-cache FILE --prompt "question"`` loads a FRESH copy
of that file each time and continues it with the question, so one compressed document answers any
number of questions. With a chat template the document opens a user turn and the question closes it
(the template's tail is stored in the file's metadata).

This module imports nothing of ``cli.py`` (which dispatches to it).
"""

from __future__ import annotations

import os
import time

FORMAT = "veloxquant-compressed-document/1"
_MARK = "\x00VQ-DOCUMENT-END\x00"


def _split_template(tokenizer, text: str, use_chat: bool):
    """(document token ids, text that closes the turn after the question)."""
    if use_chat and getattr(tokenizer, "has_chat_template", False):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text + _MARK}], tokenize=False,
                                                 add_generation_prompt=True)
        head, _, tail = rendered.partition(_MARK)
        if _:
            return list(tokenizer.encode(head, add_special_tokens=False)), tail
    return list(tokenizer.encode(text)), ""


def compress_document(model, tokenizer, text: str, config, out: str, prefill_step_size: int = 2048,
                      use_chat: bool = True, model_spec: str = "") -> dict:
    """Feed ``text`` through ``config``'s caches, compress at its end, save to ``out``."""
    import mlx.core as mx

    from .builder import KVCacheBuilder
    from .mlx_lm_compat import save_prompt_cache

    tokens, tail = _split_template(tokenizer, text, use_chat)
    if len(tokens) < 2:
        raise ValueError(f"the document is {len(tokens)} token(s): nothing to compress")
    caches = KVCacheBuilder.for_model(model, config, tokenizer=tokenizer)
    x = mx.array(tokens)[None]
    t0 = time.perf_counter()
    n = x.shape[1]
    for s in range(0, n - 1, prefill_step_size):  # mlx_lm.generate's prefill: all but the last token
        model(x[:, s:min(s + prefill_step_size, n - 1)], cache=caches)
        mx.eval([c.state for c in caches])
    model(x[:, n - 1:], cache=caches)  # the prompt's end: the compression (KVzip: its pass) runs here
    mx.eval([c.state for c in caches])
    seconds = time.perf_counter() - t0
    meta = {"format": FORMAT, "tokens": n, "turn_tail": tail, "model": model_spec,
            "config": config.to_json(), "compress_s": round(seconds, 3)}
    save_prompt_cache(out, caches, meta)
    held = sum(c.nbytes for c in caches if getattr(c, "keys", None) is not None)
    return {"tokens": n, "seconds": seconds, "file_bytes": os.path.getsize(out), "allocated_bytes": held,
            "caches": caches}


def load_for_question(model, tokenizer, path: str):
    """A fresh copy of the compressed caches, ready to continue (query tap and model pass installed),
    and the file's metadata."""
    from .distributed import attach, resolve_group
    from .mlx_lm_compat import install_query_tap, load_prompt_cache
    from .model_pass import install_model_pass

    caches, meta = load_prompt_cache(path, return_metadata=True)
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path!r} was not written by `compress` (format {meta.get('format')!r})")
    install_query_tap(model)
    if any(getattr(c, "needs_model_pass", False) for c in caches):
        install_model_pass(model, tokenizer)
    attach(caches, resolve_group(model, None))
    for c in caches:
        if hasattr(c, "continue_on_purpose"):
            c.continue_on_purpose()  # continuing the document is the point
    return caches, meta


def question_tokens(tokenizer, meta: dict, question: str) -> list:
    """The question as the continuation of the document's turn (no second BOS)."""
    return list(tokenizer.encode("\n\n" + question + meta.get("turn_tail", ""), add_special_tokens=False))
