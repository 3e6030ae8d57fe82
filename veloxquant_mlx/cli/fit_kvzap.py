"""``python -m veloxquant_mlx fit-kvzap --model NAME --out FILE``: fit a KVzap scorer for one model.

Per text window: one plain forward collects every full-attention layer's attention input (through the
hidden-state tap), and this project's KVzip with ``normalize="plus"`` (KVzip+) scores every row of the
window (the prompt is fed as ``mlx_lm.generate`` feeds it, with a budget one row short of the window,
so the reconstruction pass runs and scores every row; the one row per head it evicts is left out of the
targets). Then ``methods/kvzap_fit.py`` fits ridge regression per layer on log-scores, picks the ridge
strength on a validation split and reports the fit on held-out windows. The windows are consecutive
slices of the text: train, then validation, then held-out, so held-out text is text the fit never saw.

The default text ships with Python: the docstrings of a fixed list of standard-library modules (and
of their public functions and classes); ``--text FILE`` fits on a file instead.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import os
import subprocess
import sys

from .args import CLIError, load_model_for_cli

STDLIB_MODULES = ("collections", "itertools", "functools", "json", "re", "pathlib", "argparse", "logging",
                  "datetime", "decimal", "fractions", "statistics", "textwrap", "string", "heapq", "bisect",
                  "random", "unittest", "csv", "sqlite3", "threading", "subprocess", "shutil", "tarfile",
                  "zipfile", "email.message", "http.client", "urllib.parse", "typing", "dataclasses",
                  "contextlib", "asyncio.events", "inspect", "pickle", "difflib", "calendar", "enum")
SPLIT = (0.7, 0.1)  # train, validation shares of the windows; the rest is held out


def stdlib_text() -> str:
    """Docstrings of :data:`STDLIB_MODULES` and their public members, in a fixed order."""
    parts = []
    for name in STDLIB_MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
            obj = getattr(mod, attr, None)
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            doc = inspect.getdoc(obj)
            if doc and getattr(obj, "__module__", "") == mod.__name__:
                parts.append(f"{attr}: {doc}")
    return "\n\n".join(p for p in parts if p)


def windows(ids: list, length: int, count: int) -> list:
    """Up to ``count`` consecutive non-overlapping windows of ``length`` token ids."""
    out = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    return out[:count]


def split_windows(wins: list) -> tuple:
    n = len(wins)
    if n < 3:
        raise CLIError(f"need at least 3 text windows (train, validation, held-out), got {n}: "
                       "use a longer text or a shorter --context")
    a = min(max(int(round(SPLIT[0] * n)), 1), n - 2)
    b = min(max(int(round((SPLIT[0] + SPLIT[1]) * n)), a + 1), n - 1)
    return wins[:a], wins[a:b], wins[b:]


class _Capture:
    """Wraps a layer's own cache for the hidden-state pass: records the attention input it is handed."""

    def __init__(self, inner):
        self.inner, self.x = inner, None

    def observe_attention_input(self, x, module=None):
        self.x = x

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_and_fetch(self, keys, values):
        return self.inner.update_and_fetch(keys, values)


def hidden_states(model, ids: list, layers: list) -> dict:
    """{layer: (n, d_model) float32 numpy} attention inputs of one plain forward over ``ids``."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from ..tap import install_hidden_tap

    install_hidden_tap(model)
    caches = make_prompt_cache(model)
    caps = {i: _Capture(caches[i]) for i in layers}
    model(mx.array(ids)[None], cache=[caps.get(i, c) for i, c in enumerate(caches)])
    return {i: np.array(c.x[0].astype(mx.float32)) for i, c in caps.items()}


def kvzip_plus_scores(model, tokenizer, ids: list, n_sink: int = 4) -> dict:
    """{layer: (n, H_kv) float64 numpy} KVzip+ score of every (token, KV head); NaN where unknown (the
    sinks and the row per head that the compression after the pass evicted)."""
    import mlx.core as mx
    import numpy as np

    from ..builder import KVCacheBuilder
    from ..config import KVCacheConfig
    from ..methods.kvzip import KVzipCache

    n = len(ids)
    cfg = KVCacheConfig("kvzip", budget=n - 1, n_sink=n_sink, allocation="uniform", kvzip_normalize="plus",
                        kvzip_layers="each")
    caches = KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer)
    x = mx.array(ids)[None]
    model(x[:, :-1], cache=caches)  # as mlx_lm.generate feeds a prompt: all but the last token,
    model(x[:, -1:], cache=caches)  # then the last alone (the prompt's end: the pass runs)
    out = {}
    for i, c in enumerate(caches):
        if not isinstance(c, KVzipCache):
            continue
        if c.zip_passes < 1:
            raise RuntimeError(f"layer {i}: the KVzip+ reconstruction pass did not run")
        pos = np.array(c.stored("positions"))[0]
        sc = np.array(c.stored("zip_score").astype(mx.float32))[0]
        y = np.full((n, pos.shape[0]), np.nan)
        for h in range(pos.shape[0]):  # host-side scatter of a few heads, offline
            y[pos[h], h] = sc[h]
        y[:n_sink] = np.nan
        out[i] = y
    return out


def collect(model, tokenizer, wins: list, bar=None) -> dict:
    """{layer: [(x, log-target y) per window]}, rows with every head's score known only."""
    import numpy as np

    from ..methods.kvzap_fit import log_targets

    data: dict = {}
    for ids in wins:
        scores = kvzip_plus_scores(model, tokenizer, ids)
        xs = hidden_states(model, ids, sorted(scores))
        for layer, y in scores.items():
            ok = ~np.isnan(y).any(axis=1)
            data.setdefault(layer, []).append((xs[layer][ok], log_targets(y[ok])))
        if bar is not None:
            bar.update(1)
    return data


