"""Passkey tables and figures of the report (accuracy by density, depth and regime; Ada-KV; coverage; seed vs n)."""

from __future__ import annotations

import statistics

from .report_format import _REGIME_NAME, _ci_avg, _ci_cell, _ctx_label, _ok_cells, _order, _pct, md_row, md_table
from .report_paired import _needle_cut_table, _paired_table
from .report_passkey_figures import passkey_figures
from veloxquant_mlx.evaluation.results import FULL, _ada_base, _is_ada


def passkey_summary(data) -> dict:
    """acc[(regime, density, method, haystack, context)] = (correct, n) over depths x keys, seed 0
    (decode-regime rows of prefill-only methods are taken from the prefill-only regime)."""
    cells = _ok_cells(data)
    acc = {}
    for c in cells:
        if c.get("seed", 0) != 0:
            continue
        key = (c["regime"], c["density"], c["method"], c["haystack"], c["context"])
        a = acc.setdefault(key, [0, 0])
        a[0] += int(bool(c["correct"]))
        a[1] += 1
    return acc


def _prefill_only_methods(data) -> dict:
    """method -> True when it compresses only once at the end of the prompt (the full cache counts)."""
    return {c["method"]: c.get("prefill_only_method", c["method"] == FULL)
            for c in (data or {}).get("cells", {}).values() if "prefill_only_method" in c or c["method"] == FULL}


def _passkey_index(data):
    """res[(regime, density, method, haystack, context)][(depth, key)] = True/False/"error" (seed 0).
    Decode-regime entries of prefill-only methods point at their prefill-regime cells; the full cache
    appears under every density (it has none) and both regimes."""
    all_cells = list((data or {}).get("cells", {}).values())
    prefill_only = _prefill_only_methods(data)
    densities = sorted({c["density"] for c in all_cells if c["method"] != FULL and c.get("density") is not None})
    res = {}
    for c in all_cells:
        if c.get("seed", 0) != 0:
            continue
        val = "error" if "error" in c else bool(c["correct"])
        dens_list = densities if c["method"] == FULL else [c["density"]]
        regimes = ["prefill", "decode"] if prefill_only.get(c["method"]) else [c["regime"]]
        for d in dens_list:
            for r in regimes:
                res.setdefault((r, d, c["method"], c["haystack"], c["context"]), {})[(c["depth"], c["key"])] = val
    return res, densities, prefill_only


def passkey_table(data, density, regime, column, ada: bool = False, index=None):
    """{method: (correct, n, n_errors)} on the prompts that every method of this table finished, and
    that prompt count. The table = every method with a cell at (density, column) in either regime;
    without ``ada`` the opt-in ``<method>-ada`` rows are left out, with it the table is the full cache,
    the Ada rows and their uniform-allocation methods (so partial Ada runs never shrink the main table).
    ``index``: ``_passkey_index(data)`` when the caller already built it."""
    res, _, _ = index or _passkey_index(data)
    hay, ctx = column
    methods = {k[2] for k in res if k[0] == regime and k[1] == density and k[3:] == column}
    if ada:
        adas = {m for m in methods if _is_ada(m)}
        methods &= adas | {_ada_base(m) for m in adas} | ({FULL} if adas else set())
    else:
        methods = {m for m in methods if not _is_ada(m)}
    if FULL not in methods:
        return {}, 0
    need = [k for k in res if k[0] == regime and k[1] == density and k[3:] == column and k[2] in methods]
    common = set.intersection(*(set(res[k]) for k in need)) if need else set()
    out = {}
    for m in methods:
        k = (regime, density, m, hay, ctx)
        if k not in res:
            continue
        vals = [res[k][p] for p in common]
        out[m] = (sum(v is True for v in vals), len(vals), sum(v == "error" for v in vals))
    return out, len(common)


def _prompt_scale(data) -> str:
    """'1K/2K-token prompts, 3 depths × 3 keys per haystack' from the finished cells."""
    cells = [c for c in (data or {}).get("cells", {}).values() if c.get("method") == FULL]
    if not cells:
        return "no passkey prompts yet"
    ctxs = "/".join(_ctx_label(n) for n in sorted({c["context"] for c in cells}))
    depths = len({c["depth"] for c in cells})
    keys = len({c["key"] for c in cells})
    return f"{ctxs}-token prompts, {depths} depths × {keys} keys per haystack"


