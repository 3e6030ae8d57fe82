"""``eval tasks``: method x task x budget cells through the generate path.

Every cell is one prompt of :mod:`.tasks` under one cache, run as ``mlx_lm.generate`` runs it (the
engine is :mod:`.task_run`): the full ``KVCache``, mlx-lm's ``QuantizedKVCache`` (``full-4bit``) or
``RotatingKVCache(max_size=budget)`` (``rotating``), or ``KVCacheBuilder.for_model``'s eviction
caches. The budget is density x first-prompt tokens (``--densities``) or fixed (``--budgets``).
All but the last prompt token go in 2048-token chunks, the last token alone (a compression at the
prompt's end runs there), then greedy decoding. The question is inside the compressed prompt
(``--question in``) or left out of it (``out``: the context is compressed, then the question is
fed). Each later turn of the follow-up task continues the same cache with the new user turn as one
multi-token input, as ``serve`` continues a stored conversation.

Under ``prompt_eviction="end"`` nothing is evicted before the prompt ends, so one full prefill per
prompt is shared by the methods (:class:`.retrieval.FanOutCache`; ``--fanout`` bounds how many per
pass). Caches whose prompt does not see the full cache's rows run a prefill of their own: kvzip
(its reconstruction pass needs the model and the prompt), quantized rows and ``rotating``.
"""

from __future__ import annotations

import subprocess
import sys
import time

from ..config import budget_for
from ..registry import get_method
from .outputs import check_lengths, check_out_dir, writes
from .report_tasks import write_tasks_report
from .results import (FULL, USER_OUT_DIR, ResultStore, cell_id, load_eval_model, machine_info, make_caches,
                      method_specs, now, quiet_cache_warnings, run_experiment)
from .task_prompts import split_question
from .task_run import PREFILL_STEP, converse, greedy_until, number_done, run_prompt  # noqa: F401 (re-exported)
from .tasks import TASKS, build

PLAIN_PATH_METHODS = ("kvzip",)  # registry methods that need their own prefill (see module doc)
PRIORITY = {"tasks": ["followup", "niah_single", "niah_multikey"], "lengths": [2048]}
QUESTION = ("in", "out")  # the question inside what is compressed, or left out of it (kvpress's default)


def needs_own_prefill(spec) -> bool:
    if spec.kv_bits is not None:  # quantized rows: the prompt attends over them, not the shared fp pass's rows
        return True
    if spec.mlx_cache is not None:  # RotatingKVCache attends over its window from the second chunk on
        return True
    if spec.method is None:
        return False
    return spec.method in PLAIN_PATH_METHODS or bool(getattr(get_method(spec.method), "own_prefill", False))


def prompt_key(p: dict) -> tuple:
    return (p["task"], p["length"], p["index"], p.get("question", "in"))


def make_cells(tasks, lengths, n_prompts, densities, methods, start: int = 0, budgets=(), questions=("in",),
               full=None) -> list:
    """Prompt-major order (every method and budget of prompt i before prompt i + 1; tasks, lengths and
    question variants interleaved), so a run cut short compares every method on the same prompts.
    ``budgets``: fixed token budgets beside the densities; ``full``: the labels without a budget
    (default: the full cache). Ids of question-included, density cells keep their old form."""
    full = {FULL} if full is None else set(full)
    cells = []
    for index in range(start, start + n_prompts):
        for length in lengths:
            for task in tasks:
                for q in questions:
                    for m in methods:
                        settings = [(None, None)] if m in full else [(d, None) for d in densities] + \
                            [(None, int(b)) for b in budgets]
                        for d, b in settings:
                            p = {"task": task, "length": length, "index": index, "density": d, "method": m}
                            if b is not None:
                                p["budget_tokens"] = b
                            if q != "in":
                                p["question"] = q
                            cells.append((cell_id(exp="tasks", **p), p))
    return cells


