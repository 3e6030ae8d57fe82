"""Markdown tables and a figure from ``<out_dir>/tasks.json`` (written by ``eval tasks``).

A column is a task at one length (the follow-up task: one column per turn plus "all turns"; each
task's columns come from its registered report section, :mod:`.tasks`); a row is a method.
Accuracy is % [Wilson 95 %] (correct/prompts) over the prompts that method finished; each method is paired with the full cache (and chosen pairs with each other) on the prompts both
finished, by the exact McNemar test (only A right / only B right, p).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .report_format import md_row, md_table, pyplot
from veloxquant_mlx.evaluation.results import FULL, ROTATING
from .stats import fmt_ci, fmt_p, paired, wilson
from veloxquant_mlx.evaluation.tasks import get_task, task_names, turn_columns

# Paired comparisons printed besides "vs full" (both labels must be present).
PAIRS = (("nexus", "nexus-prompt-topk"), ("nestedkv", "nexus"), ("nestedkv", "nexus-prompt-topk"),
         ("kvzip", "nestedkv"), ("kvzip", "nexus"), ("kvzip", "nexus-prompt-topk"), ("kvzip", "snapkv"),
         ("nexus", "snapkv"))


def setting(c: dict):
    """A cell's budget setting: its density (a float), ``"<n> tokens"`` for a fixed budget, None for
    the full cache's rows (no budget)."""
    if c.get("budget_tokens") is not None:
        return f"{c['budget_tokens']} tokens"
    return c.get("density")


def setting_order(v):
    return (0, 0) if v is None else (1, v) if isinstance(v, (int, float)) else (2, int(str(v).split()[0]))


def outcomes(data: dict) -> dict:
    """{setting: {column: {method: {prompt index: correct}}}}; the rows without a budget (the full
    cache, mlx-lm's QuantizedKVCache) join every setting. A question-left-out cell's column ends in
    "q-out"."""
    cells = [c for c in data.get("cells", {}).values() if "turns" in c]
    settings = sorted({setting(c) for c in cells if setting(c) is not None}, key=setting_order) or [None]
    out = {}
    for c in cells:
        for d in (settings if setting(c) is None else [setting(c)]):
            base = f"{c['task']} {c['length'] // 1024}K" if c["length"] % 1024 == 0 else f"{c['task']} {c['length']}"
            if c.get("question", "in") != "in":
                base += f" q-{c['question']}"
            columns = get_task(c["task"]).columns if c["task"] in task_names() else turn_columns
            for col, ok in columns(base, c).items():
                out.setdefault(d, {}).setdefault(col, {}).setdefault(c["method"], {})[c["index"]] = bool(ok)
    return out


def _methods(data, per_col) -> list:
    order = list(data.get("grid", {}).get("methods", []))
    seen = {m for col in per_col.values() for m in col}
    return [m for m in order if m in seen] + sorted(seen - set(order))


def _col_order(col: str):
    names = task_names()
    task, rest = col.split(" ", 1)
    return (names.index(task) if task in names else 99, rest.replace("all turns", "turn 9"))


def table(data: dict, density) -> list:
    """Markdown lines: method x column at ``density``, then the paired comparisons."""
    per = outcomes(data).get(density, {})
    cols = sorted(per, key=_col_order)
    methods = _methods(data, per)
    lines = md_table(["method"] + cols)
    for m in methods:
        row = []
        for col in cols:
            r = per[col].get(m)
            if not r:
                row.append("–")
                continue
            k, n = sum(r.values()), len(r)
            row.append(fmt_ci(k, n).replace(", ", "–") + f" ({k}/{n})")
        lines.append(md_row([m] + row))
    pair_lines = []
    vs_rotating = [(m, ROTATING) for m in methods if m not in (FULL, ROTATING)] if ROTATING in methods else []
    for a, b in [(FULL, m) for m in methods if m != FULL] + vs_rotating + list(PAIRS):
        if a not in methods or b not in methods:
            continue
        cells = []
        for col in cols:
            if a in per[col] and b in per[col]:
                pr = paired(per[col][a], per[col][b])
                cells.append(f"{pr['only_a']} / {pr['only_b']} (n={pr['n']}), p={fmt_p(pr['p'])}")
            else:
                cells.append("–")
        pair_lines.append(md_row([f"{a} vs {b}"] + cells))
    if pair_lines:
        lines += ["", "Paired (only first right / only second right, exact McNemar):", ""] + \
            md_table(["pair"] + cols) + pair_lines
    return lines


