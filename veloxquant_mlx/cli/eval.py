"""``python -m veloxquant_mlx eval {passkey,perplexity,speed,tasks,report,...}``: the real-model evaluation.

Every run is resumable: finished cells live in ``<out-dir>/<experiment>.json`` keyed by a cell id,
and a re-run skips them. ``--quick`` swaps the bundled model for a tiny random llama and a byte
tokenizer (seconds; a harness check, numbers meaningless). Use the top-level ``--fast-blas`` (or
``LD_PRELOAD=.../libopenblas.so.0 OPENBLAS_NUM_THREADS=1``) for realistic CPU timings.

This module owns the parsers and only translates their arguments into a harness call: each harness
(``evaluation.retrieval``, ``.perplexity``, ``.speed``, ``.task_eval``) takes the model, a frozen
settings object and an ``outputs.RunControl``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ..evaluation.results import DEFAULT_OUT_DIR, DEFAULT_RESULTS_MD, USER_OUT_DIR


def _shard(text):
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants I/N, got {text!r}") from None
    if not (n >= 1 and 0 <= i < n):
        raise argparse.ArgumentTypeError(f"--shard needs 0 <= I < N, got {text!r}")
    return (i, n)


def _common(p):
    p.add_argument("--model", default="bundled", help="'bundled' (SmolLM2-135M-Instruct), a .gguf or mlx-lm path")
    p.add_argument("--quick", action="store_true", help="tiny random model + byte tokenizer (harness check)")
    p.add_argument("--out-dir", default=USER_OUT_DIR, help=f"JSON / figure folder (default ./{USER_OUT_DIR}; the "
                   f"published {DEFAULT_OUT_DIR} needs --publish)")
    p.add_argument("--publish", action="store_true",
                   help="allow --out-dir inside the project's figures/ (resumes and changes the published grid)")
    p.add_argument("--shard", type=_shard, default=(0, 1), help="I/N: run every N-th cell starting at I "
                   "(several workers can share one JSON file)")
    p.add_argument("--time-budget", type=float, default=None, help="stop starting new cells after this many seconds")
    p.add_argument("--max-cells", type=int, default=None,
                   help="stop starting cells once this many have finished in this run; a cell is one record of "
                        "the JSON, as in the bar and the summary's 'ran' (the prefill-only cells of one prompt "
                        "share a pass and finish together, so a run can finish a few more; 0: say what would "
                        "run, write nothing)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    p.add_argument("--methods", nargs="+", default=None,
                   help="restrict to these labels (full, registry names, nexus-topk, nexus-nowalk, <method>-ada "
                        "for Ada-KV allocation, a spec such as nexus:window=8; for speed also kvcache, rotating); "
                        "default: full + every registry method + the Nexus ablations")


def _md_path(args):
    """The report path: docs/results.md for the project's own results folder, else next to the JSON
    (so a --quick or scratch run never overwrites the published report)."""
    if args.results_md is not None:
        return args.results_md
    if str(args.out_dir).rstrip("/") == DEFAULT_OUT_DIR:
        return DEFAULT_RESULTS_MD
    return str(Path(args.out_dir) / "results.md")


def _settings(cls, args, **renamed):
    """``cls`` (a frozen settings dataclass) from the parsed arguments of the same names (lists become
    tuples); ``renamed``: {field: argument name} where the two differ."""
    vals = {}
    for f in dataclasses.fields(cls):
        name = renamed.get(f.name, f.name)
        if hasattr(args, name):
            v = getattr(args, name)
            vals[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**vals)


def _control(args):
    from ..evaluation.outputs import RunControl

    return RunControl(out_dir=args.out_dir, shard=tuple(args.shard), time_budget=args.time_budget,
                      max_cells=args.max_cells, progress=not args.no_progress, publish=args.publish)


def _harness(name):
    """(run function, settings class, {field: argument}) of one harness (imported when it runs: the
    parser must not import every harness and mlx-lm's generate)."""
    from ..evaluation import perplexity, retrieval, speed, task_eval

    return {"passkey": (retrieval.run, retrieval.PasskeySettings, {}),
            "perplexity": (perplexity.run, perplexity.PerplexitySettings, {}),
            "speed": (speed.run, speed.SpeedSettings, {}),
            "tasks": (task_eval.run, task_eval.TaskSettings, {"questions": "question"})}[name]


def run_harness(name: str, args) -> int:
    """Run one harness with the parsed arguments of its subcommand (no report)."""
    from ..evaluation.outputs import check_out_dir
    from ..evaluation.results import load_eval_model

    run, cls, renamed = _harness(name)
    control = _control(args)
    check_out_dir(control)
    model, tokenizer, desc = load_eval_model(args.model, args.quick)
    return run(model, tokenizer, _settings(cls, args, **renamed), control, desc=desc)


def _cmd(name):
    def handler(args):
        from ..evaluation.outputs import writes

        rc = run_harness(name, args)
        if args.no_report or not writes(_control(args)):
            return rc
        if name == "tasks":
            from ..evaluation.report_tasks import write_tasks_report

            print(f"wrote {write_tasks_report(args.out_dir)}")
        else:
            from ..evaluation.report import write_report

            write_report(args.out_dir, _md_path(args))
        return rc

    return handler


def _report(args):
    from ..evaluation.report import write_report

    path = write_report(args.out_dir, _md_path(args))
    print(f"wrote {path}")
    return 0


def _tasks_report(args):
    from ..evaluation.report_tasks import write_tasks_report

    print(f"wrote {write_tasks_report(args.out_dir, args.md, args.inputs or [args.out_dir])}")
    return 0


def _long_report(args):
    from ..evaluation.report_long import write_long_report

    print(f"wrote {write_long_report(args.tasks, args.speed, args.md, args.figs)}")
    return 0


def _passkey_args(pk):
    pk.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (tokens)")
    pk.add_argument("--densities", type=float, nargs="+", default=None)
    pk.add_argument("--haystacks", nargs="+", choices=["grass", "text"], default=None)
    pk.add_argument("--regimes", nargs="+", choices=["prefill", "decode"], default=None)
    pk.add_argument("--depths", type=float, nargs="+", default=None)
    pk.add_argument("--n-keys", type=int, default=3)
    pk.add_argument("--out-name", default="passkey.json",
                    help="result file inside --out-dir (a separate study keeps the published grid untouched)")
    pk.add_argument("--seeds", type=int, nargs="+", default=None, help="Nexus reservoir seeds (custom grid)")
    pk.add_argument("--chunk", type=int, default=256, help="prefill chunk of the prefill + decode regime")
    pk.add_argument("--max-new-tokens", type=int, default=8)
    pk.add_argument("--spread", action="store_true",
                    help="prompt order balanced for partial runs: key by key, depths spread over (0, 1), "
                         "haystacks alternating (default: haystack-major, depths in order)")
    pk.add_argument("--prefill-first", action="store_true",
                    help="run every prefill-only-regime cell (cheap: shared passes) before the decode regime")
    pk.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                    help="prefill-only regime: run every method's prefill separately instead of one shared "
                         "single-chunk pass per prompt (same result, ~methods x slower)")


