"""The tables of docs/choosing.md, from the summaries ``benchmark_scripts/bench_quality.py choosing`` writes
(``figures/choosing/summary_<model>.json``): every cache's passkey answers paired with the full cache's,
beside the KV it holds at its peak and after the prompt. Numbers come from the JSON, never by hand."""

from __future__ import annotations

MIB = 1024 * 1024
HEADER = ("| cache | prefill chunk | correct / prompts | % [Wilson 95 %] | vs full: only full right / only it right, p "
          "| KV peak MiB | KV after MiB |\n|---|---|---|---|---|---|---|")


def _vs_full(v) -> str:
    return "–" if v is None else f"{v['only_a']} / {v['only_b']} (n={v['n']}), p={v['p']:.2g}"


def table(summary: dict) -> str:
    """The markdown table of one summary: the full cache first, then by accuracy."""
    rows = sorted(summary["rows"], key=lambda r: (r["label"] != "full", -r["accuracy"], r["label"]))
    lines = [HEADER]
    for r in rows:
        lo, hi = r["ci"]
        lines.append(f"| `{r['label']}` | {r['prefill_step']} | {r['correct']}/{r['prompts']} | "
                     f"{100 * r['accuracy']:.1f} [{100 * lo:.1f}–{100 * hi:.1f}] | {_vs_full(r['vs_full'])} | "
                     f"{r['kv_peak_bytes'] / MIB:.2f} | {r['kv_after_bytes'] / MIB:.2f} |")
    return "\n".join(lines)


def row(summary: dict, label: str) -> dict:
    return next(r for r in summary["rows"] if r["label"] == label)
