"""``python -m lab {eval,report,tasks-report,long-report}``: regenerate this repository's figures and docs.

``eval`` runs the package's own harness (``veloxquant-mlx eval ...``, the same flags) with the figure's
provenance stamped into its JSON after every cell, then regenerates the report: ``docs/results.md`` for
the published ``figures/eval``, ``<out-dir>/results.md`` for another folder, ``<out-dir>/tasks.md`` for
``eval tasks``. ``report``, ``tasks-report`` and ``long-report`` regenerate a report from the JSON files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from veloxquant_mlx.evaluation.results import DEFAULT_OUT_DIR, DEFAULT_RESULTS_MD, USER_OUT_DIR


def report_path(out_dir, results_md=None):
    """The report path: docs/results.md for the project's own results folder, else next to the JSON
    (so a --quick or scratch run never overwrites the published report)."""
    if results_md is not None:
        return results_md
    if str(out_dir).rstrip("/") == DEFAULT_OUT_DIR:
        return DEFAULT_RESULTS_MD
    return str(Path(out_dir) / "results.md")


def _eval(args, rest) -> int:
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.eval import run_harness
    from veloxquant_mlx.evaluation.outputs import RunControl, writes

    from .stamp import stamp_store

    run = build_parser().parse_args(["eval", *rest])  # the package's flags, checked by its own parser
    run.stamp = stamp_store
    rc = run_harness(run.eval_command, run)
    if args.no_report or not writes(RunControl(out_dir=run.out_dir, max_cells=run.max_cells)):  # a dry run: none
        return rc
    if run.eval_command == "tasks":
        from .report_tasks import write_tasks_report

        print(f"wrote {write_tasks_report(run.out_dir)}")
    else:
        from .report import write_report

        print(f"wrote {write_report(run.out_dir, report_path(run.out_dir, args.results_md))}")
    return rc


def _report(args) -> int:
    from .report import write_report

    print(f"wrote {write_report(args.out_dir, report_path(args.out_dir, args.results_md))}")
    return 0


def _tasks_report(args) -> int:
    from .report_tasks import write_tasks_report

    print(f"wrote {write_tasks_report(args.out_dir, args.md, args.inputs or [args.out_dir])}")
    return 0


def _long_report(args) -> int:
    from .report_long import write_long_report

    print(f"wrote {write_long_report(args.tasks, args.speed, args.md, args.figs)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab", description=__doc__.splitlines()[0])
    p.add_argument("--fast-blas", action="store_true", help="Linux CPU: re-run with OpenBLAS preloaded")
    sub = p.add_subparsers(dest="command", required=True)

    ev = sub.add_parser("eval", help="the package's eval harness with provenance, then the report", allow_abbrev=False,
                        description="python -m lab eval {passkey,perplexity,speed,tasks} [flags of "
                        "veloxquant-mlx eval] [--results-md PATH] [--no-report]")
    ev.add_argument("--results-md", default=None,
                    help=f"report regenerated after the run (default {DEFAULT_RESULTS_MD} for --out-dir "
                         f"{DEFAULT_OUT_DIR}, else <out-dir>/results.md; eval tasks: <out-dir>/tasks.md)")
    ev.add_argument("--no-report", action="store_true", help="do not regenerate the report after the run")
    ev.set_defaults(func=_eval)

    rp = sub.add_parser("report", help="regenerate figures and docs/results.md from the JSON files")
    rp.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    rp.add_argument("--results-md", default=None)
    rp.set_defaults(func=_report)

    tr = sub.add_parser("tasks-report", help="tables and figures from eval tasks runs")
    tr.add_argument("--inputs", nargs="+", default=None, help="folders holding tasks.json (default: --out-dir)")
    tr.add_argument("--out-dir", default=f"{USER_OUT_DIR}/tasks", help="where the figures go")
    tr.add_argument("--md", default=None, help="markdown path (default <out-dir>/tasks.md)")
    tr.set_defaults(func=_tasks_report)

    lr = sub.add_parser("long-report", help="method x task x context and speed vs context, one page")
    lr.add_argument("--tasks", nargs="+", default=[], help="folders holding an eval tasks tasks.json")
    lr.add_argument("--speed", nargs="+", default=[], help="folders holding an eval speed speed.json")
    lr.add_argument("--md", required=True, help="markdown path to write (e.g. docs/results_long.md)")
    lr.add_argument("--figs", required=True, help="folder for the figures")
    lr.set_defaults(func=_long_report)
    return p


def main(argv=None) -> int:
    from veloxquant_mlx.models import ModelNotAvailableError

    argv = list(sys.argv[1:] if argv is None else argv)
    # eval's own flags are the package's: everything this parser does not know goes to it
    args, rest = build_parser().parse_known_args(argv)
    if rest and args.command != "eval":
        build_parser().parse_args(argv)  # the usual one-line error for an unknown flag
    if args.fast_blas:
        from veloxquant_mlx.platform.blas import reexec_with_openblas

        reexec_with_openblas()
    try:
        return args.func(args, rest) if args.command == "eval" else args.func(args)
    except (ValueError, TypeError, ModelNotAvailableError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
