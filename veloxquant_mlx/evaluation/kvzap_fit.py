"""KVzap's training data and fit driver: KVzip+ scores and hidden states of text windows, through the
real model (the fit command ``python -m veloxquant_mlx fit-kvzap`` and the tests' tiny models use it).

Per text window, this project's KVzip with ``normalize="plus"`` (KVzip+) scores every row (the window
is fed as ``mlx_lm.generate`` feeds a prompt, with a budget one row short of it, so the reconstruction
pass runs and scores every row; the one row per head it evicts is left out of the targets), and the
same prompt forward hands every full-attention layer's input to the hidden-state tap, which records it.
Then ``methods/kvzap/fit.py`` fits ridge regression per layer on log-scores, picks the ridge strength
on a validation split and reports the fit on held-out windows. The windows are consecutive slices of
the text: train, then validation, then held-out, so held-out text is text the fit never saw.
"""

from __future__ import annotations

import datetime
import importlib
import inspect
import itertools
import os
import subprocess
import sys

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


def stdlib_sources() -> list:
    """The texts of the ``mixed`` corpus, all shipped with Python: the docstrings above, the prose of
    Python's own documentation topics (``pydoc_data.topics``: language reference text with examples),
    and the source code of :data:`STDLIB_MODULES` (identifiers, numbers, literals)."""
    import pydoc_data.topics

    topics = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    code = []
    for name in STDLIB_MODULES:
        try:
            code.append(inspect.getsource(importlib.import_module(name)))
        except (OSError, TypeError):  # a built-in module has no source
            continue
    return [("docstrings", stdlib_text()), ("pydoc topics", topics), ("source code", "\n\n".join(code))]


def interleaved_windows(token_lists: list, length: int, count: int) -> list:
    """Windows of several texts taken in turn (one of each, then the next of each...), so the train,
    validation and held-out splits each hold every kind of text."""
    per = [windows(ids, length, count) for ids in token_lists]
    out = [w for group in itertools.zip_longest(*per) for w in group if w is not None]
    return out[:count]


def windows(ids: list, length: int, count: int) -> list:
    """Up to ``count`` consecutive non-overlapping windows of ``length`` token ids."""
    out = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    return out[:count]


def split_windows(wins: list) -> tuple:
    n = len(wins)
    if n < 3:
        raise ValueError(f"need at least 3 text windows (train, validation, held-out), got {n}: "
                       "use a longer text or a shorter --context")
    a = min(max(int(round(SPLIT[0] * n)), 1), n - 2)
    b = min(max(int(round((SPLIT[0] + SPLIT[1]) * n)), a + 1), n - 1)
    return wins[:a], wins[a:b], wins[b:]


def kvzip_plus_rows(model, tokenizer, ids: list, n_sink: int = 4) -> dict:
    """{layer: (x (n - 1, d_model) float32, y (n - 1, H_kv) float64)} for one window: each token's attention
    input and the KVzip+ score of its row per KV head (NaN where unknown: the sinks, and the row per head
    that the compression after the pass evicted). The last token, fed alone, is left out."""
    import mlx.core as mx
    import numpy as np

    from ..builder import KVCacheBuilder
    from ..config import KVCacheConfig
    from ..methods.kvzip import KVzip
    from ..tap import install_hidden_tap

    n = len(ids)
    cfg = KVCacheConfig("kvzip", budget=n - 1, n_sink=n_sink, allocation="uniform", kvzip_normalize="plus",
                        kvzip_layers="each")
    caches = KVCacheBuilder.for_model(model, cfg, tokenizer=tokenizer)
    zips = {i: c for i, c in enumerate(caches) if isinstance(getattr(c, "method", None), KVzip)}
    install_hidden_tap(model)
    seen = {}
    for i, c in zips.items():  # the prompt's forward hands each layer's input to its step: record it there
        c.needs_hidden = True
        c.method.on_rows = (lambda view, step, i=i, rows=c.method.on_rows:
                            (seen.__setitem__(i, step.hidden), rows(view, step))[1])
    x = mx.array(ids)[None]
    try:
        model(x[:, :-1], cache=caches)  # as mlx_lm.generate feeds a prompt: all but the last token,
    finally:
        for c in zips.values():
            del c.method.on_rows
    model(x[:, -1:], cache=caches)  # then the last alone (the prompt's end: the pass runs)
    out = {}
    for i, c in zips.items():
        if c.method.passes < 1:
            raise RuntimeError(f"layer {i}: the KVzip+ reconstruction pass did not run")
        pos = np.array(c.stored("positions"))[0]
        sc = np.array(c.stored("zip_score").astype(mx.float32))[0]
        y = np.full((n, pos.shape[0]), np.nan)
        for h in range(pos.shape[0]):  # host-side scatter of a few heads, offline
            y[pos[h], h] = sc[h]
        y[:n_sink] = np.nan
        out[i] = (np.array(seen[i][0].astype(mx.float32)), y[:n - 1])
    return out


