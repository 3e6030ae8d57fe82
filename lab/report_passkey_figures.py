"""Passkey figures of the report: accuracy against density, accuracy by depth, and the forest plot of
every table's average with its Wilson interval (matplotlib, the ``bench`` extra)."""

from __future__ import annotations

from .report_format import _REGIME_NAME, _color, _ctx_label, _mean, _save_figure, _style, pyplot, wilson_bars
from veloxquant_mlx.evaluation.results import FULL, _is_ada
from .stats import wilson


def _density_figure(g, plt, figs_dir, figures):
    """Accuracy vs density per regime: each table's Avg. column with Wilson 95% error bars."""
    full_acc = _mean([g.acc[k][0] / g.acc[k][1] for k in g.acc if k[2] == FULL])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, regime in zip(axes, ("prefill", "decode")):
        for m in g.methods:
            if m == FULL or (regime == "decode" and g.prefill_only.get(m)):
                continue  # a prefill-only method holds the whole prompt here: its curve is the left one
            xs, ys, err = [], [], [[], []]
            for d in g.densities:
                _, avg, n, _ = g.row(regime, d, m, g.comparable[(regime, d)][1])
                if n:
                    xs.append(d)
                    for v, dest in zip(wilson_bars(avg, n), (ys, *err)):
                        dest.append(v)
            if xs:  # error bars: Wilson 95%
                ax.errorbar(xs, ys, yerr=err, capsize=2, label=m, color=_color(m), **_style(m))
        if full_acc is not None:
            ax.axhline(100 * full_acc, color="k", lw=1, label="full cache")
        ax.set_title("prefill-only eviction" if regime == "prefill" else
                     "prefill + decode eviction\n(methods that evict during the prompt)")
        ax.set_xlabel("density (budget / prompt)")
        ax.set_xscale("log")
        ax.set_xticks(g.densities)
        ax.set_xticklabels([f"{d:.0%}" for d in g.densities])
    axes[0].set_ylabel("passkey accuracy (%)")
    from matplotlib.ticker import NullFormatter

    for ax in axes:
        ax.xaxis.set_minor_formatter(NullFormatter())
    handles = {h.get_label(): h for ax in axes for h in ax.get_lines()}  # one legend for both panels
    axes[1].legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figures.append(_save_figure(plt, fig, figs_dir, "passkey_accuracy_vs_density.png"))


def _depth_figure(g, plt, figs_dir, figures):
    """Accuracy by needle depth (or five depth bins) at 20% density, per regime."""
    d20 = 0.2 if 0.2 in g.densities else g.densities[0]
    depths = sorted({c["depth"] for c in g.cells})
    # Many depths: five equal-width depth bins (each bar then rests on enough prompts for an interval).
    bins = ([(d, d) for d in depths] if len(depths) <= 6 else [(i / 5, (i + 1) / 5) for i in range(5)])

    def in_bin(dep, b):
        return b[0] == dep if b[0] == b[1] else (b[0] <= dep < b[1] or (b[1] == 1.0 and dep == 1.0))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, regime in zip(axes, ("prefill", "decode")):
        ms = [m for m in g.methods if not (regime == "decode" and m != FULL and g.prefill_only.get(m))]
        width = 0.8 / max(len(ms), 1)
        for j, m in enumerate(ms):
            ys, err = [], [[], []]
            for b in bins:
                src = "prefill" if m == FULL else regime  # the full cache's cells are prefill-regime
                sel = [c for c in g.cells if c["method"] == m and in_bin(c["depth"], b) and c.get("seed", 0) == 0
                       and c["regime"] == src and (m == FULL or c["density"] == d20)]
                k = sum(bool(c["correct"]) for c in sel)
                lo, hi = wilson(k, len(sel))
                p = k / len(sel) if sel else float("nan")
                ys.append(100 * p)
                err[0].append(100 * (p - lo) if sel else 0)
                err[1].append(100 * (hi - p) if sel else 0)
            ax.bar([i + j * width for i in range(len(bins))], ys, width, label=m, color=_color(m),
                   hatch="//" if _is_ada(m) else None, yerr=err if len(bins) < len(depths) else None,
                   error_kw={"elinewidth": 0.6, "capsize": 1})
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bins))])
        ax.set_xticklabels([f"depth {a:g}" if a == b else f"depth {a:g}–{b:g}" for a, b in bins])
        ax.set_title(f"{_REGIME_NAME[regime]}, density {d20:.0%}")
    axes[0].set_ylabel("passkey accuracy (%)")
    handles = dict(zip(*reversed(axes[0].get_legend_handles_labels())))  # the left panel has every method
    axes[1].legend(handles.values(), handles.keys(), fontsize=6, loc="upper left",
                   bbox_to_anchor=(1.01, 1.0))  # outside: bars stay visible
    figures.append(_save_figure(plt, fig, figs_dir, "passkey_accuracy_by_depth.png"))


def _forest_figure(g, plt, figs_dir, figures):
    """Forest plot: every table's Avg. column with its Wilson 95% interval."""
    panels = [(r, d) for d in g.densities for r in ("prefill", "decode")
              if g.comparable[(r, d)][1] and (r == "prefill" or g.has_decode_run(d))]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels) + 1, 4.5), squeeze=False)
        for ax, (regime, d) in zip(axes[0], panels):
            ms = [m for m in g.comparable[(regime, d)][0]
                  if not (regime == "decode" and m != FULL and g.prefill_only.get(m))]
            for i, m in enumerate(reversed(ms)):
                _, avg, n, _ = g.row(regime, d, m, g.comparable[(regime, d)][1])
                if not n:
                    continue
                pct, down, up = wilson_bars(avg, n)
                ax.errorbar([pct], [i], xerr=[[down], [up]], fmt="o", capsize=3, color=_color(m))
                if m == FULL:
                    lo, hi = wilson(int(round(avg * n)), n)
                    ax.axvspan(100 * lo, 100 * hi, color="0.85", zorder=0)
            ax.set_yticks(range(len(ms)))
            ax.set_yticklabels(list(reversed(ms)), fontsize=8)
            ax.set_xlim(0, 100)
            ax.set_xlabel("passkey accuracy (%), Wilson 95% interval")
            where = ", ".join(f"{h} {_ctx_label(c)}" for h, c in g.comparable[(regime, d)][1])
            ax.set_title(f"{_REGIME_NAME[regime]}, {d:.0%}\n({where})", fontsize=9)
        figures.append(_save_figure(plt, fig, figs_dir, "passkey_accuracy_ci.png"))


def passkey_figures(g, lines, figs_dir, figures):
    """The three figures of a :class:`~.report_passkey.PasskeyGrid`; a note instead without matplotlib."""
    try:
        plt = pyplot()
    except ImportError as e:
        lines.append(f"_(passkey figures need matplotlib, the bench extra: {e})_\n")
        return

    if not g.densities:  # only the full cache ran: nothing to plot against density
        lines.append("_(no passkey figures: no method with a budget in these cells)_\n")
        return
    _density_figure(g, plt, figs_dir, figures)
    _depth_figure(g, plt, figs_dir, figures)
    _forest_figure(g, plt, figs_dir, figures)
