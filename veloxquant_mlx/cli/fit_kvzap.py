"""``python -m veloxquant_mlx fit-kvzap --model NAME --out FILE``: fit a KVzap scorer for one model.

The data and the fit live in ``evaluation/kvzap_fit.py`` (KVzip+ scores and hidden states of text
windows) and ``methods/kvzap/fit.py`` (the ridge regression).

The default text ships with Python (``--corpus mixed``, the text every shipped scorer was fitted on):
windows taken in turn from the docstrings of a fixed list of standard-library modules, pydoc's topics
and standard-library source; ``--text FILE`` fits on a file instead.
"""

from __future__ import annotations

import os
import sys

from .args import CLIError, load_model_for_cli, read_text


def _command_line() -> str:
    """The running command as a user would type it (the scorer's metadata records it)."""
    import shlex

    return "python -m veloxquant_mlx " + shlex.join(sys.argv[1:])


def cmd_fit_kvzap(args):
    if args.context < 16:
        raise CLIError(f"--context must be >= 16 tokens, got {args.context}")
    if args.hidden < 1:
        raise CLIError(f"--hidden must be >= 1, got {args.hidden}")
    if args.texts < 3:
        raise CLIError(f"--texts must be >= 3 (train, validation, held-out), got {args.texts}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CLIError(f"--out {args.out!r}: folder {out_dir!r} does not exist")
    from ..evaluation.kvzap_fit import (STDLIB_MODULES, fit_scorer, interleaved_windows, stdlib_sources,
                                         stdlib_text, windows)

    if args.text:
        texts, source = [read_text(args.text, "--text")], f"file {os.path.basename(args.text)}"
    elif args.corpus == "mixed":
        named = stdlib_sources()
        texts = [t for _, t in named]
        source = (f"Python {sys.version.split()[0]} standard library, windows taken in turn from: "
                  f"{', '.join(n for n, _ in named)} (modules {', '.join(STDLIB_MODULES)})")
    else:
        texts = [stdlib_text()]
        source = (f"Python {sys.version.split()[0]} standard-library docstrings "
                  f"({', '.join(STDLIB_MODULES)})")
    model, tokenizer = load_model_for_cli(args.model)
    # The cost, said before it is spent: each window is one forward and one KVzip reconstruction pass.
    print(f"fit-kvzap: {args.texts} windows of {args.context} tokens, each one forward and one KVzip "
          "reconstruction pass (the bar's ETA is the cost; for scale, 120 windows of 512 tokens on "
          "SmolLM2-135M took 40 min and 40 on Qwen2.5-Coder-1.5B 46 min on a shared 2-core CPU)"
          + ("" if args.data_dir else "; --data-dir DIR lets a stopped fit resume"), file=sys.stderr)
    token_lists = [list(tokenizer.encode(t)) for t in texts]
    wins = (windows(token_lists[0], args.context, args.texts) if len(token_lists) == 1
            else interleaved_windows(token_lists, args.context, args.texts))
    meta = fit_scorer(model, tokenizer, wins, args.out, source, progress=True, command=_command_line(),
                      data_dir=args.data_dir, kind=args.kind, mlp={"hidden": args.hidden})
    print(f"wrote {args.out}: {len(meta['layers'])} layers, {meta['provenance']['tokens']} tokens")
    print(f"held-out fit (mean over layers): {meta['quality']['mean']}")
    return 0


def add_parser(sub):
    p = sub.add_parser("fit-kvzap", help="fit a KVzap scorer (log KVzip+ scores from hidden states) for a model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled", help="'bundled', 'gemma3-270m', a .gguf path, or an mlx-lm "
                   "model path (default: bundled)")
    p.add_argument("--out", required=True, help="the scorer .safetensors to write (required)")
    p.add_argument("--text", default=None, help="UTF-8 text to fit on (default: --corpus)")
    p.add_argument("--context", type=int, default=512, help="tokens per text window (default 512, as the "
                   "shipped scorers)")
    p.add_argument("--texts", type=int, default=40, help="text windows: 70%% train, 10%% validation, the rest "
                   "held out (default 40)")
    p.add_argument("--corpus", choices=("docstrings", "mixed"), default="mixed",
                   help="text shipped with Python to fit on (ignored with --text): mixed (docstrings, pydoc "
                   "topics and standard-library source code, in turn; the shipped scorers' text, measured "
                   "better than docstrings alone in docs/methods/kvzap.md) or docstrings (default mixed)")
    p.add_argument("--data-dir", default=None, help="folder that keeps each window's collected scores and "
                   "hidden states: a stopped fit resumes there, and a refit skips the model passes (default: none)")
    p.add_argument("--kind", choices=("linear", "mlp"), default="linear",
                   help="the surrogate: linear (ridge, closed form) or mlp (2 layers, GELU) (default linear)")
    p.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width (default 512)")
    p.set_defaults(func=cmd_fit_kvzap)