def hidden_states(model, ids: list, layers: list) -> dict:
    """{layer: (n, d_model) float32 numpy} attention inputs of one plain forward over ``ids``."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from ..tap import install_hidden_tap

    class Capture:  # a layer's own cache that also records the input the tap hands it
        attention_input, needs_hidden = None, True

        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

    install_hidden_tap(model)
    caches = make_prompt_cache(model)
    caps = {i: Capture(caches[i]) for i in layers}
    model(mx.array(ids)[None], cache=[caps.get(i, c) for i, c in enumerate(caches)])
    return {i: np.array(c.attention_input[0].astype(mx.float32)) for i, c in caps.items()}


COLLECT_VERSION = 1  # bump when kvzip_plus_rows changes what it returns: cached windows are then stale


def collect(model, tokenizer, wins: list, bar=None, data_dir=None) -> dict:
    """{layer: [(x, log-target y) per window]}, rows with every head's score known only. ``data_dir``:
    each window's rows are saved there (keyed by the model's identity, the window's ids and this
    collection's version) and read back on a later run, so a long fit resumes and refits are cheap."""
    import numpy as np

    from ..methods.kvzap.fit import log_targets

    data: dict = {}
    for ids in wins:
        f = _rows_file(model, ids, data_dir)
        rows = _cached_rows(f)
        if rows is None:
            rows = {}
            for layer, (x, y) in kvzip_plus_rows(model, tokenizer, ids).items():
                ok = ~np.isnan(y).any(axis=1)
                rows[layer] = (x[ok], log_targets(y[ok]))
            _save_rows(f, rows)
        for layer, xy in rows.items():
            data.setdefault(layer, []).append(xy)
        if bar is not None:
            bar.update(1)
    return data


def _rows_file(model, ids: list, data_dir):
    import hashlib
    import json
    from pathlib import Path

    from ..methods.kvzap.scorer import model_identity

    if data_dir is None:
        return None
    ident = json.dumps(model_identity(model), sort_keys=True)  # once a window: cheap next to its pass
    key = hashlib.sha256(f"{COLLECT_VERSION}|{ident}|{ids}".encode()).hexdigest()[:24]
    return Path(data_dir) / f"window-{key}.npz"


def _cached_rows(f):
    import numpy as np

    if f is None or not f.is_file():
        return None
    with np.load(f) as z:
        layers = sorted({int(k.split(".")[1]) for k in z.files})
        return {i: (z[f"x.{i}"], z[f"y.{i}"]) for i in layers}


def _save_rows(f, rows: dict) -> None:
    import numpy as np

    if f is None:
        return
    f.parent.mkdir(parents=True, exist_ok=True)
    tmp = f.with_name(f.stem + ".tmp.npz")  # written whole, then renamed: a killed run leaves no half file
    np.savez(tmp, **{f"{n}.{i}": a for i, xy in rows.items() for n, a in zip("xy", xy)})
    os.replace(tmp, f)


def fit_scorer(model, tokenizer, wins: list, out, source: str, density: float = 0.2, progress: bool = False,
               command: str | None = None, data_dir=None, kind: str = "linear", mlp: dict | None = None) -> dict:
    """Fit and write a scorer for ``model`` on token windows ``wins``; returns the file's metadata.
    ``command``: what the provenance records as the command (default: this process's argv). ``kind``:
    "linear" (ridge) or "mlp" (``mlp``: hidden, epochs, lr, batch; default ``MLP_DEFAULTS``)."""
    from ..methods.kvzap.scorer import model_identity, read_scorer_metadata, save_scorer
    from ..methods.kvzap.fit import MLP_DEFAULTS, fit_layers, fit_mlp_layers, summarize

    if kind not in ("linear", "mlp"):
        raise ValueError(f"kvzap scorer kind must be 'linear' or 'mlp', got {kind!r}")
    mlp = {**MLP_DEFAULTS, **(mlp or {})}

    train, val, test = split_windows(wins)
    commit = _commit()  # the code that runs the fit (read now: a commit made while it runs is not it)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(wins), desc="fit-kvzap", unit="text", file=sys.stderr)
    from ..builder import KVCacheBuilder
    from ..model_pass import model_pass_installed

    fresh = not (KVCacheBuilder.installed(model) or model_pass_installed(model))
    try:
        parts = [collect(model, tokenizer, w, bar, data_dir) for w in (train, val, test)]
    finally:
        if bar is not None:
            bar.close()
        if fresh:  # leave the model as it came: no pass wrapper (with this tokenizer's prompt), no taps
            KVCacheBuilder.uninstall(model)
    fit = {"kind": kind, "target": "log KVzip+ score (kvzip normalize='plus', layers='each')",
           "context": len(wins[0]), "n_sink_left_out": 4}
    if kind == "linear":
        weights, quality, alphas = fit_layers(*parts, density=density)
        fit.update(regression="ridge, closed form, strength chosen on the validation windows",
                   alpha={str(k): v for k, v in alphas.items()})
    else:
        weights, quality, epochs = fit_mlp_layers(*parts, density=density, **mlp)
        fit.update(regression="2-layer MLP (GELU), Adam on squared error, the epoch with the lowest "
                   "validation error kept", **mlp, best_epoch={str(k): v for k, v in epochs.items()})
    tokens = {"train": sum(map(len, train)), "validation": sum(map(len, val)), "held_out": sum(map(len, test))}
    prov = {"commit": commit, "command": command or " ".join(sys.argv),
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


_TINY_SCORERS: dict = {}


def tiny_scorer(model, folder, tokenizer=None, seed: int = 1000):
    """A scorer for a tiny random model (tests, the behaviour fingerprint), fitted by the real fit on five
    fixed windows of 48 random token ids; once per model identity and folder. Returns its path."""
    import hashlib
    import json
    import warnings
    from pathlib import Path

    import numpy as np

    from ..methods.kvzap.scorer import model_identity
    from ..model_dims import config_field

    ident = model_identity(model)
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(folder) / f"{ident['architecture']}-{key}.safetensors"
    if (path, seed) not in _TINY_SCORERS and not path.exists():
        vocab = int(config_field(model, "vocab_size"))
        wins = [np.random.default_rng(seed + s).integers(0, vocab, size=48).tolist() for s in range(5)]
        with warnings.catch_warnings():  # e.g. kvzip's note that a tiny model has no tokenizer
            warnings.simplefilter("ignore")
            fit_scorer(model, tokenizer, wins, path, f"random token windows (seed {seed})")
    _TINY_SCORERS[(path, seed)] = path
    return path
