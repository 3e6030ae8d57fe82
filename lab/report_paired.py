"""Paired comparisons (exact McNemar on the same prompts) and the needle block-cut table of the report."""

from __future__ import annotations

from .report_format import _REGIME_NAME, _ci_cell, _mean, _order, _pct, md_row, md_table
from veloxquant_mlx.evaluation.results import FULL
from .stats import fmt_p, paired


def _paired_outcomes(res, regime, density, m, columns) -> dict:
    """{(haystack, context, depth, key): correct} of one method over ``columns`` (errors left out)."""
    out = {}
    for hay, ctx in columns:
        for (depth, key), v in res.get((regime, density, m, hay, ctx), {}).items():
            if v != "error":
                out[(hay, ctx, depth, key)] = v
    return out


def _paired_table(lines, res, regime, density, members, columns, prefill_only, ref="nexus") -> dict:
    """Nexus against every other row on the same prompts: the discordant counts and the exact
    McNemar two-sided p. Returns {method: stats.paired(...)}."""
    if ref not in members:
        return {}
    mine = _paired_outcomes(res, regime, density, ref, columns)
    out = {}
    for m in members:
        if m == ref:
            continue
        r = paired(mine, _paired_outcomes(res, regime, density, m, columns))
        if r["n"]:
            out[m] = r
    if not out:
        return out
    lines.append(f"*Paired: {ref} against each method on the same prompts ({_REGIME_NAME[regime]}, "
                 f"{density:.0%}; exact McNemar test on the discordant prompts).*\n")
    lines += md_table([f"{ref} vs", "Prompts", "Both right", f"Only {ref}", "Only other", "Neither",
                       "Difference (points)", "p (two-sided)"])
    for m in _order(out):
        r = out[m]
        diff = 100 * (r["only_a"] - r["only_b"]) / r["n"]
        label = m + (" †" if regime == "decode" and prefill_only.get(m) else "")
        lines.append(md_row([label] + [str(r[k]) for k in ("n", "both", "only_a", "only_b", "neither")] +
                            [f"{diff:+.1f}", fmt_p(r["p"])]))
    lines.append("")
    return out


def needle_cut_summary(cells, regime, density) -> dict:
    """Per method: the block cut of the needle's key tokens (cells with ``needle_cut_frac``, seed 0) and
    accuracy conditioned on it. {method: {n, cut_mean, cut_any, kept_mean, whole_mean, cut: (k, n),
    nocut: (k, n), cut_right, cut_wrong}} (the last two: mean cut fraction on right / wrong answers)."""
    out = {}
    for c in cells:
        if (c["regime"] != regime or c.get("seed", 0) != 0 or "needle_cut_frac" not in c
                or (c["method"] != FULL and c.get("density") != density)):
            continue
        g = out.setdefault(c["method"], {"rows": []})
        g["rows"].append((c["needle_cut_frac"], c["needle_kept_frac"], c["needle_whole_frac"], bool(c["correct"])))
    for m, g in out.items():
        rows = g.pop("rows")
        cut = [r for r in rows if r[0] > 0]
        nocut = [r for r in rows if r[0] == 0]
        g.update(n=len(rows), cut_mean=_mean([r[0] for r in rows]), cut_any=len(cut) / len(rows),
                 kept_mean=_mean([r[1] for r in rows]), whole_mean=_mean([r[2] for r in rows]),
                 cut=(sum(r[3] for r in cut), len(cut)), nocut=(sum(r[3] for r in nocut), len(nocut)),
                 cut_right=_mean([r[0] for r in rows if r[3]]), cut_wrong=_mean([r[0] for r in rows if not r[3]]),
                 whole_right=_mean([r[2] for r in rows if r[3]]), whole_wrong=_mean([r[2] for r in rows if not r[3]]))
    return out


def _pc(x):
    return "–" if x is None else f"{100 * x:.1f}%"


def _needle_cut_table(lines, cells, regime, density):
    summ = needle_cut_summary(cells, regime, density)
    if not summ:
        return
    lines.append(f"*Block-boundary cut of the needle ({_REGIME_NAME[regime]}, {density:.0%}): for every "
                 "(layer, KV head) the kept positions after generation against the key's token spans (the key "
                 "occurs twice in the needle). Cut = some of an occurrence's tokens kept and some evicted.*\n")
    lines += md_table(["Method", "Prompts", "(layer, head) pairs with a cut", "Prompts with any cut", "Key tokens kept",
                       "Pairs keeping a whole key", "Accuracy, prompts with a cut", "Accuracy, no cut",
                       "Mean cut: right / wrong answers", "Mean whole: right / wrong answers"])
    for m in _order(summ):
        g = summ[m]
        acc = [_ci_cell(*g[k]) + ")" if g[k][1] else "–" for k in ("cut", "nocut")]
        lines.append(f"| {m} | {g['n']} | {_pct(g['cut_mean'])}% | {_pct(g['cut_any'])}% | {_pct(g['kept_mean'])}% | "
                     f"{_pct(g['whole_mean'])}% | {acc[0]} | {acc[1]} | {_pc(g['cut_right'])} / "
                     f"{_pc(g['cut_wrong'])} | {_pc(g['whole_right'])} / {_pc(g['whole_wrong'])} |")
    lines.append("")