def passkey_coverage(data) -> dict:
    """(haystack, context, regime, density) -> {"prompts", "methods", "cells", "errors"} counted over the
    seed-0 cells (``density`` None: the full cache)."""
    groups = {}
    for c in (data or {}).get("cells", {}).values():
        if c.get("seed", 0) != 0:
            continue
        key = (c["haystack"], c["context"], c["regime"], c.get("density"))
        g = groups.setdefault(key, {"prompts": set(), "methods": set(), "cells": 0, "errors": 0})
        g["prompts"].add((c["depth"], c["key"]))
        g["methods"].add(c["method"])
        g["cells"] += 1
        g["errors"] += "error" in c
    return {k: {"prompts": len(g["prompts"]), "methods": len(g["methods"]), "cells": g["cells"],
                "errors": g["errors"]} for k, g in groups.items()}


def passkey_coverage_table(data) -> str:
    """Markdown table: per haystack x context x regime x density, the prompts and methods finished."""
    groups = passkey_coverage(data)
    rows = md_table(["Haystack", "Context", "Regime", "Density", "Prompts", "Methods", "Cells", "Errors"])
    for (hay, ctx, regime, dens), g in sorted(groups.items(), key=lambda kv: (kv[0][0] != "grass", kv[0][1],
                                                                              kv[0][2] != "prefill",
                                                                              kv[0][3] or 0)):
        rows.append(f"| {hay} | {_ctx_label(ctx)} | {_REGIME_NAME[regime]}"
                    f" | {'100% (full)' if dens is None else f'{dens:.0%}'} | {g['prompts']} | "
                    f"{g['methods']} | {g['cells']} | {g['errors']} |")
    return "\n".join(rows) + "\n"


def _ada_tables(data, lines, densities, grid_cols, ada_methods, headline, index=None):
    """Ada-KV allocation (opt-in ``<method>-ada`` rows) next to the same method with uniform
    allocation, on the prompts both finished; fills headline[("ada", regime, density)]."""
    for density in densities:
        for regime in ("prefill", "decode"):
            tabs = {col: passkey_table(data, density, regime, col, ada=True, index=index) for col in grid_cols}
            cols = [col for col in grid_cols if any(a in tabs[col][0] for a in ada_methods)]
            pairs = [(_ada_base(a), a) for a in ada_methods if any(a in tabs[col][0] for col in cols)]
            if not pairs or (regime == "decode" and not any(  # decode rows of prefill-only methods are copies
                    c["regime"] == "decode" and _is_ada(c["method"]) for c in _ok_cells(data))):
                continue
            lines.append(f"\n#### Ada-KV allocation vs uniform, {density:.0%}, "
                         f"{_REGIME_NAME[regime]}\n")
            lines += md_table(["Method"] + [f"{h} {_ctx_label(n)}" for h, n in cols] + ["Avg. uniform → Ada"])
            summary = {}
            for base, a in pairs:
                cells_txt, tot = [], {base: [0, 0], a: [0, 0]}
                for col in cols:
                    t = tabs[col][0]
                    if base in t and a in t and t[base][1] and t[a][1] and not t[base][2] and not t[a][2]:
                        cells_txt.append(f"{100 * t[base][0] / t[base][1]:.0f} → {100 * t[a][0] / t[a][1]:.0f} "
                                         f"({t[a][1]} prompts)")
                        for m in (base, a):
                            tot[m][0] += t[m][0]
                            tot[m][1] += t[m][1]
                    else:
                        cells_txt.append("–")
                if tot[a][1]:
                    summary[base] = (tot[base][0] / tot[base][1], tot[a][0] / tot[a][1], tot[a][1])
                    avg = f"{_pct(summary[base][0])} → {_pct(summary[base][1])}"
                else:
                    avg = "–"
                lines.append(md_row([base] + cells_txt + [avg]))
            lines.append("")
            headline[("ada", regime, density)] = summary


