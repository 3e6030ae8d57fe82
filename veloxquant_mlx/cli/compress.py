"""``python -m veloxquant_mlx compress``: compress once, ask many (``generate --prompt-cache``).

``compress`` reads a document, feeds it through the model exactly as ``mlx_lm.generate`` would
(all but the last token in prefill chunks, then the last token alone: the prompt's end, where KVzip
runs its reconstruction pass and every layer evicts to the budget) and saves the compressed caches
with ``save_prompt_cache``. ``generate --prompt-cache FILE --prompt "question"`` loads a FRESH copy
of that file each time and continues it with the question, so one compressed document answers any
number of questions. With a chat template the document opens a user turn and the question closes it
(the template's tail is stored in the file's metadata).

Loading the file for a question lives in ``cli.document`` (shared with ``generate``).
"""

from __future__ import annotations

import os
import time

from .. import distributed
from ..caches.accounting import kv_report
from ..registry import FULL
from .args import (CLIError, add_cache_args, cache_spec, check_context, config_from_args, fit_kv_group, fmt_bytes,
                   kv_summary, load_model_for_cli, note_budget_past_context, note_pages, page_long_prompt, prompt_bar,
                   ranged, read_text)
from .document import DOCUMENT_FORMAT

_MARK = "\x00VQ-DOCUMENT-END\x00"


def split_template(tokenizer, text: str, use_chat: bool):
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

    from ..builder import KVCacheBuilder
    from ..prompt_cache import save_prompt_cache

    tokens, tail = split_template(tokenizer, text, use_chat)
    if len(tokens) < 2:
        raise ValueError(f"the document is {len(tokens)} token(s): nothing to compress")
    caches = KVCacheBuilder.for_model(model, config, tokenizer=tokenizer)
    x = mx.array(tokens)[None]
    t0 = time.perf_counter()
    n = x.shape[1]
    bar = prompt_bar(n)
    try:
        for s in range(0, n - 1, prefill_step_size):  # mlx_lm.generate's prefill: all but the last token
            model(x[:, s:min(s + prefill_step_size, n - 1)], cache=caches)
            mx.eval([c.state for c in caches])
            if bar is not None:
                bar.update(min(s + prefill_step_size, n - 1) - bar.n)
        if bar is not None:  # the pass has no progress hook of its own: say what runs
            notes = sorted({getattr(c, "model_pass_note", "") for c in caches} - {""})
            bar.set_description_str("compressing at the prompt's end" + (f" ({', '.join(notes)})" if notes else ""))
        model(x[:, n - 1:], cache=caches)  # the prompt's end: the compression (KVzip: its pass) runs here
        mx.eval([c.state for c in caches])
        if bar is not None:
            bar.update(n - bar.n)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - t0
    meta = {"format": DOCUMENT_FORMAT, "tokens": n, "turn_tail": tail, "model": model_spec,
            "config": config.to_json(), "compress_s": round(seconds, 3)}
    save_prompt_cache(out, caches, meta, model=model)
    held = sum(c.nbytes for c in caches if getattr(c, "keys", None) is not None)
    return {"tokens": n, "seconds": seconds, "file_bytes": os.path.getsize(out), "allocated_bytes": held,
            "caches": caches}


def check_output_path(path: str) -> None:
    """Refuse, before any work, an --out whose directory is missing or not writable."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CLIError(f"--out {path}: is a directory (name the .safetensors file to write)")
    if not os.path.isdir(directory):
        raise CLIError(f"--out {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CLIError(f"--out {path}: the directory {directory} is not writable")


def cmd_compress(args):
    check_output_path(args.out)
    text = read_text(args.prompt_file)
    if not text.strip():
        raise CLIError(f"{args.prompt_file} is empty: nothing to compress")
    name, core, _ = cache_spec(args)  # reject bad flags before the (slow) model load
    if name == FULL:
        raise CLIError(f"compress needs an eviction method, not --method {FULL}")
    if core.get("recall") == "disk":  # the disk tier's file belongs to this process and is removed when it exits
        raise CLIError("--recall disk cannot be saved in a compressed document: use --recall memory")
    if args.density is None:
        config_from_args(args, 0)
    model, tokenizer = load_model_for_cli(args.model)
    distributed.setup_cli(model)
    fit_kv_group(model, args)
    n = len(split_template(tokenizer, text, not args.ignore_chat_template)[0])
    check_context(model, n, allow=args.allow_past_context)
    config = page_long_prompt(model, config_from_args(args, n), n, args)
    note_budget_past_context(model, config)
    note_pages(model, config, n)
    r = compress_document(model, tokenizer, text, config, args.out, args.prefill_step_size,
                          not args.ignore_chat_template, args.model)
    print(f"Compressed {r['tokens']} tokens with {config.method} (budget {config.budget}/head) in "
          f"{r['seconds']:.2f} s; wrote {args.out} ({fmt_bytes(r['file_bytes'])})")
    print(kv_summary(kv_report(r["caches"])))
    return 0


def add_parser(sub):
    c = sub.add_parser("compress", help="compress a document into a prompt-cache file (compress once, ask many)",
                       description="Compress a document into a prompt-cache file; `generate --prompt-cache FILE "
                                   "--prompt QUESTION` continues it.")
    c.add_argument("--model", default="bundled", help="'bundled', 'gemma3-270m', a .gguf path, or an mlx-lm "
                   "model path")
    c.add_argument("--prompt-file", required=True, help="the document (UTF-8 text; '-': standard input) (required)")
    c.add_argument("--out", required=True, help="the .safetensors file to write; its directory must exist "
                   "(written to a temporary file beside it, then renamed) (required)")
    c.add_argument("--prefill-step-size", type=ranged(int, 1), default=2048, help="document tokens per prefill chunk")
    c.add_argument("--ignore-chat-template", action="store_true", help="feed the document as raw text")
    c.add_argument("--allow-past-context", action="store_true",
                   help="compress a document longer than the model's context (refused otherwise)")
    add_cache_args(c, default_method="kvzip")
    c.set_defaults(func=cmd_compress)
    return c
