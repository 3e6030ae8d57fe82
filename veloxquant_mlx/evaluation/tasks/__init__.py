"""Offline, seeded task generators of the generate-path evaluation (``eval tasks``), one module per
family, each registering its tasks in :mod:`.base`'s registry: :mod:`.needle` (the RULER-style
needle tasks and the follow-up turn), :mod:`.vt` (variable tracking), :mod:`.cwe` (common-words
extraction). Prompt rendering and scoring live in :mod:`..task_prompts`.
"""

from __future__ import annotations

# Registration order is the report's column order: needle tasks, then vt, then cwe.
from . import needle  # noqa: F401, I001
from . import vt  # noqa: F401, I001
from . import cwe  # noqa: F401, I001
from .base import Instance, Task, Turn, get_task, register_task, task_names, turn_columns, unregister_task  # noqa: F401
from .cwe import cwe_vocabulary  # noqa: F401
from .filler import long_filler, prose_sentences  # noqa: F401

TASKS = task_names()  # the built-in tasks (task_names() also lists tasks registered later)


def generator(task: str, length: int, index: int, seed: int = 0, n_facts: int = 3):
    """(make(n_units) -> Instance, max_units) for one prompt."""
    return get_task(task).generator(length, index, seed, n_facts)


def build(tokenizer, task: str, length: int, index: int, seed: int = 0, n_facts: int = 3) -> tuple:
    """(Instance, first-turn prompt tokens) of one prompt of ``task`` (see :meth:`Task.build`)."""
    return get_task(task).build(tokenizer, length, index, seed, n_facts)