class PasskeyGrid:
    """Every passkey table's cells, indexed once: the columns (haystack, context), the methods, and per
    (regime, density) the rows and the columns every runnable method finished (``comparable``)."""

    def __init__(self, data):
        self.data = data
        self.cells = _ok_cells(data)
        self.res, self.densities, self.prefill_only = _passkey_index(data)
        self.index = (self.res, self.densities, self.prefill_only)
        self.acc = passkey_summary(data)
        self.cols = sorted({(c["haystack"], c["context"]) for c in data["cells"].values()},
                           key=lambda t: (t[0] != "grass", t[1]))
        self.methods = _order({c["method"] for c in data["cells"].values() if not _is_ada(c["method"])})
        self.ada_methods = _order({c["method"] for c in data["cells"].values() if _is_ada(c["method"])})
        self.tables = {(d, r, col): passkey_table(data, d, r, col, index=self.index)
                       for d in self.densities for r in ("prefill", "decode") for col in self.cols}
        self.comparable = {(r, d): self._comparable_columns(r, d)
                           for d in self.densities for r in ("prefill", "decode")}

    def row(self, regime, density, m, avg_cols=None):
        """Cell strings per column, the accuracy over ``avg_cols`` (default: every column), the number of
        prompts behind it, and whether the row is copied from the prefill-only regime."""
        vals, tot_c, tot_n = [], 0, 0
        for col in self.cols:
            t, n_common = self.tables[(density, regime, col)]
            if m in t and t[m][1]:
                cnum, n, ne = t[m]
                if ne == n:
                    vals.append("error")
                    continue
                vals.append(_ci_cell(cnum, n - ne) + (f", {ne} err)" if ne else ")"))
                if avg_cols is None or col in avg_cols:
                    tot_c += cnum
                    tot_n += n - ne
            else:
                vals.append("–")
        copied = regime == "decode" and bool(self.prefill_only.get(m))
        return vals, (tot_c / tot_n if tot_n else None), tot_n, copied

    def _comparable_columns(self, regime, density):
        """(rows of the table, the columns where every runnable row ran without errors). A method that
        errors in every column (budget too small) is reported as such; the others are compared only
        on these columns, so no average mixes different prompt sets."""
        members = [m for m in self.methods if any(v != "–" for v in self.row(regime, density, m)[0])]

        def ran_clean(m, col):
            t = self.tables[(density, regime, col)][0]
            return m in t and t[m][1] > 0 and t[m][2] == 0

        runnable = [m for m in members if any(ran_clean(m, col) for col in self.cols)]
        return members, [col for col in self.cols if all(ran_clean(m, col) for m in runnable)]

    def has_decode_run(self, density) -> bool:
        return any(c["regime"] == "decode" and c.get("density") == density for c in self.cells)


def _accuracy_table(g: PasskeyGrid, lines, regime, density, title, headline):
    """One regime x density table, its paired comparison and its needle-cut table."""
    members, complete = g.comparable[(regime, density)]
    if not members or (regime == "decode" and not g.has_decode_run(density)):
        return  # no decode-regime run at this density: the table would be copies only
    rows = []
    for m in members:
        vals, avg, n, copied = g.row(regime, density, m, complete)
        label = m + (" †" if copied else "")
        dens = "100%" if m == FULL else f"{density:.0%}"
        rows.append(md_row([label, dens] + vals + [_ci_avg(avg, n)]))
    if complete:
        avgs = {m: g.row(regime, density, m, complete)[1] for m in members}
        n_pr = sum(g.tables[(density, regime, col)][1] for col in complete)
        headline[("common", regime, density)] = ([f"{h} {_ctx_label(n)}" for h, n in complete], avgs, n_pr)
    avg_head = ("Avg. (" + ", ".join(f"{h} {_ctx_label(n)}" for h, n in complete) + ")"
                if complete and len(complete) < len(g.cols) else "Avg.")
    cols = [f"{h} {_ctx_label(n)}" for h, n in g.cols]
    lines.append(f"*{title}.*\n")
    lines += md_table(["Method", "Density"] + cols + [avg_head]) + rows
    lines.append("")
    if complete:
        headline[("paired", regime, density)] = _paired_table(lines, g.res, regime, density, members, complete,
                                                              g.prefill_only)
    _needle_cut_table(lines, g.cells, regime, density)


def _accuracy_tables(g: PasskeyGrid, lines, headline):
    for density in g.densities:
        lines.append(f"\n#### Passkey accuracy (%) at density {density:.0%} (Table 1–2 shape)\n")
        for regime, title in (("prefill", "Prefill-only eviction (prompt_eviction=\"end\": the prompt is held, "
                                            "compressed once at its last token, then decode eviction)"),
                              ("decode", "Prefill + decode eviction (prefill chunks of "
                                         f"{_regime_chunk(g.cells, g.data)} tokens; eviction runs throughout)")):
            _accuracy_table(g, lines, regime, density, title, headline)
        lines.append("Cells: accuracy % [Wilson 95% interval] (correct/prompts). Within one table every number in a column is over "
                     "the same prompts (the depth × key prompts that every method of that table finished; the "
                     "two regimes' tables may cover different prompt counts). "
                     "† prefill-only method (or the full cache): it compresses once at the end of the "
                     "prompt whatever the chunking, so its prefill + decode row is its prefill-only "
                     "result (not re-run).\n")


