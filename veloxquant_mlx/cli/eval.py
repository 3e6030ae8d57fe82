"""``python -m veloxquant_mlx eval {passkey,perplexity,speed,report}``: the real-model evaluation.

Every run is resumable: finished cells live in ``<out-dir>/<experiment>.json`` keyed by a cell id,
and a re-run skips them. ``--quick`` swaps the bundled model for a tiny random llama and a byte
tokenizer (seconds; a harness check, numbers meaningless). Use the top-level ``--fast-blas`` (or
``LD_PRELOAD=.../libopenblas.so.0 OPENBLAS_NUM_THREADS=1``) for realistic CPU timings.
"""

from __future__ import annotations

import argparse
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
                   help="run at most this many unfinished cells (0: say what would run, write nothing)")
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


def _cmd(module_name):
    def handler(args):
        # Deferred: building the parser must not import every harness (and mlx-lm's generate).
        from ..evaluation import perplexity, retrieval, speed
        from ..evaluation.report import write_report

        from ..evaluation.outputs import check_out_dir, writes

        mod = {"retrieval": retrieval, "perplexity": perplexity, "speed": speed}[module_name]
        check_out_dir(args)
        rc = mod.run(args)
        if not getattr(args, "no_report", False) and writes(args):
            write_report(args.out_dir, _md_path(args))
        return rc

    return handler


def _report(args):
    from ..evaluation.report import write_report

    path = write_report(args.out_dir, _md_path(args))
    print(f"wrote {path}")
    return 0


def add_parser(subparsers):
    ev = subparsers.add_parser("eval", help="real-model evaluation: passkey, perplexity, speed, report",
                               description=__doc__.splitlines()[0])
    sub = ev.add_subparsers(dest="eval_command", required=True)

    pk = sub.add_parser("passkey", help="passkey / needle retrieval under every method")
    _common(pk)
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

    pp = sub.add_parser("perplexity", help="streaming perplexity at fixed densities")
    _common(pp)
    pp.add_argument("--n-tokens", type=int, default=None, help="tokens scored (default 2048; quick 384)")
    pp.add_argument("--chunk", type=int, default=None, help="stream chunk (default 128; quick 64)")
    pp.add_argument("--densities", type=float, nargs="+", default=None)

    sp = sub.add_parser("speed", help="prefill / decode tok/s, peak memory and KV bytes")
    _common(sp)
    sp.add_argument("--contexts", type=int, nargs="+", default=None, help="prompt lengths (default 1024 2048 4096)")
    sp.add_argument("--density", type=float, default=0.2)
    sp.add_argument("--decode-tokens", type=int, default=None, help="decoded tokens (default 64; quick 16)")
    sp.add_argument("--repeats", type=int, default=3)
    sp.add_argument("--prefill-step", type=int, default=256)

    for p, mod in ((pk, "retrieval"), (pp, "perplexity"), (sp, "speed")):
        p.add_argument("--results-md", default=None,
                       help=f"report regenerated after the run (default {DEFAULT_RESULTS_MD} for the default "
                            "--out-dir, else <out-dir>/results.md)")
        p.add_argument("--no-report", action="store_true", help="do not regenerate the report after the run")
        p.set_defaults(func=_cmd(mod))

    from ..evaluation import task_eval  # method x task x density through the generate path (its own module)

    tk = sub.add_parser("tasks", help="follow-up turn and RULER-style tasks through the generate path")
    task_eval.add_args(tk, _common)
    tk.set_defaults(func=task_eval.cli_run)
    task_eval.add_report_args(sub.add_parser("tasks-report", help="tables and figures from eval tasks runs"))

    from ..evaluation import report_long

    report_long.add_args(sub.add_parser("long-report", help="method x task x context and speed vs context, one page"))

    rp = sub.add_parser("report", help="regenerate figures and docs/results.md from the JSON files")
    rp.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    rp.add_argument("--results-md", default=None)
    rp.set_defaults(func=_report)
    return ev