def cell_budget(spec, q: dict, n_tokens: int) -> int:
    """The cell's token budget: the whole prompt for the full cache, else density x first-prompt tokens
    (the question included, in both question variants) or the fixed budget."""
    if spec.is_full:
        return n_tokens
    if q.get("budget_tokens") is not None:
        return int(q["budget_tokens"])
    return budget_for(q["density"], n_tokens)


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
    check_lengths(model, lengths, "--lengths")
    questions = args.question or ["in"]
    budgets = args.budgets or []
    cells = make_cells(tasks, lengths, args.n_prompts, args.densities, list(specs), args.start, budgets, questions,
                       full=[n for n, s in specs.items() if s.is_full])
    store = ResultStore(f"{args.out_dir}/tasks.json", "tasks", write=writes(args))
    store.update_meta(meta={**run_meta(args, desc), "quick": args.quick, "n_facts": args.n_facts,
                            "seed": args.seed},
                      grid={"tasks": tasks, "lengths": lengths, "n_prompts": args.n_prompts, "start": args.start,
                            "densities": list(args.densities), "budgets": budgets, "questions": questions,
                            "methods": list(specs), "n_cells": len(cells), "fanout": args.fanout})
    eos = tuple(sorted(set(getattr(tokenizer, "eos_token_ids", None) or ())
                       | {i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None}))
    shared = args.shared_prefill and args.prompt_eviction == "end"
    prompts, pending = {}, {}

    def run_group(p):
        key = prompt_key(p)
        done = store.done()  # claim the prompt's cells first, so a second worker moves on at once
        group = [(cid, q) for cid, q in cells if prompt_key(q) == key and cid not in done]
        group = [(cid, q) for cid, q in group if store.claim(cid)]
        if key[:3] not in prompts:
            prompts.clear()
            prompts[key[:3]] = build(tokenizer, p["task"], p["length"], p["index"], args.seed, args.n_facts)
        inst, toks = prompts[key[:3]]
        ctx, qtoks = split_question(tokenizer, inst) if key[3] == "out" else (toks, None)
        named, budgets, recs = {}, {}, {}
        for cid, q in group:
            spec = specs[q["method"]]
            budgets[cid] = cell_budget(spec, q, len(toks))
            try:
                named[cid] = (make_caches(model, spec, budgets[cid], seed=0, prompt_eviction=args.prompt_eviction),
                              needs_own_prefill(spec))
            except Exception as e:
                recs[cid] = {"error": f"{type(e).__name__}: {e}"}
        res = run_prompt(model, tokenizer, inst, ctx, named, shared, eos, question_tokens=qtoks, fanout=args.fanout,
                         progress=not args.no_progress)
        for cid, q in group:
            r = recs.get(cid) or res.get(cid, {"error": "not run"})
            if "turns" in r:
                r = {**r, "correct": all(t["correct"] for t in r["turns"]),
                     "turns_correct": sum(t["correct"] for t in r["turns"])}
            recs[cid] = {**q, **r, "prompt_tokens": len(toks), "budget": budgets.get(cid),
                         "n_turns": len(inst.turns), "group_size": len(group)}
        return recs

    def run_one(p):
        my = cell_id(exp="tasks", **{f: p[f] for f in ("task", "length", "index", "density", "method",
                                                        "budget_tokens", "question") if f in p})
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
    p.set_defaults(out_dir=f"{USER_OUT_DIR}/tasks")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=None,
                   help=f"default: the priority set {' '.join(PRIORITY['tasks'])}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="target prompt tokens (default 2048)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.2])
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="fixed token budgets beside the densities")
    p.add_argument("--question", nargs="+", choices=QUESTION, default=None,
                   help="'in': the question is inside what is compressed (default); 'out': the context is "
                        "compressed alone, then the question is asked (kvpress's default)")
    p.add_argument("--fanout", type=int, default=None,
                   help="at most this many methods share one prefill pass (bounds the uncompressed copies "
                        "alive at once; default: all)")
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
    check_out_dir(args)
    rc = run(args)
    if not args.no_report and writes(args):
        print(f"wrote {write_tasks_report(args.out_dir)}")
    return rc


def cli_report(args) -> int:
    """``eval tasks-report``: tables and figures from one or several runs' folders."""
    print(f"wrote {write_tasks_report(args.out_dir, args.md, args.inputs or [args.out_dir])}")
    return 0


def add_report_args(p):
    p.add_argument("--inputs", nargs="+", default=None, help="folders holding tasks.json (default: --out-dir)")
    p.add_argument("--out-dir", default=f"{USER_OUT_DIR}/tasks", help="where the figures go")
    p.add_argument("--md", default=None, help="markdown path (default <out-dir>/tasks.md)")
    p.set_defaults(func=cli_report)
