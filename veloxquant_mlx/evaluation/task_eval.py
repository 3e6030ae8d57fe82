"""``eval tasks``: method x task x density cells through the generate path.

Every cell is one prompt of :mod:`.tasks` under one cache (the full ``KVCache`` or
``KVCacheBuilder.for_model``'s eviction caches at ``budget = density x first-prompt tokens``), run
as ``mlx_lm.generate`` runs it: all but the last prompt token in 2048-token chunks, the last token
alone (a compression at the prompt's end runs there), then greedy decoding. The question is inside
the compressed prompt. Each later turn of the follow-up task continues the same cache with the new
user turn as one multi-token input (again all but its last token in chunks, then the last alone),
as ``serve`` continues a stored conversation.

Under ``prompt_eviction="end"`` nothing is evicted before the prompt ends, so one full prefill per
prompt is shared by every method (:class:`.retrieval.FanOutCache`); each method then takes the last
token and decodes on its own caches. Methods whose caches run their own model pass at the prompt's
end (``kvzip``'s reconstruction: it needs the model and the prompt, which a fan-out of
``update_and_fetch`` calls does not give) run through the plain path, a prefill of their own.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

from ..caches.accounting import kv_report
from ..registry import get_method
from .retrieval import FanOutCache, _arrays
from .report_tasks import write_tasks_report
from .results import (DEFAULT_OUT_DIR, FULL, ResultStore, cell_id, load_eval_model, machine_info, make_caches,
                      method_specs, now, quiet_cache_warnings, run_experiment)
from .speed import feed_prompt, greedy_continue, last_prompt_step
from .task_prompts import continuation, reply_text, score
from .tasks import TASKS, build

PREFILL_STEP = 2048  # mlx_lm.generate's default prefill_step_size
PLAIN_PATH_METHODS = ("kvzip",)  # registry methods that need their own prefill (see module doc)
PRIORITY = {"tasks": ["followup", "niah_single", "niah_multikey"], "lengths": [2048]}


def needs_own_prefill(spec) -> bool:
    if spec.kv_bits is not None:  # quantized rows: the prompt attends over them, not the shared fp pass's rows
        return True
    if spec.method is None:
        return False
    return spec.method in PLAIN_PATH_METHODS or bool(getattr(get_method(spec.method), "own_prefill", False))


def prompt_key(p: dict) -> tuple:
    return (p["task"], p["length"], p["index"])


def make_cells(tasks, lengths, n_prompts, densities, methods, start: int = 0) -> list:
    """Prompt-major order (every method and density of prompt i before prompt i + 1; tasks and lengths
    interleaved), so a run cut short compares every method on the same prompts."""
    cells = []
    for index in range(start, start + n_prompts):
        for length in lengths:
            for task in tasks:
                for m in methods:
                    for d in ([None] if m == FULL else densities):
                        p = {"task": task, "length": length, "index": index, "density": d, "method": m}
                        cells.append((cell_id(exp="tasks", **p), p))
    return cells


def _first_token(model, x, caches):
    feed_prompt(model, x, caches, PREFILL_STEP)
    return last_prompt_step(model, x, caches)


def number_done(text: str) -> bool:
    """True once ``text`` holds a digit run followed by another character (the answer is complete)."""
    return re.search(r"\d[^\d]", text) is not None


def greedy_until(model, tokenizer, caches, y, max_new_tokens: int, eos_ids=(), stop_after_number=False) -> list:
    """Greedy decoding from the first new token ``y`` (an mx scalar) by ``speed.greedy_continue``,
    also stopping once a "number" turn's first number is complete (only that number is scored; the
    reply ends there, as a short answer does)."""
    stop = (lambda ids: number_done(tokenizer.decode(ids))) if stop_after_number else None
    return greedy_continue(model, caches, y, max_new_tokens, eos_ids, stop=stop)


def converse(model, tokenizer, inst, caches, y, eos_ids=()) -> list:
    """Turn 1 from its first new token ``y`` (the prompt already in ``caches``), then every later turn
    through the same caches. Returns one record per turn."""
    import mlx.core as mx

    turns, replies, last_token = [], [], None  # last_token: the previous turn's last generated token
    for k, turn in enumerate(inst.turns):
        if k > 0:
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


def run_prompt(model, tokenizer, inst, tokens, named: dict, shared: bool, eos_ids=()) -> dict:
    """{name: {"turns": [...], ...} or {"error"}} for every cache list of ``named`` on one prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    x = mx.array(tokens)
    out, prefill_s = {}, None
    fan = {n: c for n, c in named.items() if shared and not c[1]}
    if fan:
        primary = make_prompt_cache(model)
        fans = [FanOutCache(primary[i], {n: c[0][i] for n, c in fan.items()}) for i in range(len(primary))]
        t0 = time.perf_counter()
        feed_prompt(model, x, fans, PREFILL_STEP)
        mx.eval(_arrays([f.state for f in fans]))
        prefill_s = time.perf_counter() - t0
        for f in fans:
            for n, e in f.errors.items():
                out.setdefault(n, {"error": e})
        del fans, primary
    for name, (caches, own) in named.items():
        if name in out:
            continue
        try:
            t0 = time.perf_counter()
            if name in fan:
                y = last_prompt_step(model, x, caches)
            else:
                y = _first_token(model, x, caches)
            first_s = time.perf_counter() - t0
            kv_end_prompt = kv_report(caches)["allocated_bytes"]
            turns = converse(model, tokenizer, inst, caches, y, eos_ids)
            out[name] = {"turns": turns, "shared_prefill": name in fan, "kv_bytes_after_prompt": kv_end_prompt,
                         "prefill_s": round((prefill_s or 0.0) + first_s if name in fan else first_s, 3)}
        except Exception as e:  # a method that raises is an error for its cell
            out[name] = {"error": f"{type(e).__name__}: {e}"}
        finally:
            named[name] = (None, own)  # free this method's caches before the next one decodes
    return out


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # pragma: no cover - no git
        return ""


