"""``python -m veloxquant_mlx``: generate with an eviction cache, compress a document, list methods, run the demo.

Flags mirror ``mlx_lm.generate``; every method's options are exposed as ``--<method>-<option>``.
Bad input ends with one ``error:`` line and a non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import sys

from ..platform import blas
from ..registry import methods
from . import compress, demo, fit_kvzap, generate, serve
from . import eval as eval_cmd
from .args import CLIError, Parser


def cmd_methods(args):
    for name, doc in methods().items():
        print(f"{name:12s} {doc}")
    return 0


_FAST_BLAS_HELP = ("Linux CPU: re-run with OpenBLAS preloaded (pip's cmeel-openblas, the fast-cpu extra, else "
                   "Debian's libopenblas0-pthread; ~30x faster fp32 matmul); nothing on macOS. Before or after "
                   "the subcommand")


def build_parser():
    p = Parser(prog="python -m veloxquant_mlx", description=__doc__.splitlines()[0])
    p.add_argument("--fast-blas", action="store_true", help=_FAST_BLAS_HELP)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)

    generate.add_parser(sub)
    compress.add_parser(sub)  # compress once, ask many (generate --prompt-cache)
    m = sub.add_parser("methods", help="list the registered eviction methods", description="List the "
                       "registered eviction methods (--method NAME) with a one-line description each.")
    m.set_defaults(func=cmd_methods)
    demo.add_parser(sub)
    eval_cmd.add_parser(sub)  # real-model evaluation
    serve.add_parser(sub)  # mlx_lm.server with eviction caches
    fit_kvzap.add_parser(sub)  # a KVzap scorer for a model
    _add_after_subcommands(p)
    return p


def _add_after_subcommands(parser):
    """--fast-blas after any (nested) subcommand too; SUPPRESS: absent there, the top-level value stays."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in {id(c): c for c in action.choices.values()}.values():
                command.add_argument("--fast-blas", action="store_true", default=argparse.SUPPRESS,
                                     help=_FAST_BLAS_HELP + " (default: off)")
                _add_after_subcommands(command)


def _fast_blas() -> bool:
    """--fast-blas: re-exec with OpenBLAS preloaded, or say at once (before any slow work) why not.
    Returns whether it printed the slow-BLAS hint."""
    import os

    if blas.openblas_preloaded():
        if not os.environ.get(blas.REEXEC_GUARD_ENV):  # else the re-exec already named the library
            print(f"fast-blas: already preloaded: {blas.describe()}", file=sys.stderr)
        return False
    if os.environ.get(blas.REEXEC_GUARD_ENV):  # a re-executed process whose preload was cleared
        print(f"fast-blas: ${blas.REEXEC_GUARD_ENV} is set (already re-executed once) but no OpenBLAS is "
              "preloaded: not re-executing again", file=sys.stderr)
        return False
    blas.reexec_with_openblas()  # does not return when it re-executes
    hint = blas.blas_hint(tried=True)  # None on macOS / GPU: nothing to do there
    if hint:
        print(f"fast-blas: no OpenBLAS could be preloaded; {hint}", file=sys.stderr, flush=True)
    return bool(hint)


def main(argv=None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # at any point: parsing, loading, generating (a partial answer ends its line first)
        print("interrupted", file=sys.stderr)
        return 130


def _main(argv) -> int:
    from ..models import ModelNotAvailableError

    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a bad flag (2, its one-line error already printed)
        return e.code
    args.blas_hint_shown = _fast_blas() if args.fast_blas else False
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, ModelNotAvailableError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
