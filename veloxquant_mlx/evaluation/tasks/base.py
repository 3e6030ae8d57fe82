"""The task registry of ``eval tasks``: a task is a generator of prompts, a scorer of replies and
the columns it adds to the report, registered under one name.

A generator takes ``(length, index, seed, n_facts)`` and returns ``(make, max_units)``: ``make(n)``
builds the :class:`Instance` with ``n`` filler units, and :meth:`Task.build` fits ``n`` to the
prompt length. A new task is one module that calls :func:`register_task` (and its test); the CLI's
``--tasks`` choices, the harness and the report read the registry.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ..task_prompts import render_first, score as score_reply


@dataclasses.dataclass(frozen=True)
class Turn:
    """One question. ``kind``: "number" (the first number of the reply must equal ``expected[0]``),
    "numbers" or "words" (every expected item must be returned and no item of ``wrong``)."""

    question: str
    reply_prefix: str
    expected: tuple
    kind: str
    max_new_tokens: int
    wrong: tuple = ()  # answers present in the prompt that are wrong for this question


@dataclasses.dataclass(frozen=True)
class Instance:
    task: str
    length: int  # target length (tokens)
    index: int
    preface: str
    context: str
    turns: tuple
    info: tuple = ()  # sorted (key, value) pairs: depths, counts

    @property
    def answers_in_text(self) -> bool:
        """Every expected answer of every turn occurs in the context (a sanity check)."""
        return all(a in self.context for t in self.turns for a in t.expected)


def turn_columns(base: str, cell: dict) -> dict:
    """The report section of a task: {column: correct} of one finished cell. One column for a
    one-turn task; a column per turn and "all turns" for a conversation."""
    if len(cell["turns"]) > 1:
        cols = {f"{base} turn {t['turn'] + 1}": t["correct"] for t in cell["turns"]}
        cols[f"{base} all turns"] = cell["correct"]
        return cols
    return {base: cell["correct"]}


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    generator: Callable  # (length, index, seed, n_facts) -> (make(n_units) -> Instance, max_units)
    score: Callable = score_reply  # (turn, generated text) -> {"correct", "recall", "found"}
    columns: Callable = turn_columns  # (base column name, cell) -> {column: correct}

    def build(self, tokenizer, length: int, index: int, seed: int = 0, n_facts: int = 3) -> tuple:
        """(Instance, first-turn prompt tokens): the most filler whose rendered first prompt has at
        most ``length`` tokens (binary search over filler units; the tokenizer measures each)."""
        make, hi = self.generator(length, index, seed, n_facts)

        def size(n):
            return len(render_first(tokenizer, make(n)))

        lo = 0
        if size(0) > length:
            raise ValueError(f"{self.name}: length {length} is below the task's fixed part ({size(0)} tokens)")
        hi = min(hi, 4 * length)  # a unit is at least one token
        if size(hi) <= length:
            raise ValueError(f"{self.name}: not enough filler for {length} tokens")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if size(mid) <= length:
                lo = mid
            else:
                hi = mid
        inst = make(lo)
        return inst, render_first(tokenizer, inst)


_TASKS: dict = {}


def register_task(name: str, score: Callable | None = None, columns: Callable | None = None):
    """Decorator: register a generator as the task ``name`` (optionally with its own scorer and report
    columns). A name is registered once."""
    def deco(generator):
        if name in _TASKS:
            raise ValueError(f"task {name!r} is already registered")
        _TASKS[name] = Task(name, generator, score or score_reply, columns or turn_columns)
        return generator

    return deco


def unregister_task(name: str) -> None:
    _TASKS.pop(name, None)


def task_names() -> tuple:
    """Every registered task, in registration order (the report's column order)."""
    return tuple(_TASKS)


def get_task(name: str) -> Task:
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(_TASKS)}")
    return _TASKS[name]
