"""Where an ``eval`` run may write, and which lengths a model can take.

A user's run goes to a user's folder (``veloxquant_eval/`` by default); a folder of published figures
(one that holds, or sits under a folder that holds, a ``PUBLISHED`` marker file) changes only with
``--publish``. ``--max-cells 0`` is a dry run: it reads the result file, says what would run, and writes nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

PUBLISHED_MARKER = "PUBLISHED"  # a file whose presence makes its folder's results change only with --publish

# Tokens beyond the first prompt that a cell may still feed or decode (later turns, answers): a
# length is refused unless length + this fits the model's context.
HEADROOM = 256


@dataclasses.dataclass(frozen=True)
class RunControl:
    """How an ``eval`` run walks its cells and where it writes (the harness's settings say which cells)."""

    out_dir: str
    shard: tuple = (0, 1)  # (i, n): every n-th cell starting at i
    time_budget: float | None = None  # seconds after which no new cell starts
    max_cells: int | None = None  # at most this many unfinished cells; 0: a dry run
    progress: bool = True
    publish: bool = False  # allow out_dir inside the published figures/
    stamp: Callable | None = None  # stamp(store) after every stored cell and at the end (the lab's provenance)
    note_every: float = 60.0  # seconds between the accuracy lines printed while cells finish


def is_published(path) -> bool:
    """Whether ``path`` lies in a folder of published figures: it, or a folder above it, holds the marker."""
    p = Path(path).resolve()
    return any((d / PUBLISHED_MARKER).is_file() for d in (p, *p.parents))


def check_out_dir(control: RunControl) -> None:
    """Refuse (ValueError, one line) an output folder inside the published figures without --publish."""
    if control.max_cells == 0:
        return  # a dry run writes nothing anywhere
    if is_published(control.out_dir) and not control.publish:
        raise ValueError(f"--out-dir {control.out_dir} is inside published figures (a {PUBLISHED_MARKER} file marks "
                         "them); pass --publish to change them on purpose, or pick another folder")


def writes(control: RunControl) -> bool:
    """False for ``--max-cells 0`` (nothing is written: no cells, no meta, no report)."""
    return control.max_cells != 0


def model_context(model) -> int | None:
    """The model's trained context (``max_position_embeddings``), None when it does not say."""
    from ..model_dims import config_field

    n = config_field(model, "max_position_embeddings")  # nested text_config too
    return int(n) if n else None


def check_lengths(model, lengths, what: str = "length", headroom: int = HEADROOM) -> None:
    """Refuse (ValueError, one line) prompt lengths the model's context cannot hold with ``headroom``."""
    ctx = model_context(model)
    if ctx is None:
        return
    bad = [n for n in lengths if n + headroom > ctx]
    if bad:
        raise ValueError(f"{what} {', '.join(map(str, bad))} + {headroom} tokens of turns and answers exceed the "
                         f"model's context of {ctx} tokens (at most {ctx - headroom})")