def _seed_variance_table(cells, lines, headline):
    """Nexus reservoir seeds: the same prompts with the cache seed varied."""
    seeds = sorted({c.get("seed", 0) for c in cells if c["method"] == "nexus"})
    if len(seeds) <= 1:
        return
    lines.append("\n#### Nexus reservoir seed variance (same prompts, cache seed varied)\n")
    lines += md_table(["Regime", "Density", "Prompts"] + [f"seed {s}" for s in seeds] + ["mean ± sd"])
    groups = {}
    for c in cells:
        if c["method"] == "nexus":
            groups.setdefault((c["regime"], c["density"]), {}).setdefault(c.get("seed", 0), {})[
                (c["haystack"], c["context"], c["depth"], c["key"])] = bool(c["correct"])
    for (regime, dens), by_seed in sorted(groups.items()):
        if len(by_seed) < 2:
            continue
        common = set.intersection(*(set(v) for v in by_seed.values()))
        if not common:
            continue
        accs = {s: sum(by_seed[s][p] for p in common) / len(common) for s in by_seed}
        vals = [accs[s] for s in sorted(accs)]
        sd = statistics.pstdev(vals) if len(vals) > 1 else 0.0
        lines.append(md_row([regime, f"{dens:.0%}", str(len(common))] + [_pct(accs.get(s)) for s in seeds] +
                            [f"{_pct(statistics.mean(vals))} ± {_pct(sd)}"]))
        headline[("nexus_seeds", regime, dens)] = (statistics.mean(vals), sd, len(common))
    lines.append("")


def _passkey_tables(data, lines, figs_dir, figures):
    """The passkey section: accuracy tables per density and regime (with their paired and needle-cut
    tables), the Ada-KV tables, the figures and the Nexus seed variance. Returns the numbers the
    reading quotes (``headline``)."""
    if not _ok_cells(data):
        lines.append("_No passkey cells finished yet._\n")
        return {}
    g = PasskeyGrid(data)
    headline = {}
    _accuracy_tables(g, lines, headline)
    if g.ada_methods:
        _ada_tables(data, lines, g.densities, g.cols, g.ada_methods, headline, g.index)
    lines.append("Figure `passkey_accuracy_vs_density.png` plots each table's Avg. column: at every density the "
                 "columns named in that table's Avg. header, so points at different densities can average "
                 "different haystacks and lengths (a method that could not run at a density has no point).\n")
    passkey_figures(g, lines, figs_dir, figures)
    _seed_variance_table(g.cells, lines, headline)
    return headline


def _seed_n_table(data, lines):
    """The reservoir-n study (benchmark_scripts/nexus_seed_n.py at commit ff0fba9, removed): how often
    the one-shot compression keeps a whole key occurrence, per reservoir n, redrawn over many seeds on
    the recorded block weights."""
    if not data or not data.get("prompts"):
        return
    ns = list(next(iter(data["prompts"].values()))["per_n"])
    lines.append(f"\n#### Nexus reservoir n against seed variance (`nexus_seed_n.json`, "
                 f"{data.get('seeds')} seeds, {data.get('density', 0.2):.0%})\n")
    lines.append("The one-shot compression's block weights of each prompt were recorded per layer and the "
                 "selection redrawn with every seed. Cells: mean over layers of P(the layer keeps a whole key "
                 "occurrence) ± the seed-to-seed sd of the fraction of layers that keep one "
                 "(`benchmark_scripts/nexus_seed_n.py` at commit ff0fba9, removed; a proxy: no decoding).\n")
    lines += md_table(["Prompt (1K)"] + ["top-K" if n == "topk" else f"n = {n}" for n in ns])
    for p, r in data["prompts"].items():
        cells = [f"{100 * r['per_n'][n]['p_whole_mean_over_layers']:.0f} ± "
                 f"{100 * r['per_n'][n]['layers_keeping_whole_frac_sd_over_seeds']:.0f}" for n in ns]
        lines.append(md_row([p] + cells))
    lines.append("")


def _regime_chunk(cells, data=None):
    g = (data or {}).get("grid", {})
    if g.get("prefill_step_decode_regime"):
        return str(g["prefill_step_decode_regime"])
    ch = sorted({c.get("prefill_step") for c in cells if c["regime"] == "decode" and c.get("prefill_step")})
    return "/".join(str(c) for c in ch) or "?"
