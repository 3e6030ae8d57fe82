"""Shared plumbing of the real-model evaluation: model loading and the resumable JSON cell store (the
method labels are ``labels.py``; the repository's report from the JSON files is ``lab/report.py``).

Every experiment (passkey, perplexity, speed) is a list of *cells*; a cell has a string id built
from its grid coordinates. Finished cells are written to ``<out_dir>/<experiment>.json`` one at a
time (file lock + atomic replace), so a run can be killed at any moment and resumed, and several
worker processes (``--shard i/n``) can fill the same file.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import math
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from ..registry import FULL  # noqa: F401 (re-exported)
from .accuracy import accuracy_line, accuracy_rows, accuracy_table
from .eval_model import ByteTokenizer, load_eval_model, machine_info, tiny_model  # noqa: F401 (re-exported)
from .labels import (ROTATING, MethodSpec, _ada_base, _is_ada, make_caches, method_specs,  # noqa: F401 (re-exported)
                     rotating_caches)


DEFAULT_OUT_DIR = "figures/eval"  # the published grid: written only with --publish


USER_OUT_DIR = "veloxquant_eval"  # a user's run goes here unless --out-dir says otherwise


DEFAULT_RESULTS_MD = "docs/results.md"


def quiet_cache_warnings():
    """Chunked feeding after a single-token step is intended here; silence that advisory."""
    warnings.filterwarnings("ignore", message=".*receives a new prompt.*")


def cell_id(**coords) -> str:
    return "|".join(f"{k}={coords[k]}" for k in coords)


class ResultStore:
    """``{experiment, meta, grid, cells: {id: record}}`` in one JSON file, safe for several writers."""

    def __init__(self, path, experiment: str, write: bool = True):
        self.path = Path(path)
        self.experiment = experiment
        self.write = write  # False: a dry run (--max-cells 0) reads the file and never touches the disk
        if write:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self):
        if not self.write:
            yield
            return
        # The folder is the lock (a lock file beside the JSON would be left behind, and removing it
        # would race with a writer waiting on it); writes are short, so one lock per folder is enough.
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            try:
                import fcntl

                fcntl.flock(fd, fcntl.LOCK_EX)
            except ImportError:  # pragma: no cover - non-POSIX
                pass
            yield
        finally:
            os.close(fd)

    def load(self) -> dict:
        if self.path.exists():
            try:
                return json.loads(self.path.read_text())
            except json.JSONDecodeError:
                warnings.warn(f"{self.path} is corrupt; starting it afresh (old file kept as .bad)")
                os.replace(self.path, self.path.with_suffix(".json.bad"))
        return {"experiment": self.experiment, "meta": {}, "grid": {}, "cells": {}}

    def _write(self, data):
        if not self.write:
            return
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=_json_default))
        os.replace(tmp, self.path)

    def done(self) -> set:
        return set(self.load()["cells"])

    def records(self, ids) -> list:
        """The finished records of the cell ids ``ids``, in their order."""
        cells = self.load()["cells"]
        return [cells[cid] for cid in ids if cid in cells]

    def put(self, cid: str, record: dict):
        with self._locked():
            data = self.load()
            data["cells"][cid] = record
            data.get("claims", {}).pop(cid, None)
            self._write(data)

    def claim(self, cid: str) -> bool:
        """Mark ``cid`` as being run by this process; False if finished or claimed by a live process
        (so several workers can walk the same priority list without duplicating cells)."""
        with self._locked():
            data = self.load()
            if cid in data["cells"]:
                return False
            c = data.setdefault("claims", {}).get(cid)
            if c and c.get("pid") != os.getpid() and c.get("host") == platform.node() and _alive(c.get("pid")):
                return False
            data["claims"][cid] = {"pid": os.getpid(), "host": platform.node(), "t": now()}
            self._write(data)
            return True

    def edit(self, change):
        """Apply ``change(data)`` to the file's contents under the lock and write the result (the lab's
        provenance stamp goes through here)."""
        with self._locked():
            data = self.load()
            change(data)
            self._write(data)

    def update_meta(self, meta: dict | None = None, grid: dict | None = None, run: dict | None = None):
        with self._locked():
            data = self.load()
            if meta:
                data["meta"].update(meta)
            if grid is not None:
                data["grid"] = grid
            if run is not None:
                data.setdefault("runs", []).append(run)
            self._write(data)


def _alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (OSError, TypeError, ValueError):
        return False
    return True


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def now() -> str:
    return _dt.datetime.now().isoformat(timespec="seconds")


def run_cells(store: ResultStore, cells: list, run_one, *, shard=(0, 1), time_budget: float | None = None,
              max_cells: int | None = None, desc: str = "", progress: bool = True, after_cell=None,
              note_every: float = 60.0) -> dict:
    """Run every unfinished cell of this shard (in list order = priority order), storing each.

    ``cells`` is a list of (cell_id, params) pairs; ``run_one(params)`` returns the record; an
    exception becomes ``{"error": ...}`` for that cell. Stops starting new cells after
    ``time_budget`` seconds. ``after_cell()`` runs after each stored cell. Returns counts.
    Where the records hold answers, the bar shows each cache's accuracy so far, and a line with
    their Wilson intervals goes to stderr at most every ``note_every`` seconds (with or without bars).
    """
    from tqdm import tqdm

    i, n = shard
    mine = [(cid, p) for k, (cid, p) in enumerate(cells) if k % n == i]
    done = store.done()
    todo = [(cid, p) for cid, p in mine if cid not in done]
    t0 = time.perf_counter()
    errors = 0
    stopped = False
    mine_ids = {cid for cid, _ in mine}
    # A cell is a record of the JSON: a run_one that shares one pass with other cells (one prompt's
    # prefill-only methods) stores theirs too, and they count here, in the bar and in max_cells alike.
    bar = tqdm(total=len(mine), initial=len(mine_ids & done), desc=desc or store.experiment,
               disable=not progress, dynamic_ncols=True, unit="cell")

    def finished_now() -> int:
        return len(mine_ids & store.done()) - len(mine_ids & done)

    noted = time.perf_counter()

    for cid, params in todo:
        if time_budget is not None and time.perf_counter() - t0 > time_budget:
            stopped = True
            break
        if max_cells is not None and finished_now() >= max_cells:
            break
        if not store.claim(cid):  # finished or being run by another worker meanwhile
            continue
        c0 = time.perf_counter()
        try:
            rec = run_one(params)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # a method that raises is an error for its cell, not a crash
            rec = {"error": f"{type(e).__name__}: {e}"}
            errors += 1
        rec = {**params, **rec, "cell_s": round(time.perf_counter() - c0, 3), "finished": now()}
        store.put(cid, rec)
        if after_cell is not None:
            after_cell()
        bar.update(len(mine_ids & done) + finished_now() - bar.n)
        rows = accuracy_rows(store.records([cid for cid, _ in mine]))
        bar.set_postfix_str(", ".join(f"{label} {right}/{n}" for label, right, n in rows) or cid[-60:])
        if rows and time.perf_counter() - noted >= note_every:
            noted = time.perf_counter()
            tqdm.write(f"{desc or store.experiment} so far: {accuracy_line(rows)}", file=sys.stderr)
    bar.close()
    return {"planned": len(mine), "skipped_done": len(mine_ids & done), "ran": finished_now(), "errors": errors,
            "stopped_by_time_budget": stopped, "wall_s": round(time.perf_counter() - t0, 1)}


def run_experiment(store: ResultStore, cells: list, run_one, control) -> int:
    """The end of every ``eval`` harness: run the unfinished cells with ``control``'s shard / time
    budget / max-cells / progress (:class:`.outputs.RunControl`), record the run in the JSON's meta,
    print the counts and, where the records hold answers, each cache's accuracy with its Wilson interval
    over every finished cell of this shard's plan (earlier runs' included). ``control.stamp(store)``,
    when set, runs after every stored cell and at the end."""
    mine = [cid for k, (cid, _) in enumerate(cells) if k % control.shard[1] == control.shard[0]]
    if not store.write:
        done = store.done()
        print(f"{store.experiment}: {len(mine)} cells planned in {store.path}, {sum(c in done for c in mine)} "
              f"finished, {sum(c not in done for c in mine)} to run; --max-cells 0: nothing written")
        return 0
    stamp = (lambda: control.stamp(store)) if control.stamp is not None else None
    res = run_cells(store, cells, run_one, shard=control.shard, time_budget=control.time_budget,
                    max_cells=control.max_cells, desc=store.experiment, progress=control.progress,
                    note_every=control.note_every,
                    # a partial file (committed mid-run, or a killed run) carries the stamp too
                    after_cell=stamp)
    store.update_meta(run={"finished": now(), "shard": list(control.shard), **res})
    if stamp is not None:
        stamp()
    print(f"{store.experiment}: {res}")
    table = accuracy_table(accuracy_rows(store.records(mine)))
    if table:
        print(table)
    return 0
