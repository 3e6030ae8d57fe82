"""One task prompt under several caches, as ``mlx_lm.generate`` and ``serve`` run it (``eval tasks``).

:func:`run_prompt` feeds the first prompt to every cache list, then holds the conversation: turn 1
from the prompt's first new token, every later turn continuing the same caches. Cache lists that can
share the prompt's forward (``prompt_eviction="end"``: nothing is evicted before the prompt ends)
get it through :class:`.fanout.FanOutCache`, at most ``fanout`` lists per pass; each list then
takes the prompt's last token alone (its compression runs there) before the next pass starts, so at
most ``fanout`` + 1 uncompressed copies of the prompt's rows are alive at once. With the question
left out (kvpress's default), the prompt is the context alone and the question follows as the next
input on the compressed caches.
"""

from __future__ import annotations

import re
import time

from ..caches.accounting import kv_report
from ..caches.cache import continue_on_purpose
from .fanout import shared_pass
from ..decode import greedy, last_prompt_step, prefill
from .task_prompts import continuation, reply_text
from .tasks import get_task

PREFILL_STEP = 2048  # mlx_lm.generate's default prefill_step_size


def _first_token(model, x, caches):
    return prefill(model, x, caches, PREFILL_STEP)


def number_done(text: str) -> bool:
    """True once ``text`` holds a digit run followed by another character (the answer is complete)."""
    return re.search(r"\d[^\d]", text) is not None


def greedy_until(model, tokenizer, caches, y, max_new_tokens: int, eos_ids=(), stop_after_number=False) -> list:
    """Greedy decoding from the first new token ``y`` (an mx scalar) by :func:`veloxquant_mlx.decode.greedy`,
    also stopping once a "number" turn's first number is complete (only that number is scored; the
    reply ends there, as a short answer does)."""
    stop = (lambda ids: number_done(tokenizer.decode(ids))) if stop_after_number else None
    return greedy(model, caches, y, max_new_tokens, eos_ids, stop=stop)


def converse(model, tokenizer, inst, caches, y, eos_ids=()) -> list:
    """Turn 1 from its first new token ``y`` (the prompt already in ``caches``), then every later turn
    through the same caches. Returns one record per turn."""
    import mlx.core as mx

    score = get_task(inst.task).score
    turns, replies, last_token = [], [], None  # last_token: the previous turn's last generated token
    for k, turn in enumerate(inst.turns):
        if k > 0:
            continue_on_purpose(caches)  # a later turn continues the conversation
            x = mx.array(continuation(tokenizer, inst, replies, last_token, eos_ids))
            t0 = time.perf_counter()
            y = _first_token(model, x, caches) if x.shape[0] > 1 else last_prompt_step(model, x, caches)
            fed = int(x.shape[0])
        t1 = time.perf_counter()
        out = greedy_until(model, tokenizer, caches, y, turn.max_new_tokens, eos_ids, turn.kind == "number")
        last_token = out[-1]
        gen = out[:-1] if out[-1] in eos_ids else out
        text = tokenizer.decode(gen)
        replies.append(reply_text(tokenizer, inst, k, out, eos_ids))
        rec = {"turn": k, "output": text, "expected": list(turn.expected), **score(turn, text),
               "decode_s": round(time.perf_counter() - t1, 3)}
        if k > 0:
            rec.update(fed_tokens=fed, turn_prefill_s=round(t1 - t0, 3))
        turns.append(rec)
    return turns


def _plain_kvcache(caches) -> bool:
    from mlx_lm.models.cache import KVCache

    return all(type(c) is KVCache for c in caches)


def _shared_pass(model, x, group: dict, out: dict) -> float:
    """One forward of ``x`` (all but its last token) feeding every cache list of ``group``; a plain
    ``KVCache`` list of the group (the full cache's row) serves as the pass's own cache instead of a
    copy beside it. Errors go to ``out``. Returns the pass's seconds."""
    from mlx_lm.models.cache import make_prompt_cache

    own = next((n for n, c in group.items() if _plain_kvcache(c)), None)
    primary = group[own] if own is not None else make_prompt_cache(model)
    seconds, errors = shared_pass(model, x, primary, {n: c for n, c in group.items() if n != own}, PREFILL_STEP)
    for n, e in errors.items():
        out.setdefault(n, {"error": e})
    return seconds


def run_prompt(model, tokenizer, inst, tokens, named: dict, shared: bool, eos_ids=(), question_tokens=None,
               fanout: int | None = None, progress: bool = False) -> dict:
    """{name: {"turns": [...], ...} or {"error"}} for every cache list of ``named`` ({name: (caches,
    needs its own prefill)}) on one prompt. ``question_tokens``: the question left out of ``tokens``
    (the context), fed after the context's compression. ``progress``: a second bar (shared passes,
    then rows answered), since one long prompt takes minutes."""
    import mlx.core as mx
    from tqdm import tqdm

    x = mx.array(tokens)
    xq = mx.array(question_tokens) if question_tokens else None
    out, firsts = {}, {}
    fan = [n for n, c in named.items() if shared and not c[1]]
    step = max(int(fanout or len(fan) or 1), 1)
    n_pass = -(-len(fan) // step)
    bar = tqdm(total=n_pass + len(named), desc=f"prompt ({len(tokens)} tok)", leave=False, disable=not progress,
               dynamic_ncols=True, unit="step")

    def first(name, caches, pre_s, t0):
        y = last_prompt_step(model, x, caches) if pre_s is not None else _first_token(model, x, caches)
        kv_ctx = kv_report(caches)["allocated_bytes"]
        if xq is not None:
            y = _first_token(model, xq, caches) if xq.shape[0] > 1 else last_prompt_step(model, xq, caches)
        firsts[name] = (y, kv_ctx, (pre_s or 0.0) + time.perf_counter() - t0)

    for i in range(0, len(fan), step):
        group = {n: named[n][0] for n in fan[i:i + step]}
        pre_s = _shared_pass(model, x, group, out)
        for name, caches in group.items():  # compress now: the next pass must not find this one's full rows
            if name not in out:
                try:
                    first(name, caches, pre_s, time.perf_counter())
                except Exception as e:
                    out[name] = {"error": f"{type(e).__name__}: {e}"}
        del group
        bar.update(1)
    for name, (caches, own) in named.items():
        if name in out:
            named[name] = (None, own)
            bar.update(1)
            continue
        try:
            if name not in firsts:
                first(name, caches, None, time.perf_counter())
            y, kv_ctx, prefill_s = firsts.pop(name)
            kv_prompt = kv_report(caches)["allocated_bytes"]
            turns = converse(model, tokenizer, inst, caches, y, eos_ids)
            rec = {"turns": turns, "shared_prefill": name in fan, "kv_bytes_after_prompt": kv_prompt,
                   "prefill_s": round(prefill_s, 3)}
            if xq is not None:
                rec.update(kv_bytes_after_context=kv_ctx, question_tokens=int(xq.shape[0]))
            out[name] = rec
        except Exception as e:  # a method that raises is an error for its cell
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            named[name] = (None, own)  # free this method's caches before the next one decodes
            bar.update(1)
            bar.set_postfix_str(name[-40:])
    bar.close()
    return out
