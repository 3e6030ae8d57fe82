"""Paired summary of figures/eval/kvzip_passkey.json against the published grid (figures/eval/passkey.json).

The kvzip cells ran through the passkey harness on the 20 key-67767 prompts that issue 21's kvpress
comparison used (1K tokens, grass and text, 20 %). For each label: needle found k/n with a Wilson 95 %
interval, and the exact McNemar test against the published cells of the same prompts.

    python benchmark_scripts/kvzip_passkey_paired.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from veloxquant_mlx.evaluation.stats import fmt_ci, fmt_p, paired  # noqa: E402

NEW = ("kvzip", "kvzip-paper", "full")
PUBLISHED = ("full", "nestedkv", "nexus", "snapkv", "pyramidkv", "h2o", "streaming")


def by_prompt(cells: dict, method: str) -> dict:
    """{(haystack, depth): correct} of one label's 1K / 20 % / prefill / seed-0 cells of key 67767."""
    out = {}
    for c in cells.values():
        if (c.get("method") == method and c.get("key") == "67767" and c.get("context") == 1024
                and c.get("regime") == "prefill" and c.get("seed", 0) == 0 and "correct" in c
                and c.get("density") in (0.2, None)):
            out[(c["haystack"], c["depth"])] = bool(c["correct"])
    return out


def main() -> int:
    new = json.loads((ROOT / "figures/eval/kvzip_passkey.json").read_text())["cells"]
    pub = json.loads((ROOT / "figures/eval/passkey.json").read_text())["cells"]
    runs = {m: by_prompt(new, m) for m in NEW}
    prompts = set(runs["kvzip"]) | set(runs["kvzip-paper"]) | set(runs["full"])
    pubs = {m: {k: v for k, v in by_prompt(pub, m).items() if k in prompts} for m in PUBLISHED}
    print("| label | needle found | % [Wilson 95 %] |\n|---|---|---|")
    for name, r in [(f"{m} (this run)", runs[m]) for m in NEW] + [(f"{m} (published)", pubs[m]) for m in PUBLISHED]:
        k, n = sum(r.values()), len(r)
        print(f"| {name} | {k}/{n} | {fmt_ci(k, n)} |")
    print("\n| pair (A vs B) | n | both | only A | only B | neither | McNemar p |\n|---|---|---|---|---|---|---|")
    for a in ("kvzip", "kvzip-paper"):
        if not runs[a]:
            continue
        for b in PUBLISHED:
            s = paired(runs[a], pubs[b])
            print(f"| {a} vs {b} (published) | {s['n']} | {s['both']} | {s['only_a']} | {s['only_b']} | "
                  f"{s['neither']} | {fmt_p(s['p'])} |")
    if runs["kvzip"] and runs["kvzip-paper"]:
        s = paired(runs["kvzip"], runs["kvzip-paper"])
        print(f"| kvzip vs kvzip-paper | {s['n']} | {s['both']} | {s['only_a']} | {s['only_b']} | "
              f"{s['neither']} | {fmt_p(s['p'])} |")
    print("\nmean fraction of the needle's key tokens kept over (layer, head) pairs, by haystack")
    for m in ("kvzip", "kvzip-paper"):
        for hay in ("grass", "text"):
            fr = [c["needle_kept_frac"] for c in new.values() if c.get("method") == m and c.get("haystack") == hay
                  and "needle_kept_frac" in c and c.get("key") == "67767"]
            if fr:
                print(f"{m} {hay}: {sum(fr) / len(fr):.3f} over {len(fr)} prompts")
    print("\nper prompt (haystack, depth): kvzip / kvzip-paper / full (this run)")
    for k in sorted(prompts):
        print(k, *(runs[m].get(k, "-") for m in NEW))
    return 0


if __name__ == "__main__":
    sys.exit(main())
