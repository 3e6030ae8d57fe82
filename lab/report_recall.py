"""Report for the follow-up recall runs (benchmark_scripts/bench_quality.py recall, figures/recall/*.json):
per turn, each row's accuracy with its Wilson interval, paired (exact McNemar) against the same method
without recall and against the full cache; and the figure "all turns right against resident KV bytes".

    python -m lab.report_recall figures/recall/followup_gemma3.json [...] \
        --out docs/results_recall.md --figs-dir figures/recall
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .report_format import _save_figure, md_table, pyplot, wilson_bars
from .stats import fmt_ci, fmt_p, paired

FULL = "full"


def turn_outcomes(data: dict) -> dict:
    """{label: {turn index: {prompt index: correct}}} over the prompts each label finished."""
    out: dict = {}
    for r in data["prompts"]:
        for name, cell in r["cells"].items():
            for k, t in enumerate(cell.get("turns", ())):
                out.setdefault(name, {}).setdefault(k, {})[r["index"]] = bool(t["correct"])
    return out


def all_turns(data: dict) -> dict:
    """{label: {prompt index: every turn right}}."""
    return {name: {p: all(turns[k][p] for k in turns) for p in turns[0]}
            for name, turns in turn_outcomes(data).items() if 0 in turns}


def _base(name: str) -> str:
    return name.split("-recall-")[0]


def _vs(a: dict, b: dict) -> str:
    s = paired(a, b)
    return f"+{s['only_a']}/-{s['only_b']} (p={fmt_p(s['p'])})"


def table(data: dict) -> list:
    """Markdown lines: one row per label; per turn and for all turns: accuracy [Wilson 95 %], and the
    paired +gained/-lost against the method without recall and against full."""
    outs = turn_outcomes(data)
    every = all_turns(data)
    n_turns = max((len(t) for t in outs.values()), default=0)
    head = ["row", "n"] + [f"turn {k + 1}" for k in range(n_turns)] + ["all turns", "vs no recall (turns)",
                                                                      "vs full (all turns)"]
    rows = []
    for name in sorted(outs, key=lambda n: (n != FULL, _base(n), n)):
        turns = outs[name]
        cells = [name, str(len(turns[0]))]
        cells += [fmt_ci(sum(turns[k].values()), len(turns[k])) if k in turns else "–" for k in range(n_turns)]
        cells.append(fmt_ci(sum(every[name].values()), len(every[name])))
        base = _base(name)
        if base != name and base in outs:
            cells.append("; ".join(_vs(turns[k], outs[base][k]) for k in sorted(turns) if k in outs[base]))
        else:
            cells.append("")
        cells.append(_vs(every[name], every[FULL]) if name != FULL and FULL in every else "")
        rows.append(cells)
    return md_table(head, rows)


def resident_points(data: dict) -> list:
    """(label, mean resident KV bytes at the end, all-turns accuracy, prompts) per label, from the runs'
    recorded byte reports (``resident_bytes_end``: hot rows plus any cold tier held in memory)."""
    every = all_turns(data)
    pts = []
    for name, got in every.items():
        b = [r["cells"][name]["resident_bytes_end"] for r in data["prompts"]
             if "turns" in r["cells"].get(name, {})]
        pts.append((name, sum(b) / len(b), sum(got.values()) / len(got), len(got)))
    return sorted(pts, key=lambda p: p[1])


def figure(runs: dict, figs_dir, filename="recall_accuracy_vs_bytes.png") -> Path:
    """One panel per run (a grid of up to 4 columns): all-turns accuracy (Wilson bars) against resident
    KV bytes (MiB)."""
    plt = pyplot()
    cols = min(len(runs), 4)
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.ravel()[len(runs):]:
        ax.set_visible(False)
    for ax, (title, data) in zip(axes.ravel(), runs.items()):
        for name, b, acc, n in resident_points(data):
            y, lo, hi = wilson_bars(acc, n)
            ax.errorbar(b / 2**20, y, yerr=[[lo], [hi]], fmt="o", capsize=3, label=name)
        ax.set_xlabel("resident KV bytes at the end (MiB)")
        ax.set_ylabel("all turns right (%)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    return _save_figure(plt, fig, figs_dir, filename)


def _title(path: Path, data: dict) -> str:
    s = data.get("setting", {})
    turns = f", {s['n_facts']} turns" if s.get("n_facts") else ""
    return f"{path.stem}: {s.get('length')} tok, density {s.get('density')}{turns}"


def report(paths, figs_dir=None, link_from=".") -> str:
    runs = {}
    lines = ["# Follow-up recall runs", "",
             "Accuracy [Wilson 95 %] per turn; paired exact McNemar as +only this row / -only the other.", ""]
    for p in map(Path, paths):
        data = json.loads(p.read_text())
        runs[_title(p, data)] = data
        lines += [f"## {_title(p, data)}", "", f"Setting: `{json.dumps(data.get('setting', {}))}`", ""]
        lines += table(data) + [""]
    if figs_dir is not None and runs:
        lines += [f"![accuracy against resident bytes]({Path(os.path.relpath(figure(runs, figs_dir), link_from)).as_posix()})", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="report_recall", description=__doc__)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--out", default=None)
    ap.add_argument("--figs-dir", default=None)
    a = ap.parse_args(argv)
    text = report(a.paths, a.figs_dir, Path(a.out).parent if a.out else ".")
    if a.out:
        Path(a.out).write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
