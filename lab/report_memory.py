"""The memory numbers the README and docs/memory.md / docs/choosing.md quote, written from the figures that
``benchmark_scripts/bench_memory.py`` measures (never typed by hand; ``tests/test_doc_numbers.py`` checks the
pages hold these strings):

* :func:`readme_row`, :func:`allocated_table`: allocated KV and the process peak of every method through plain
  ``mlx_lm.generate`` (``bench_memory.py quant --part memory``, ``figures/memory/generate_2k.json``);
* :func:`stream_step_sentence`: the process peak of ``prompt_eviction="stream"`` at mlx-lm's default prefill
  step and at a small one, against ``KVCache`` (``bench_memory.py peak``, ``figures/memory/peak_2k.json``).
"""

from __future__ import annotations

MIB = 1024 * 1024
README_FIGURE = "figures/memory/generate_2k.json"
KVZIP_FIGURE = "figures/memory/kvzip_peak.json"  # kvcache and kvzip past one reconstruction chunk (2,078, 4,096)
PEAK_FIGURE = "figures/memory/peak_2k.json"


def _ada_by_default(method: str) -> bool:
    """Methods whose default head budgets are Ada-KV's (ragged: storage as wide as the widest head)."""
    from veloxquant_mlx.registry import get_method

    return get_method(method).config_defaults.get("allocation") == "ada"


def _runs(data: dict) -> tuple:
    """(context, {label: run}) of a one-context figure."""
    contexts = sorted({r["prompt_tokens"] for r in data["runs"].values()})
    if len(contexts) != 1:
        raise ValueError(f"expected one context, found {contexts}")
    n = contexts[0]
    return n, {r["label"]: r for r in data["runs"].values() if r["prompt_tokens"] == n}


def _split(runs: dict) -> tuple:
    """(methods with uniform heads, methods with Ada heads by default), the fp labels measured."""
    fp = [lb for lb in runs if lb != "kvcache" and "-" not in lb]
    return [m for m in fp if not _ada_by_default(m)], [m for m in fp if _ada_by_default(m)]


def _span(values, digits: int) -> str:
    return f"{min(values):.{digits}f}–{max(values):.{digits}f}"


def kvzip_peaks(data: dict, more: dict | None = None) -> list:
    """[(prompt tokens, kvzip's process peak / KVCache's, kvzip's, KVCache's)] over both figures."""
    runs = list(data["runs"].values()) + (list(more["runs"].values()) if more else [])
    at = {(r["prompt_tokens"], r["label"]): r["process_peak_bytes"] for r in runs}
    return [(n, at[(n, "kvzip")] / at[(n, "kvcache")], at[(n, "kvzip")], at[(n, "kvcache")])
            for n in sorted({n for n, lb in at if lb == "kvzip"}) if (n, "kvcache") in at]


def readme_row(data: dict, more: dict | None = None) -> str:
    """The README's "allocated KV through `generate`" row (``more``: the kvzip peak figure)."""
    n, runs = _runs(data)
    base = runs["kvcache"]
    uniform, ada = _split(runs)

    def vs(label):
        return runs[label]["kv_allocated_bytes"] / base["kv_allocated_bytes"]

    spans = [_span([vs(m + s) for m in uniform if m + s in runs], d) for s, d in (("", 2), ("-8bit", 3), ("-4bit", 3))]
    ada_text = ", ".join(f"{m} {vs(m):.2f}×" for m in sorted(ada, key=vs))
    peaks = kvzip_peaks(data, more)
    lo, hi = min(p[1] for p in peaks), max(p[1] for p in peaks)
    span = (f"{lo:.2f}× mlx-lm's" if len(peaks) == 1 else
            f"{lo:.2f}–{hi:.2f}× mlx-lm's at {peaks[0][0]:,}–{peaks[-1][0]:,} tokens")
    date = max(d["provenance"]["date"][:10] for d in (data, more) if d)
    return (f"| allocated KV through `generate` | {n // 1024}K prompt, {100 * data['density']:.0f} %, fp / 8-bit / 4-bit kept rows "
            f"| {' / '.join(spans)}× of `KVCache` for {len(uniform)} methods; {ada_text} (Ada heads: storage as wide "
            f"as the widest head); kvzip's process peak {span} (its reconstruction pass) | {date} "
            f"| [memory.md](docs/memory.md) |")


def allocated_table(data: dict) -> str:
    """docs/memory.md's table of the same figure: one row per label."""
    n, runs = _runs(data)
    base = runs["kvcache"]
    lines = ["| cache | allocated MiB | ×`KVCache` | × every token's K/V (what `generate` prints) | kept MiB | "
             "process peak MiB | ×`KVCache`'s peak |", "|---|---|---|---|---|---|---|"]
    for label, r in runs.items():
        lines.append(f"| {label} | {r['kv_allocated_bytes'] / MIB:.2f} | "
                     f"{r['kv_allocated_bytes'] / base['kv_allocated_bytes']:.3f} | {r['allocated_vs_full']:.3f} | "
                     f"{r['kv_kept_bytes'] / MIB:.2f} | {r['process_peak_bytes'] / MIB:.1f} | "
                     f"{r['process_peak_bytes'] / base['process_peak_bytes']:.2f} |")
    return "\n".join(lines)


def uniform_bytes(data: dict, method: str, layers: int = 30, kv_heads: int = 3, head_dim: int = 64,
                  dtype_bytes: int = 4) -> int:
    """layers x heads x budget rows of K and V: what a method keeps, and what uniform heads allocate
    before their decode headroom (the bundled SmolLM2's shapes by default)."""
    n, runs = _runs(data)
    return layers * kv_heads * runs[method]["budget"] * 2 * head_dim * dtype_bytes


def stream_step_sentence(peak: dict, label: str = "kvzap") -> str:
    """The process peak of a streaming cache and of KVCache at each prefill step (mlx-lm's default first)."""
    rows = {(r["label"], r["prefill_step_size"]): r for r in peak["rows"]}
    steps = sorted({s for (_, s) in rows}, reverse=True)
    n = peak["rows"][0]["prompt_tokens"]

    def at(name):
        return " and ".join(f"{rows[(name, s)]['process_peak_bytes'] / MIB:.1f} MiB" for s in steps if (name, s) in rows)

    return (f"At {n // 1024}K, budget {peak['setting']['budget']}, steps of " + " and ".join(f"{s:,}" for s in steps)
            + f": `{label}` streaming peaks at {at(label)}, `KVCache` at {at('kvcache')}")


def ada_bytes(data: dict, method: str = "kvzap") -> str:
    """What a method with Ada heads allocates beside layers x heads x budget rows."""
    _, runs = _runs(data)
    return (f"{runs[method]['kv_allocated_bytes'] / MIB:.2f} MiB where layers × heads × B is "
            f"{uniform_bytes(data, method) / MIB:.1f} MiB")


def kvzip_peak(data: dict, more: dict | None = None) -> str:
    """kvzip's process peak against KVCache's at each prompt length measured."""
    return ", ".join(f"{r:.2f}× `KVCache`'s process peak at {n:,} tokens ({k / MIB:.1f} against {b / MIB:.1f} MiB)"
                     if i == 0 else f"{r:.2f}× at {n:,} ({k / MIB:.1f} against {b / MIB:.1f} MiB)"
                     for i, (n, r, k, b) in enumerate(kvzip_peaks(data, more)))
