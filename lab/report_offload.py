"""The measured section of docs/offload.md, from the JSON files ``benchmark_scripts/bench_offload.py`` writes
(``figures/offload/{identity,peak,cost,followup,followup_recall}_<model>.json``). Numbers come from the JSON, never by hand:
``python -m lab.report_offload`` rewrites the block between the page's markers, and a test checks it.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from .stats import fmt_ci, fmt_p, paired

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "offload.md"
FIGURES = ROOT / "figures" / "offload"
BEGIN, END = "<!-- offload-figures: python -m lab.report_offload -->", "<!-- /offload-figures -->"
MIB = 1024 * 1024


def _load(name: str) -> dict | None:
    p = FIGURES / name
    return json.loads(p.read_text()) if p.exists() else None


def _prov(data: dict) -> str:
    p = data.get("provenance", {})
    return f"commit {p.get('commit', '?')[:7]}, {p.get('date', '?')[:10]}, `{p.get('command', '?')}`"


def identity_table(data: dict) -> str:
    """Per context and method: prompts whose first greedy tokens agree, the largest log-probability gap, and
    how many each mode answered."""
    cells = defaultdict(list)
    for c in data["cells"]:
        cells[(c["context"], c["method"])].append(c)
    s = data["setting"]
    lines = [f"Same answers ({s['model']}, passkey needle prompts, {int(100 * s['density'])} %, prefill step "
             f"{s['prefill_step_size']}, first {s['new_tokens']} greedy tokens; {_prov(data)}):", "",
             "| context | method | same tokens / prompts [Wilson 95 %] | max abs log-prob gap | answered: end / offload |",
             "|---|---|---|---|---|"]
    for (ctx, method), cs in sorted(cells.items()):
        same = sum(c["same_tokens"] for c in cs)
        gap = max(c["max_abs_logprob_diff"] for c in cs)
        lines.append(f"| {ctx} | `{method}` | {same}/{len(cs)} {fmt_ci(same, len(cs))} | {gap:.1e} | "
                     f"{sum(c['end_answered'] for c in cs)} / {sum(c['offload_answered'] for c in cs)} |")
    total, same = len(data["cells"]), sum(c["same_tokens"] for c in data["cells"])
    lines += ["", f"In all: {same} of {total} (prompt, method) cells give the same tokens."]
    return "\n".join(lines)


def peak_table(data: dict) -> str:
    """Process peak minus the weights per cache and prompt length, each cell in a fresh process."""
    s = data["setting"]
    by = defaultdict(dict)
    for r in data["rows"]:
        by[r["cache"]][r["prompt_tokens"]] = r
    lengths = sorted({r["prompt_tokens"] for r in data["rows"]})
    lines = [f"Peak ({s['model']}, budget {s['budget']}, prefill step {s['prefill_step_size']}, page block "
             f"{s['page_block']}, {s['new_tokens']} new tokens; `mx.get_peak_memory()` minus the weights, "
             f"MiB, one process per cell; {_prov(data)}):", "",
             "| cache | " + " | ".join(f"{n:,}" for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for cache in sorted(by, key=lambda c: (not c.endswith(":offload"), c)):
        lines.append(f"| `{cache}` | " + " | ".join(
            f"{by[cache][n]['peak_over_weights_bytes'] / MIB:.1f}" if n in by[cache] else "–" for n in lengths) + " |")
    notes = []
    for cache in sorted(c for c in by if c.endswith(":offload")):
        ns = sorted(by[cache])
        if len(ns) > 1:
            a, b = by[cache][ns[0]], by[cache][ns[-1]]
            notes.append(f"`{cache}` grows {b['peak_over_weights_bytes'] / a['peak_over_weights_bytes']:.2f}× from "
                         f"{ns[0]:,} to {ns[-1]:,} tokens; the per-row state grows from "
                         f"{a['page_resident_bytes'] / MIB:.2f} to {b['page_resident_bytes'] / MIB:.2f} MiB and the "
                         f"caches' allocation after the prompt (the kept rows' buffers and that per-row state) from "
                         f"{a['kv_allocated_after_bytes'] / MIB:.1f} to {b['kv_allocated_after_bytes'] / MIB:.1f} MiB; "
                         f"the page file holds "
                         f"{b['page_disk_bytes'] / MIB:.0f} MiB")
        full = by.get("kvcache", {})
        both = set(ns) & set(full)
        if both:  # the longest prompt both ran
            n = max(both)
            notes.append(f"at {n:,} tokens `{cache}` peaks at "
                         f"{by[cache][n]['peak_over_weights_bytes'] / full[n]['peak_over_weights_bytes']:.2f}× "
                         "`KVCache`'s")
    return "\n".join(lines + [""] + [f"- {n}." for n in notes])


def cost_table(data: dict) -> str:
    """Per method: the paired offload / end prefill process-time ratio over the rounds, and the bytes read back."""
    s = data["setting"]
    by = defaultdict(list)
    for r in data["rows"]:
        by[r["method"]].append(r)
    lines = [f"Cost ({s['model']}, {s['length']:,}-token prompt, budget {s['budget']}, prefill step "
             f"{s['prefill_step_size']}; process time of the prefill and first token, offload over end, paired in "
             f"each round, the order alternated; {data['machine']['cpus']} shared CPU cores, OpenBLAS preloaded; "
             f"{_prov(data)}):", "",
             "| method | rounds | CPU-time ratio, median [min–max] | wall ratio, median | read back per prompt |",
             "|---|---|---|---|---|"]
    for method, rows in sorted(by.items()):
        cpu = [r["cpu_ratio"] for r in rows]
        wall = [r["wall_ratio"] for r in rows]
        read = statistics.median(r["page_bytes_read"] for r in rows)
        lines.append(f"| `{method}` | {len(rows)} | {statistics.median(cpu):.2f} [{min(cpu):.2f}–{max(cpu):.2f}] | "
                     f"{statistics.median(wall):.2f} | {read / 2**30:.1f} GiB |")
    return "\n".join(lines)


def _last_turns(data: dict) -> dict:
    """cache -> {prompt index: its last turn right}, cells that raised left out."""
    last = defaultdict(dict)
    for p in data["prompts"]:
        for name, turns in p["correct"].items():
            if turns and name not in p.get("errors", {}):
                last[name][p["index"]] = bool(turns[-1])
    return last


def followup_table(data: dict) -> str:
    """Per cache and turn: how many prompts were answered right, the last turn paired against the full
    cache's (prompts only the full cache answered, only this cache answered, exact McNemar p), and the
    cells that raised."""
    s = data["setting"]
    right, n, errors = defaultdict(lambda: defaultdict(int)), defaultdict(int), defaultdict(int)
    for p in data["prompts"]:
        for name, turns in p["correct"].items():
            if name in p.get("errors", {}):
                errors[name] += 1
                continue
            n[name] += 1
            for i, ok in enumerate(turns):
                right[name][i] += bool(ok)
    last = _last_turns(data)
    turns = max((len(t) for p in data["prompts"] for t in p["correct"].values()), default=0)
    lines = [f"Follow-ups ({s['model']}, the follow-up task at {s['length']:,} tokens, {int(100 * s['density'])} %, "
             f"{s['facts']} facts, {turns} turns on the same caches; {_prov(data)}):", "",
             "| cache | prompts | " + " | ".join(f"turn {i + 1} right" for i in range(turns))
             + f" | turn {turns} against `full`: only `full` / only this (McNemar p) | errors |",
             "|---|---|" + "---|" * turns + "---|---|"]
    for name in sorted(set(n) | set(errors), key=lambda x: (x != "full", x)):
        vs = "–"
        if name != "full" and last.get("full"):
            pr = paired(last["full"], last[name])
            vs = f"{pr['only_a']} / {pr['only_b']} ({fmt_p(pr['p'])})"
        lines.append(f"| `{name}` | {n[name]} | " + " | ".join(f"{right[name][i]}/{n[name]}" for i in range(turns))
                     + f" | {vs} | {errors[name]} |")
    return "\n".join(lines)


def recall_table(data: dict) -> str:
    """The two cold tiers on the same follow-up prompts: each method under "end" with ``recall=`` (this file)
    against the same method's "end" and "offload" (the model's offload follow-up file), the last turn paired
    by prompt index."""
    s = data["setting"]
    offload = _load(f"followup_{s['model']}.json") or {"prompts": []}
    if offload.get("setting") != {k: v for k, v in s.items() if k != "recall"}:
        offload = {"prompts": []}  # another setting's prompts do not pair
    ours, theirs = _last_turns(data), _last_turns(offload)
    tier = s["recall"]
    lines = [f"Cold tiers on follow-ups ({s['model']}, the follow-up task at {s['length']:,} tokens, "
             f"{int(100 * s['density'])} %, turn 2 right on the prompts both files ran; the `recall=\"{tier}\"` cells "
             f"{_prov(data)}, the others `followup_{s['model']}.json`'s):", "",
             f"| method | prompts | `full` | `end` | `end` + `recall=\"{tier}\"` | `offload` | `offload` against "
             f"`recall`: only `offload` / only `recall` (McNemar p) |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted(n for n in ours if n != "full"):
        method = name.partition(":")[0]
        rec, end, off = ours[name], theirs.get(f"{method}:end", {}), theirs.get(f"{method}:offload", {})
        common = sorted(set(rec) & set(end) & set(off) & set(ours.get("full", {})))
        if not common:
            continue
        pick = lambda d: {i: d[i] for i in common}
        pr = paired(pick(off), pick(rec))
        count = lambda d: f"{sum(d[i] for i in common)}/{len(common)}"
        lines.append(f"| `{method}` | {len(common)} | {count(ours['full'])} | {count(end)} | {count(rec)} | "
                     f"{count(off)} | {pr['only_a']} / {pr['only_b']} ({fmt_p(pr['p'])}) |")
    return "\n".join(lines)


def _model(data: dict) -> str:
    return {"bundled": "SmolLM2-135M", "gemma3-270m": "Gemma 3 270M"}.get(data["setting"]["model"],
                                                                        data["setting"]["model"])


def identity_fragment(identity: dict) -> str:
    cells = identity["cells"]
    same = sum(c["same_tokens"] for c in cells)
    return (f"the same first {identity['setting']['new_tokens']} tokens as `\"end\"` in {same}/{len(cells)} (prompt, "
            f"method) cells, {len({c['method'] for c in cells})} methods")


def peak_fragment(peak: dict, cache: str = "snapkv:offload") -> str:
    rows = {(r["cache"], r["prompt_tokens"]): r["peak_over_weights_bytes"] for r in peak["rows"]}
    ns = sorted(n for c, n in rows if c == cache)
    full_n = max(n for c, n in rows if c == "kvcache" and (cache, n) in rows)
    name = cache.partition(":")[0]
    return (f"{name}'s peak minus weights {rows[(cache, ns[0])] / MIB:.1f} MiB at {ns[0] // 1024}K, "
            f"{rows[(cache, ns[-1])] / MIB:.1f} MiB at {ns[-1] // 1024}K "
            f"({rows[(cache, full_n)] / rows[('kvcache', full_n)]:.2f}× `KVCache`'s at {full_n // 1024}K)")


def cost_fragment(cost: dict) -> str:
    ratios = defaultdict(list)
    for r in cost["rows"]:
        ratios[r["method"]].append(r["cpu_ratio"])
    med = {m: statistics.median(v) for m, v in ratios.items()}
    text = ", ".join(f"{m} {med[m]:.2f}×" for m in sorted(m for m in med if m != "h2o"))
    if "h2o" in med:
        text += f"; H2O {med['h2o']:.2f}× (a second pass over the file)"
    return f"prefill CPU time against `\"end\"`: {text}"


def readme_row(identity: dict, peak: dict, cost: dict) -> str:
    """The README's "Results at a glance" row: same tokens as "end", the peak against KVCache's, the cost."""
    ctxs = "/".join(f"{n // 1024}K" for n in sorted({c["context"] for c in identity["cells"]}))
    date = max(d.get("provenance", {}).get("date", "")[:10] for d in (identity, peak, cost))
    return (f"| a prompt longer than memory (`prompt_eviction=\"offload\"`) | {_model(identity)}, needle prompts at "
            f"{ctxs}, {int(100 * identity['setting']['density'])} %; peak at budget {peak['setting']['budget']:,}, "
            f"step {peak['setting']['prefill_step_size']}; cost at {cost['setting']['length'] // 1024}K | "
            f"{identity_fragment(identity)}; {peak_fragment(peak)}; {cost_fragment(cost)} | {date} | "
            "[offload.md](docs/offload.md) |")


def section() -> str:
    """Every measured table there is a figure for, in the page's order."""
    parts = []
    for name, render in (("identity_bundled.json", identity_table), ("identity_gemma3-270m.json", identity_table),
                         ("identity_qwen2.5-coder-1.5b.json", identity_table), ("peak_bundled.json", peak_table),
                         ("peak_tiny.json", peak_table),
                         ("cost_bundled.json", cost_table), ("followup_bundled.json", followup_table),
                         ("followup_bundled_40pct.json", followup_table),
                         ("followup_gemma3-270m.json", followup_table),
                         ("followup_recall_bundled.json", recall_table),
                         ("followup_recall_gemma3-270m.json", recall_table)):
        data = _load(name)
        if data and (data.get("cells") or data.get("rows") or data.get("prompts")):
            parts.append(f"`figures/offload/{name}`. " + render(data))
    return "\n\n".join(parts)