def run_meta(args, desc: str) -> dict:
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join(sys.argv), "date": now(), "model": desc, "densities": list(args.densities),
            "prompt_eviction": args.prompt_eviction, "prefill_step": PREFILL_STEP,
            "shared_prefill": bool(args.shared_prefill and args.prompt_eviction == "end"),
            "plain_path_methods": list(PLAIN_PATH_METHODS), "machine": machine_info()}


def run(args) -> int:
    quiet_cache_warnings()
    model, tokenizer, desc = load_eval_model(args.model, args.quick)
    # --methods runs exactly those labels (e.g. only a new method, paired later with the full cache
    # of another run on the same seeded prompts); the default is the priority set.
    specs = {s.name: s for s in method_specs(args.methods or [FULL, "nestedkv", "nexus", "nexus-prompt-topk",
                                                                 "snapkv", "kvzip"])}
    tasks = args.tasks or PRIORITY["tasks"]
    lengths = args.lengths or ([1024] if args.quick else PRIORITY["lengths"])
    cells = make_cells(tasks, lengths, args.n_prompts, args.densities, list(specs), args.start)
    store = ResultStore(f"{args.out_dir}/tasks.json", "tasks")
    store.update_meta(meta={**run_meta(args, desc), "quick": args.quick, "n_facts": args.n_facts,
                            "seed": args.seed},
                      grid={"tasks": tasks, "lengths": lengths, "n_prompts": args.n_prompts, "start": args.start,
                            "densities": list(args.densities), "methods": list(specs), "n_cells": len(cells)})
    eos = tuple(sorted(set(getattr(tokenizer, "eos_token_ids", None) or ())
                       | {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}))
    shared = args.shared_prefill and args.prompt_eviction == "end"
    prompts, pending = {}, {}

    def run_group(p):
        key = prompt_key(p)
        done = store.done()  # claim the prompt's cells first, so a second worker moves on at once
        group = [(cid, q) for cid, q in cells if prompt_key(q) == key and cid not in done]
        group = [(cid, q) for cid, q in group if store.claim(cid)]
        if key not in prompts:
            prompts.clear()
            prompts[key] = build(tokenizer, p["task"], p["length"], p["index"], args.seed, args.n_facts)
        inst, toks = prompts[key]
        named, budgets, recs = {}, {}, {}
        for cid, q in group:
            spec = specs[q["method"]]
            budgets[cid] = len(toks) if spec.method is None else max(int(round(q["density"] * len(toks))), 1)
            try:
                named[cid] = (make_caches(model, spec, budgets[cid], seed=0, prompt_eviction=args.prompt_eviction),
                              needs_own_prefill(spec))
            except Exception as e:
                recs[cid] = {"error": f"{type(e).__name__}: {e}"}
        res = run_prompt(model, tokenizer, inst, toks, named, shared, eos)
        for cid, q in group:
            r = recs.get(cid) or res.get(cid, {"error": "not run"})
            if "turns" in r:
                r = {**r, "correct": all(t["correct"] for t in r["turns"]),
                     "turns_correct": sum(t["correct"] for t in r["turns"])}
            recs[cid] = {**q, **r, "prompt_tokens": len(toks), "budget": budgets.get(cid),
                         "n_turns": len(inst.turns), "group_size": len(group)}
        return recs

    def run_one(p):
        my = cell_id(exp="tasks", **{f: p[f] for f in ("task", "length", "index", "density", "method")})
        if my not in pending:
            t = time.perf_counter()
            recs = run_group(p)
            share = (time.perf_counter() - t) / max(len(recs), 1)
            for cid, r in recs.items():
                r["cell_s"] = round(share, 3)
                r["finished"] = now()
                if cid != my:
                    store.put(cid, r)
                else:
                    pending[my] = r
        return dict(pending.pop(my, {"error": "claimed by another worker"}))

    return run_experiment(store, cells, run_one, args)