def plot(data: dict, density, path) -> Path | None:
    """Grouped bars (method within column) with Wilson 95 % error bars."""
    per = outcomes(data).get(density, {})
    if not per:
        return None
    plt = pyplot()
    cols = sorted(per, key=_col_order)
    methods = _methods(data, per)
    w = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(cols) + 2), 4))
    for j, m in enumerate(methods):
        xs, ys, lo, hi = [], [], [], []
        for i, col in enumerate(cols):
            r = per[col].get(m)
            if not r:
                continue
            k, n = sum(r.values()), len(r)
            a, b = wilson(k, n)
            xs.append(i + (j - (len(methods) - 1) / 2) * w)
            ys.append(100 * k / n)
            lo.append(100 * (k / n - a))
            hi.append(100 * (b - k / n))
        ax.bar(xs, ys, width=w, label=m, yerr=[lo, hi], capsize=2)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels(cols, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("correct (%), Wilson 95 %")
    ax.set_ylim(0, 105)
    meta = data.get("meta", {})
    ax.set_title(f"{meta.get('model', '')[:60]}\n {_setting_name(density)}, prompt_eviction={meta.get('prompt_eviction')}",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=min(len(methods), 3))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def load(dirs) -> dict:
    """One data dict from the ``tasks.json`` of every folder in ``dirs`` (cells merged; a later file's
    cell with the same id wins); ``sources`` keeps each file's meta and grid (its provenance)."""
    data = {"cells": {}, "grid": {"methods": []}, "sources": []}
    for d in dirs:
        one = json.loads((Path(d) / "tasks.json").read_text())
        data["cells"].update(one.get("cells", {}))
        data["sources"].append({"path": str(Path(d) / "tasks.json"), "meta": one.get("meta", {}),
                                "grid": one.get("grid", {}), "runs": one.get("runs", []),
                                "provenance": one.get("provenance")})
        for m in one.get("grid", {}).get("methods", []):
            if m not in data["grid"]["methods"]:
                data["grid"]["methods"].append(m)
    data["meta"] = data["sources"][0]["meta"] if data["sources"] else {}
    return data


def _setting_name(d) -> str:
    return f"density {d}" if d is None or isinstance(d, (int, float)) else f"fixed budget {d}"


def _source_lines(src: dict) -> list:
    meta = src["meta"]
    m = meta.get("machine", {})
    return [f"- `{src['path']}`: {meta.get('model')}; started {meta.get('date')}, commit "
            f"{meta.get('commit', '')[:10]}{' (dirty)' if meta.get('dirty') else ''}; command `{meta.get('command')}`; "
            f"prompt_eviction={meta.get('prompt_eviction')}, shared prefill={meta.get('shared_prefill')} "
            f"(plain path: {', '.join(meta.get('plain_path_methods', []))}), prefill step {meta.get('prefill_step')}, "
            f"OpenBLAS preloaded={m.get('openblas_preloaded')} ({m.get('openblas_num_threads')} threads), "
            f"methods {', '.join(src['grid'].get('methods', []))}; "
            + _staleness(src.get("provenance"))]


def _staleness(prov) -> str:
    """The source's fingerprints and, when the code has moved since, which rows are stale."""
    from .provenance import stale_methods

    why = stale_methods(prov)
    text = f"fingerprints {json.dumps((prov or {}).get('fingerprint'))}"
    return text + (f"; stale: {'; '.join(f'{m}: {w}' for m, w in why.items())}" if why else "; current")


def write_tasks_report(out_dir, md_path=None, inputs=None) -> Path:
    """``<out_dir>/tasks.md`` and one PNG per density from the ``tasks.json`` of ``inputs`` (folders;
    default ``[out_dir]``)."""
    out_dir = Path(out_dir)
    data = load(inputs or [out_dir])
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = ["# Generate-path tasks (generated by report_tasks.py; do not edit)", "", "Sources:", ""]
    for src in data["sources"]:
        lines += _source_lines(src)
    lines.append("")
    path = Path(md_path) if md_path else out_dir / "tasks.md"
    for d in sorted(outcomes(data), key=setting_order):
        lines += [f"## {_setting_name(d)}", ""] + table(data, d) + [""]
        png = plot(data, d, out_dir / f"tasks_{str(d).replace(' tokens', 'tok')}.png")
        if png:
            lines += [f"![{_setting_name(d)}]({os.path.relpath(png, path.parent)})", ""]
    errs = [c for c in data.get("cells", {}).values() if "error" in c]
    if errs:
        lines += [f"{len(errs)} cells ended in an error, e.g. `{errs[0]['method']}`: {errs[0]['error'][:200]}", ""]
    path.write_text("\n".join(lines))
    return path