def fit_scorer(model, tokenizer, wins: list, out, source: str, density: float = 0.2, progress: bool = False) -> dict:
    """Fit and write a scorer for ``model`` on token windows ``wins``; returns the file's metadata."""
    from ..methods.kvzap import model_identity, read_scorer_metadata, save_scorer
    from ..methods.kvzap_fit import fit_layers, summarize

    train, val, test = split_windows(wins)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(wins), desc="fit-kvzap", unit="text", file=sys.stderr)
    try:
        parts = [collect(model, tokenizer, w, bar) for w in (train, val, test)]
    finally:
        if bar is not None:
            bar.close()
    weights, quality, alphas = fit_layers(*parts, density=density)
    fit = {"kind": "linear", "target": "log KVzip+ score (kvzip normalize='plus', layers='each')",
           "regression": "ridge, closed form, strength chosen on the validation windows",
           "alpha": {str(k): v for k, v in alphas.items()}, "context": len(wins[0]), "n_sink_left_out": 4}
    tokens = {"train": sum(map(len, train)), "validation": sum(map(len, val)), "held_out": sum(map(len, test))}
    prov = {"commit": _commit(), "command": " ".join([os.path.basename(sys.argv[0])] + sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "text": source, "tokens": tokens, "windows": [len(train), len(val), len(test)]}
    q = {"per_layer": {str(k): v for k, v in quality.items()}, "mean": summarize(quality)}
    save_scorer(out, weights, model_identity(model), fit, prov, q)
    return read_scorer_metadata(out)


def _commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        r = subprocess.run(["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (r.stdout.strip() + ("+dirty" if dirty else "")) if r.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cmd_fit_kvzap(args):
    if args.context < 16:
        raise CLIError(f"--context must be >= 16 tokens, got {args.context}")
    if args.texts < 3:
        raise CLIError(f"--texts must be >= 3 (train, validation, held-out), got {args.texts}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(out_dir):
        raise CLIError(f"--out {args.out!r}: folder {out_dir!r} does not exist")
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text, source = f.read(), f"file {os.path.basename(args.text)}"
    else:
        text = stdlib_text()
        source = (f"Python {sys.version.split()[0]} standard-library docstrings "
                  f"({', '.join(STDLIB_MODULES)})")
    model, tokenizer = load_model_for_cli(args.model)
    ids = list(tokenizer.encode(text))
    wins = windows(ids, args.context, args.texts)
    meta = fit_scorer(model, tokenizer, wins, args.out, source, progress=True)
    print(f"wrote {args.out}: {len(meta['layers'])} layers, {meta['provenance']['tokens']} tokens")
    print(f"held-out fit (mean over layers): {meta['quality']['mean']}")
    return 0


def add_parser(sub):
    p = sub.add_parser("fit-kvzap", help="fit a KVzap scorer (log KVzip+ scores from hidden states) for a model",
                       description=__doc__.splitlines()[0])
    p.add_argument("--model", default="bundled", help="'bundled', 'gemma3-270m', a .gguf path, or an mlx-lm "
                   "model path (default: bundled)")
    p.add_argument("--out", required=True, help="the scorer .safetensors to write (required)")
    p.add_argument("--text", default=None, help="UTF-8 text to fit on (default: Python's own docstrings)")
    p.add_argument("--context", type=int, default=1024, help="tokens per text window (default 1024)")
    p.add_argument("--texts", type=int, default=40, help="text windows: 70%% train, 10%% validation, the rest "
                   "held out (default 40)")
    p.set_defaults(func=cmd_fit_kvzap)