def add_args(p, common):
    """The ``eval tasks`` arguments (``common``: the eval family's shared options)."""
    common(p)
    p.set_defaults(out_dir=f"{DEFAULT_OUT_DIR}/tasks")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=None,
                   help=f"default: the priority set {' '.join(PRIORITY['tasks'])}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="target prompt tokens (default 2048)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.2])
    p.add_argument("--n-prompts", type=int, default=100, help="prompts per task and length")
    p.add_argument("--start", type=int, default=0, help="first prompt index")
    p.add_argument("--n-facts", type=int, default=3, help="facts (= turns) of the follow-up task, 2-4")
    p.add_argument("--seed", type=int, default=0, help="task generator seed")
    p.add_argument("--prompt-eviction", choices=["end", "stream"], default="end")
    p.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                   help="one prefill per method instead of one shared prefill per prompt (same result)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the tasks report after the run")


def cli_run(args) -> int:
    """``eval tasks``: run the cells, then regenerate the tasks report next to the JSON."""
    rc = run(args)
    if not args.no_report:
        print(f"wrote {write_tasks_report(args.out_dir)}")
    return rc


def cli_report(args) -> int:
    """``eval tasks-report``: tables and figures from one or several runs' folders."""
    print(f"wrote {write_tasks_report(args.out_dir, args.md, args.inputs or [args.out_dir])}")
    return 0


def add_report_args(p):
    p.add_argument("--inputs", nargs="+", default=None, help="folders holding tasks.json (default: --out-dir)")
    p.add_argument("--out-dir", default=f"{DEFAULT_OUT_DIR}/tasks", help="where the figures go")
    p.add_argument("--md", default=None, help="markdown path (default <out-dir>/tasks.md)")
    p.set_defaults(func=cli_report)
