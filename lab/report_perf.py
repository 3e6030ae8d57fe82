"""Perplexity and speed/memory tables and figures of the report."""

from __future__ import annotations

import statistics

from .report_format import _color, _ctx_label, _err_cells, _ok_cells, _order, _save_figure, _style, md_row, md_table, pyplot
from veloxquant_mlx.evaluation.results import FULL


def _perplexity_tables(data, lines, figs_dir, figures):
    g0 = data.get("grid", {})
    cells = [c for c in _ok_cells(data) if c.get("n_tokens", g0.get("n_tokens")) == g0.get("n_tokens")
             and c.get("chunk", g0.get("chunk")) == g0.get("chunk")]
    if not cells:
        lines.append("_No perplexity cells finished yet._\n")
        return {}
    full = [c for c in cells if c["method"] == FULL]
    full_ppl = full[0]["ppl"] if full else None
    full_late = full[0].get("ppl_second_half") if full else None
    densities = sorted({c["density"] for c in cells if c["method"] != FULL})
    methods_all = [m for m in _order({c["method"] for c in cells}) if m != FULL]
    g = data.get("grid", {})
    lines.append(f"\nStreaming perplexity on {g.get('n_tokens', '?')} tokens of {g.get('text', 'prose')}, fed in "
                 f"chunks of {g.get('chunk', '?')} (each chunk = {g.get('chunk', 0) - 1 if g.get('chunk') else '?'}"
                 " tokens as one call + its last token as a single-token call, so prefill-only methods "
                 "compress at every chunk boundary). Budget = density × sequence length. NLL of every "
                 "token given the evicted cache; 'late' = second half of the sequence.\n")
    if not densities:
        lines.append(f"Only the full cache is measured so far (PPL {full_ppl:.2f}); no eviction cells.\n")
        return {"full": full_ppl, "table": {}}
    lines += md_table(["Method"] + [f"PPL @ {d:.0%}" for d in densities] + [f"late PPL @ {d:.0%}" for d in densities])
    if full_ppl is not None:
        lines.append(md_row(["full (100%)"] + [f"{full_ppl:.2f}"] * len(densities) + [f"{full_late:.2f}"] * len(densities)))
    table = {}
    for m in methods_all:
        row, late = [], []
        for d in densities:
            sel = [c for c in cells if c["method"] == m and c["density"] == d and c.get("seed", 0) == 0]
            if sel:
                table[(m, d)] = sel[0]["ppl"]
                rel = f" ({sel[0]['ppl'] / full_ppl:.2f}×)" if full_ppl else ""
                row.append(f"{sel[0]['ppl']:.2f}{rel}")
                late.append(f"{sel[0].get('ppl_second_half', float('nan')):.2f}")
            else:
                err = [c for c in _err_cells(data) if c["method"] == m and c.get("density") == d]
                row.append("error" if err else "–")
                late.append("error" if err else "–")
        lines.append(md_row([m] + row + late))
    lines.append("")
    try:
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for m in methods_all:
            xs = [d for d in densities if (m, d) in table]
            if xs:
                ax.plot(xs, [table[(m, d)] for d in xs], label=m, color=_color(m), **_style(m))
        if full_ppl:
            ax.axhline(full_ppl, color="k", lw=1, label="full cache")
        ax.set_xscale("log")
        ax.set_xticks(densities)
        ax.set_xticklabels([f"{d:.0%}" for d in densities])
        from matplotlib.ticker import NullFormatter

        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("density (budget / sequence)")
        ax.set_ylabel("perplexity (lower is better)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: curves stay visible
        figures.append(_save_figure(plt, fig, figs_dir, "perplexity_vs_density.png"))
    except Exception as e:  # pragma: no cover
        lines.append(f"_(perplexity figure failed: {e})_\n")
    return {"full": full_ppl, "table": table}


def speed_summary(data, group: str = "core") -> dict:
    """med[(cache, context)] for one group of paired caches (errors kept as {"error": ...})."""
    out = {}
    for c in _ok_cells(data):
        if c.get("group") != group:
            continue
        for name, r in c.get("per_cache", {}).items():
            if "decode_tps" in r or "error" in r:
                out[(name, c["context"])] = {**r, "n": len(r.get("segments", []))}
    return out


def limit_ratios(m, limit) -> list:
    """Per-round decode speed of one cache over the limit's (RotatingKVCache at the same budget), paired
    by round: segment r of both was decoded in the same interleaved round. By CPU time where both runs
    recorded it (a shared machine's wall clock measures the share of the cores a run got), else wall."""
    a, b = (m or {}).get("segments") or [], (limit or {}).get("segments") or []
    key = "decode_cpu_tps" if all(s.get("decode_cpu_tps") for s in a + b) else "decode_tps"
    return [x[key] / y[key] for x, y in zip(a, b)]


def _cpu_timed(med, ctxs) -> bool:
    return all(s.get("decode_cpu_tps") for (c, n), m in med.items() if n in ctxs for s in m.get("segments") or [])


def _ratio_cell(rs) -> str:
    if not rs:
        return "–"
    mid = statistics.median(rs)
    return f"{mid:.2f}× [{min(rs):.2f}–{max(rs):.2f}]" if len(rs) > 1 else f"{mid:.2f}×"


def _speed_block(med, lines, ctxs, caches, with_peak=True):
    mib = 1024 * 1024
    has_limit = any(("rotating", n) in med for n in ctxs)
    tag = " (CPU time)" if _cpu_timed(med, ctxs) else ""
    lim_cols = [f"{_ctx_label(n)} ×limit{tag}" for n in ctxs] if has_limit else []
    lines += md_table(["Cache"] + [f"{_ctx_label(n)} decode tok/s" for n in ctxs] +
                      [f"{_ctx_label(n)} ×KVCache{tag}" for n in ctxs] + lim_cols +
                      ["prefill tok/s " + " / ".join(_ctx_label(n) for n in ctxs)])
    for c in caches:
        tps, rel, lim, pre = [], [], [], []
        for n in ctxs:
            m = med.get((c, n))
            base = med.get(("kvcache", n))
            if m and "decode_tps" in m:
                tps.append(f"{m['decode_tps']:.1f}")
                rel.append(_ratio_cell(limit_ratios(m, base)) if base and "decode_tps" in base else "–")
                lim.append(_ratio_cell(limit_ratios(m, med.get(("rotating", n)))))
                pre.append(f"{m['prefill_tps']:.0f}")
            else:
                tps.append("error" if m else "–")
                rel.append("–")
                lim.append("–")
                pre.append("–")
        lines.append(md_row([c] + tps + rel + (lim if has_limit else []) + [" / ".join(pre)]))
    lines.append("")
    lines += md_table(["Cache"] + [f"{_ctx_label(n)} allocated KV MiB (prefill → end)" for n in ctxs] +
                      [f"{_ctx_label(n)} allocated ×KVCache" for n in ctxs] +
                      [f"{_ctx_label(n)} kept MiB (end)" for n in ctxs])
    for c in caches:
        kv, rel, kept = [], [], []
        for n in ctxs:
            m = med.get((c, n))
            base = med.get(("kvcache", n))
            if m and "kv_bytes_end" in m:
                kv.append(f"{m['kv_bytes_after_prefill'] / mib:.2f} → {m['kv_bytes_end'] / mib:.2f}")
                rel.append(f"{m['kv_bytes_end'] / base['kv_bytes_end']:.3f}×" if base and base.get("kv_bytes_end")
                           else "–")
                kept.append(f"{m['kv_kept_bytes_end'] / mib:.2f}" if m.get("kv_kept_bytes_end") is not None else "–")
            else:
                kv.append("–")
                rel.append("–")
                kept.append("–")
        lines.append(md_row([c] + kv + rel + kept))
    lines.append("")
    if not with_peak:
        return
    lines += md_table(["Cache"] + [f"{_ctx_label(n)} {t}" for t in ("prefill peak Δ MiB", "decode peak Δ MiB",
                                                                     "process peak MiB") for n in ctxs])

    def cell(m, key):
        return f"{m[key] / mib:.0f}" if m and m.get(key) is not None else "–"

    for c in caches:
        row = [[cell(med.get((c, n)), k) for n in ctxs]
               for k in ("peak_memory_bytes", "decode_peak_memory_bytes", "process_peak_bytes")]
        lines.append(md_row([c] + [x for r in row for x in r]))
    lines.append("")


def _speed_tables(data, lines, figs_dir, figures):
    cells = _ok_cells(data)
    if not cells:
        lines.append("_No speed cells finished yet._\n")
        return {}
    med = speed_summary(data, "core")
    ctxs = sorted({k[1] for k in med})
    g = data.get("grid", {})
    caches = ["kvcache", "rotating"] + [c for c in _order({k[0] for k in med}) if c not in ("kvcache", "rotating")]
    caches = [c for c in caches if any((c, n) in med for n in ctxs)]
    seg = g.get("decode_tokens_per_segment", "?")
    lines.append(f"\nPrompt of N tokens (prefill chunks of {g.get('prefill_step', '?')}), then decoding. Design: "
                 f"{g.get('design', '')}; here {g.get('repeats', '?')} rounds × {seg} tokens = "
                 f"{g.get('repeats', 0) * seg if isinstance(seg, int) else '?'} decoded tokens per cache. "
                 f"Eviction budget = {g.get('density', 0.2):.0%} of the prompt; `rotating` = mlx-lm "
                 "RotatingKVCache(max_size=budget, keep=4), the limit: a cache of that many rows that does "
                 "nothing else; ×limit = decode speed over `rotating`'s (×KVCache: over `KVCache`'s), paired per round: median [min–max] over "
                 "rounds, by this process's CPU time when the run recorded it (tok/s columns: wall clock). "
                 "Allocated KV = `sum(c.nbytes)` over all layers: "
                 "every array the caches hold, capacity included (mlx-lm's caches by their own `nbytes`), after "
                 "prefill → at the end of decode; kept = K/V bytes of the kept rows only. Prefill peak Δ = "
                 "`mx.get_peak_memory()` during that cache's prefill minus the active memory before it (weights "
                 "and the other live caches excluded; `mx.reset_peak_memory()` before each); decode peak Δ = the "
                 "same over each decode round (largest round); process peak = `mx.get_peak_memory()` itself "
                 "during that cache's prefill (weights and the caches measured before it in the run included).\n")
    if data.get("meta", {}).get("shared_prefill"):
        lines.append("Shared prefill (`--shared-prefill`): per context ONE prompt pass fed every cache that "
                     "compresses once at the prompt's end (each then took the last prompt id alone and "
                     "compressed); `rotating`, quantized rows and own-prefill methods prefilled alone. The "
                     "prefill tok/s and prefill peak of the shared caches are that one pass's, the same number "
                     "in each row.\n")
    lines.append("**Decode throughput (Table 4 shape) and KV memory (Table 5 shape): "
                 f"{', '.join(caches)}**\n")
    _speed_block(med, lines, ctxs, caches)
    oth = speed_summary(data, "others")
    if oth:
        octx = sorted({k[1] for k in oth})
        lines.append(f"**Every method at {', '.join(_ctx_label(n) for n in octx)} (paired with its own KVCache run)**\n")
        _speed_block(oth, lines, octx, ["kvcache", "rotating"] +
                     [c for c in _order({k[0] for k in oth}) if c not in ("kvcache", "rotating")])
    try:
        plt = pyplot()
        mib = 1024 * 1024
        fig, axes = plt.subplots(1, 4, figsize=(18, 4))
        for c in caches:
            xs = [n for n in ctxs if "decode_tps" in med.get((c, n), {})]
            axes[0].plot(xs, [med[(c, n)]["decode_tps"] for n in xs], marker="o", label=c, color=_color(c))
            axes[1].plot(xs, [med[(c, n)]["prefill_tps"] for n in xs], marker="o", label=c, color=_color(c))
            axes[2].plot(xs, [med[(c, n)]["kv_bytes_end"] / mib for n in xs], marker="o", label=c, color=_color(c))
            axes[3].plot(xs, [med[(c, n)].get("peak_memory_bytes", 0) / mib for n in xs], marker="o", label=c,
                         color=_color(c))
        for ax, t in zip(axes, ("decode tok/s", "prefill tok/s", "allocated KV MiB at end of decode",
                                "prefill peak memory Δ MiB")):
            ax.set_xlabel("prompt tokens")
            ax.set_title(t)
            ax.set_xscale("log", base=2)
        axes[2].legend(fontsize=7)
        figures.append(_save_figure(plt, fig, figs_dir, "speed_memory_vs_context.png"))
    except Exception as e:  # pragma: no cover
        lines.append(f"_(speed figure failed: {e})_\n")
    return med
