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
prompt is shared by the methods (:class:`.fanout.FanOutCache`; ``--fanout`` bounds how many per
pass). Caches whose prompt does not see the full cache's rows run a prefill of their own: kvzip
(its reconstruction pass needs the model and the prompt), quantized rows and ``rotating``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys

from ..config import budget_for
from ..registry import get_method
from .eval_model import eos_ids
from .fanout import run_shared_cells
from .outputs import check_lengths, writes
from .results import (FULL, ResultStore, cell_id, machine_info, make_caches, method_specs, now,
                      quiet_cache_warnings, run_experiment)
from .task_prompts import split_question
from .task_run import PREFILL_STEP, converse, greedy_until, number_done, run_prompt  # noqa: F401 (re-exported)
from .tasks import build, get_task

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


def run_meta(settings, desc: str) -> dict:
    shared = bool(settings.shared_prefill and settings.prompt_eviction == "end")
    return {"commit": _git("rev-parse", "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
            "command": " ".join(sys.argv), "date": now(), "model": desc, "densities": list(settings.densities),
            "prompt_eviction": settings.prompt_eviction, "prefill_step": PREFILL_STEP, "shared_prefill": shared,
            "plain_path_methods": list(PLAIN_PATH_METHODS), "machine": machine_info()}


@dataclasses.dataclass(frozen=True)
class TaskSettings:
    """Which cells ``eval tasks`` runs: tasks x lengths x prompts x question variants x methods x
    budgets (None: the priority set)."""

    quick: bool = False
    tasks: tuple | None = None  # registered task names (default PRIORITY["tasks"])
    lengths: tuple | None = None  # target prompt tokens (default 2048; quick 1024)
    densities: tuple = (0.2,)
    budgets: tuple | None = None  # fixed token budgets beside the densities
    questions: tuple | None = None  # "in" (default) and / or "out" (QUESTION)
    methods: tuple | None = None  # labels (default: the priority set)
    fanout: int | None = None  # at most this many methods share one prefill pass
    n_prompts: int = 100  # prompts per task and length
    start: int = 0  # first prompt index
    n_facts: int = 3  # facts (= turns) of the follow-up task
    seed: int = 0  # task generator seed
    prompt_eviction: str = "end"
    shared_prefill: bool = True


def run(model, tokenizer, settings: TaskSettings, control, desc: str = "") -> int:
    a = settings
    quiet_cache_warnings()
    # methods runs exactly those labels (e.g. only a new method, paired later with the full cache
    # of another run on the same seeded prompts); the default is the priority set.
    specs = {s.name: s for s in method_specs(a.methods or [FULL, "nestedkv", "nexus", "nexus-prompt-topk",
                                                              "snapkv", "kvzip"])}
    tasks = list(a.tasks or PRIORITY["tasks"])
    for t in tasks:
        get_task(t)  # an unknown name fails here, naming the registered tasks
    lengths = list(a.lengths or ([1024] if a.quick else PRIORITY["lengths"]))
    check_lengths(model, lengths, "--lengths")
    questions = list(a.questions or ["in"])
    budgets = list(a.budgets or [])
    cells = make_cells(tasks, lengths, a.n_prompts, list(a.densities), list(specs), a.start, budgets, questions,
                       full=[n for n, s in specs.items() if s.is_full])
    store = ResultStore(f"{control.out_dir}/tasks.json", "tasks", write=writes(control))
    store.update_meta(meta={**run_meta(a, desc), "quick": a.quick, "n_facts": a.n_facts, "seed": a.seed},
                      grid={"tasks": tasks, "lengths": lengths, "n_prompts": a.n_prompts, "start": a.start,
                            "densities": list(a.densities), "budgets": budgets, "questions": questions,
                            "methods": list(specs), "n_cells": len(cells), "fanout": a.fanout})
    eos = eos_ids(tokenizer)
    shared = a.shared_prefill and a.prompt_eviction == "end"
    prompts = {}

    def run_group(p):
        key = prompt_key(p)
        done = store.done()  # claim the prompt's cells first, so a second worker moves on at once
        group = [(cid, q) for cid, q in cells if prompt_key(q) == key and cid not in done]
        group = [(cid, q) for cid, q in group if store.claim(cid)]
        if key[:3] not in prompts:
            prompts.clear()
            prompts[key[:3]] = build(tokenizer, p["task"], p["length"], p["index"], a.seed, a.n_facts)
        inst, toks = prompts[key[:3]]
        ctx, qtoks = split_question(tokenizer, inst) if key[3] == "out" else (toks, None)
        named, budgets, recs = {}, {}, {}
        for cid, q in group:
            spec = specs[q["method"]]
            budgets[cid] = cell_budget(spec, q, len(toks))
            try:
                named[cid] = (make_caches(model, spec, budgets[cid], seed=0, prompt_eviction=a.prompt_eviction),
                              needs_own_prefill(spec))
            except Exception as e:
                recs[cid] = {"error": f"{type(e).__name__}: {e}"}
        res = run_prompt(model, tokenizer, inst, ctx, named, shared, eos, question_tokens=qtoks, fanout=a.fanout,
                         progress=control.progress)
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
        return run_shared_cells(store, my, lambda: run_group(p), missing={"error": "claimed by another worker"})

    return run_experiment(store, cells, run_one, control)
