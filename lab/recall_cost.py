"""What a recall costs a follow-up turn, measured from one state (``bench_quality.py recall-cost``).

One follow-up prompt is prefilled once for every cold tier (a shared pass: under
``prompt_eviction="end"`` every cache list sees the same prompt), turn 1 is answered on each, and then
turn 2's input (the follow-up question) is prefilled ``rounds`` times per tier, each time on a deep
copy of that tier's state after turn 1 (a ``"disk"`` tier's copy gets its own file), tiers alternating
in order round by round. So every round of every tier starts from the same rows, and the ratio of a
tier's turn-2 prefill to the no-recall one's, per round, is what the recall (its page bound, read-back,
exact scoring and cold writes) adds to that turn. The first round is reported apart: it also pays for
tracing and compiling the shapes this turn meets first.
"""

from __future__ import annotations

import copy
import random
import statistics
import time

import mlx.core as mx

from veloxquant_mlx.builder import KVCacheBuilder
from veloxquant_mlx.config import budget_for
from veloxquant_mlx.decode import eval_state, last_prompt_step, prefill
from veloxquant_mlx.evaluation.fanout import shared_pass
from .recall_followup import recall_options
from veloxquant_mlx.evaluation.task_prompts import continuation, reply_text
from veloxquant_mlx.evaluation.task_run import PREFILL_STEP, greedy_until
from veloxquant_mlx.evaluation.tasks import build


def cost_tiers(tiers, pages, bits: int, page: int = 32) -> dict:
    """{name: KVCacheConfig recall fields} of the timed tiers: ``none``, then each tier of ``tiers``
    ("memory" / "disk") reading back each count of ``pages`` (named ``memory-p2`` when several)."""
    if not pages or min(pages) < 1:
        raise ValueError(f"pages read back per recall must be >= 1, got {list(pages)}")
    out = {"none": {}}
    for t in tiers:
        for n in pages:
            out[t if len(pages) == 1 else f"{t}-p{n}"] = recall_options(t, bits, page, n)
    return out


def after_turn_one(model, tokenizer, spec, tiers: dict, length: int, density: float, index: int, eos_ids=()):
    """{tier: (caches after turn 1, turn 2's input ids)} for one follow-up prompt, and the prompt's
    facts ({"prompt_tokens", "budget", "prefill_s", "turn1": {tier: reply}})."""
    from mlx_lm.models.cache import make_prompt_cache

    inst, tokens = build(tokenizer, "followup", length, index, 0, 2)
    budget = budget_for(density, len(tokens))
    named = {t: KVCacheBuilder.for_model(model, spec.config(budget, **kw)) for t, kw in tiers.items()}
    x = mx.array(tokens)
    seconds, errors = shared_pass(model, x, make_prompt_cache(model), named, PREFILL_STEP)
    if errors:
        raise RuntimeError(f"the shared prefill failed: {errors}")
    states, replies = {}, {}
    for tier, caches in named.items():
        y = last_prompt_step(model, x, caches)
        out = greedy_until(model, tokenizer, caches, y, inst.turns[0].max_new_tokens, eos_ids, True)
        x2 = continuation(tokenizer, inst, [reply_text(tokenizer, inst, 0, out, eos_ids)], out[-1], eos_ids)
        eval_state(caches)
        states[tier] = (caches, mx.array(x2))
        replies[tier] = tokenizer.decode(out)
    return states, {"prompt_tokens": len(tokens), "budget": budget, "prefill_s": round(seconds, 1),
                    "turn1": replies, "turn2_tokens": int(states[next(iter(states))][1].shape[0])}


def time_turn_two(model, states: dict, rounds: int) -> dict:
    """{tier: [seconds of turn 2's prefill, per round]} from deep copies of each tier's state, tiers
    alternating forward and backward round by round, and the first tokens the copies of each tier gave."""
    names = list(states)
    times, first = {t: [] for t in names}, {}
    for r in range(rounds):
        for tier in (names if r % 2 == 0 else names[::-1]):
            caches, x2 = states[tier]
            c = copy.deepcopy(caches)
            mx.eval([cc.state for cc in c])
            t0 = time.perf_counter()
            y = prefill(model, x2, c, PREFILL_STEP)
            eval_state(c)
            times[tier].append(time.perf_counter() - t0)
            first.setdefault(tier, set()).add(int(y.item()))
            del c
    return {"seconds": times, "first_tokens": {t: sorted(v) for t, v in first.items()}}


def ratio_summary(seconds: dict, base: str = "none", seed: int = 0) -> dict:
    """Per tier but ``base``: the first round's ratio, the median of the later rounds' paired ratios
    (tier ÷ base in the same round) and its 95 % bootstrap interval over rounds."""
    rng = random.Random(seed)
    out = {}
    for tier, xs in seconds.items():
        if tier == base:
            continue
        r = [a / b for a, b in zip(xs, seconds[base], strict=True)]
        later = r[1:] or r
        boots = sorted(statistics.median(rng.choices(later, k=len(later))) for _ in range(2000))
        out[tier] = {"first_round_ratio": round(r[0], 3), "ratio_median": round(statistics.median(later), 3),
                     "ratio_ci95": [round(boots[49], 3), round(boots[1949], 3)], "rounds": len(later),
                     "median_s": round(statistics.median(xs[1:] or xs), 4)}
    out[base] = {"median_s": round(statistics.median(seconds[base][1:] or seconds[base]), 4)}
    return out