def _tasks_args(p):
    from ..evaluation.task_eval import PRIORITY, QUESTION
    from ..evaluation.tasks import task_names

    p.set_defaults(out_dir=f"{USER_OUT_DIR}/tasks")
    p.add_argument("--tasks", nargs="+", choices=task_names(), default=None,
                   help=f"default: the priority set {' '.join(PRIORITY['tasks'])}")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="target prompt tokens (default 2048)")
    p.add_argument("--densities", type=float, nargs="+", default=[0.2])
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="fixed token budgets beside the densities")
    p.add_argument("--question", nargs="+", choices=QUESTION, default=None,
                   help="'in': the question is inside what is compressed (default); 'out': the context is "
                        "compressed alone, then the question is asked (kvpress's default)")
    p.add_argument("--fanout", type=int, default=None,
                   help="at most this many methods share one prefill pass (bounds the uncompressed copies "
                        "alive at once; default: all)")
    p.add_argument("--n-prompts", type=int, default=100, help="prompts per task and length")
    p.add_argument("--start", type=int, default=0, help="first prompt index")
    p.add_argument("--n-facts", type=int, default=3, help="facts (= turns) of the follow-up task, 2-4")
    p.add_argument("--seed", type=int, default=0, help="task generator seed")
    p.add_argument("--prompt-eviction", choices=["end", "stream"], default="end")
    p.add_argument("--no-shared-prefill", dest="shared_prefill", action="store_false",
                   help="one prefill per method instead of one shared prefill per prompt (same result)")
    p.add_argument("--no-report", action="store_true", help="do not regenerate the tasks report after the run")


def add_parser(subparsers):
    ev = subparsers.add_parser("eval", help="real-model evaluation: passkey, perplexity, speed, tasks, report",
                               description=__doc__.splitlines()[0])
    sub = ev.add_subparsers(dest="eval_command", required=True)

    pk = sub.add_parser("passkey", help="passkey / needle retrieval under every method")
    _common(pk)
    _passkey_args(pk)

    pp = sub.add_parser("perplexity", help="streaming perplexity at fixed densities")
    _common(pp)
    pp.add_argument("--n-tokens", type=int, default=None, help="tokens scored (default 2048; quick 640)")
    pp.add_argument("--chunk", type=int, default=None, help="stream chunk (default 128; quick 64)")
    pp.add_argument("--densities", type=float, nargs="+", default=None)

    sp = sub.add_parser("speed", help="prefill / decode tok/s, peak memory and KV bytes")
    _common(sp)
    sp.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 1024 2048 4096)")
    sp.add_argument("--density", type=float, default=0.2)
    sp.add_argument("--decode-tokens", type=int, default=None, help="decoded tokens (default 32; quick 8)")
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--prefill-step", type=int, default=256)
    sp.add_argument("--shared-prefill", action="store_true",
                    help="per context one prompt pass shared by every cache that compresses at the prompt's end "
                         "(rotating, quantized and own-prefill methods prefill alone); prefill tok/s is the shared pass's")

    for p, name in ((pk, "passkey"), (pp, "perplexity"), (sp, "speed")):
        p.add_argument("--results-md", default=None,
                       help=f"report regenerated after the run (default {DEFAULT_RESULTS_MD} for the default "
                            "--out-dir, else <out-dir>/results.md)")
        p.add_argument("--no-report", action="store_true", help="do not regenerate the report after the run")
        p.set_defaults(func=_cmd(name))

    tk = sub.add_parser("tasks", help="follow-up turn and RULER-style tasks through the generate path")
    _common(tk)
    _tasks_args(tk)
    tk.set_defaults(func=_cmd("tasks"))

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

    rp = sub.add_parser("report", help="regenerate figures and docs/results.md from the JSON files")
    rp.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    rp.add_argument("--results-md", default=None)
    rp.set_defaults(func=_report)
    return ev