def block() -> str:
    return f"{BEGIN}\n{section()}\n{END}"



CHOOSING, README = ROOT / "docs" / "choosing.md", ROOT / "README.md"
CHOOSING_FROM, CHOOSING_TO = "`\"end\"`'s, by construction (see \"the prompt fits\" below): ", " mlx-lm: `KVCache` holds"
README_ROW = "| a prompt longer than memory (`prompt_eviction=\"offload\"`)"


def figures() -> tuple:
    """(identity, peak, cost) of the bundled model: what the README's row and choosing.md's quote."""
    return _load("identity_bundled.json"), _load("peak_bundled.json"), _load("cost_bundled.json")


def choosing_cells(identity: dict, peak: dict, cost: dict) -> str:
    """choosing.md's first row, from its answers cell to its cost: written between the row's two anchors."""
    return f"{identity_fragment(identity)} | {peak_fragment(peak)}; {cost_fragment(cost)}."


def _between(text: str, start: str, end: str, new: str) -> str:
    i = text.index(start) + len(start)
    return text[:i] + new + text[text.index(end, i):]


def write() -> list:
    """Rewrite docs/offload.md's measured block, choosing.md's first row and the README's row."""
    PAGE.write_text(_between(PAGE.read_text(), BEGIN, END, f"\n{section()}\n"))
    CHOOSING.write_text(_between(CHOOSING.read_text(), CHOOSING_FROM, CHOOSING_TO, choosing_cells(*figures())))
    lines = README.read_text().split("\n")
    i = next(k for k, line in enumerate(lines) if line.startswith(README_ROW))
    lines[i] = readme_row(*figures())
    README.write_text("\n".join(lines))
    return [PAGE, CHOOSING, README]


if __name__ == "__main__":
    print("wrote " + ", ".join(str(p.relative_to(ROOT)) for p in write()))
