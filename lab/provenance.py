"""Provenance of a published figure: the commit and command that produced it, its date, and a
behaviour fingerprint per method, so ``benchmark_scripts/check_figures.py`` can tell which figures
the code has since moved away from.

The fingerprint of a method is 12 hex digits of a sha256 over what the method does on a fixed tiny
random llama (2 layers, 2 KV heads, fp32) and a fixed 512-token prompt at budget 192, run as
mlx-lm's ``generate_step`` runs it (:mod:`veloxquant_mlx.decode`) with 40 greedy decode steps (so
decode evicts too). Each setting has its own key, so a figure depends only on the settings it measured: ``"nexus"`` is ``prompt_eviction="end"``
(the default), ``"nexus:stream"`` is ``prompt_eviction="stream"`` (128-token chunks) and
``"nexus:ada"`` is ``allocation="ada"`` (or the refusal's text when the method refuses Ada-KV). Hashed: every layer's kept positions per head, the caches' allocated bytes, the
generated tokens and their log-probabilities rounded to 0.01 (coarse on purpose: BLAS libraries sum
in different orders, and a finer grid would flip a digit now and then; a real change moves the
kept set or the tokens). ``"full"`` is mlx-lm's ``KVCache`` on the same run, the reference every
figure compares against. One method and setting per hash, so adding or changing one method leaves
the other methods' figures valid. All of them take a few seconds on a CPU.
"""

from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import json
import os
import subprocess
import warnings
from pathlib import Path

FULL = "full"
_PROMPT_LEN, _BUDGET, _DECODE, _CHUNK, _VOCAB = 512, 192, 40, 128, 128
_REPO = Path(__file__).resolve().parents[1]
_cache: dict = {}  # method -> hash, per process (the code does not change under a running process)


def _tiny_model():
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(1234)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                           vocab_size=_VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def _prompt():
    import numpy as np

    return np.random.default_rng(1234).integers(0, _VOCAB, size=_PROMPT_LEN).tolist()


def _run(model, caches, prefill_step: int) -> list:
    """One generation as mlx-lm's generate_step runs it: what the method kept, allocated and produced."""
    import mlx.core as mx
    import numpy as np

    from veloxquant_mlx.decode import feed_prompt, greedy, step

    x = mx.array(_prompt())
    feed_prompt(model, x, caches, prefill_step)
    y, lp = step(model, x[-1:], caches, logprobs=True)
    toks, lps = greedy(model, caches, y, _DECODE, logprobs=lp, feed_last=True)
    out = [[t, round(float(p.astype(mx.float32)), 2)] for t, p in zip(toks, lps)]
    for c in caches:
        kept = getattr(c, "kept_positions", None)
        pos = np.array(kept()).tolist() if kept is not None else int(c.offset)
        out.append({"kept": pos, "nbytes": int(c.nbytes)})
    return out


# Config fields (not method options) a spec label may pin that change which rows are kept: they go in the
# key beside the method options (``kvzap[floor_alpha=0.2,layers='global']:ada``), so a label pinning them
# is not checked against the method's defaults. kv_bits / recall labels keep their method's key (the
# fingerprint run is fp, without a cold tier).
KEYED_CORE_FIELDS = ("floor_alpha", "max_head_factor")

_SETTINGS = {"end": ({}, 2048), "stream": ({"prompt_eviction": "stream"}, _CHUNK), "ada": ({"allocation": "ada"}, 2048)}


def _config(method: str, setting: str, options: dict | None = None):
    """A KVCacheConfig for one setting (and pinned method options), or the refusal's text (a method
    that refuses Ada-KV)."""
    from veloxquant_mlx.config import KVCacheConfig

    core = {k: v for k, v in (options or {}).items() if k in KEYED_CORE_FIELDS}
    opts = {f"{method}_{k}": v for k, v in (options or {}).items() if k not in KEYED_CORE_FIELDS}
    try:
        return KVCacheConfig(method=method, budget=_BUDGET, seed=0, **opts, **core, **_SETTINGS[setting][0])
    except TypeError as e:  # an option this code no longer has: no such key today
        raise ValueError(str(e)) from e
    except ValueError as e:  # refusing Ada-KV is behaviour too; refusing the others is a bug here
        if setting != "ada":
            raise
        return f"ValueError: {e}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def _split_options(head: str):
    """``"nexus[lam=0.0,prompt_top_k=False]"`` -> ("nexus", {"lam": 0.0, "prompt_top_k": False})."""
    if not head.endswith("]") or "[" not in head:
        return head, {}
    method, _, body = head[:-1].partition("[")
    pairs = (item.partition("=") for item in body.split(",") if item)
    return method, {k: ast.literal_eval(v) for k, _, v in pairs}


def method_fingerprint(key: str) -> str:
    """The behaviour hash of one key: ``"full"`` (mlx-lm's KVCache), ``"<method>"`` (the default
    setting), ``"<method>:stream"`` or ``"<method>:ada"``; ``"<method>[opt=value,...]"`` pins
    method options (a label such as ``nexus-reservoir``), so a figure of such a label stays fresh
    when only the method's defaults move."""
    if key in _cache:
        return _cache[key]
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.builder import KVCacheBuilder

    head, _, setting = key.partition(":")
    setting = setting or "end"
    method, options = _split_options(head)
    if setting not in _SETTINGS:
        raise ValueError(f"unknown fingerprint setting {setting!r} in {key!r}; known: {', '.join(_SETTINGS)}")
    model = _tiny_model()
    user_scorer = None
    with warnings.catch_warnings():  # e.g. kvzip's note that a tiny model has no tokenizer: expected here
        warnings.simplefilter("ignore")
        if method == FULL:
            record = _run(model, make_prompt_cache(model), 2048)
        else:
            cfg = _config(method, setting, options)
            if not isinstance(cfg, str) and cfg.method_class.needs.hidden_states:
                user_scorer = (options or {}).get("scorer")
                cfg = _with_tiny_scorer(model, method, setting, options)
            record = cfg if isinstance(cfg, str) else _run(model, KVCacheBuilder.for_model(model, cfg),
                                                           _SETTINGS[setting][1])
            if user_scorer and not isinstance(record, str):  # the code ran on the tiny model: hash the label's file
                record = {"scorer_sha256": _file_sha(user_scorer), "run": record}
            KVCacheBuilder.uninstall(model)
    _cache[key] = _digest(record)
    return _cache[key]


def _with_tiny_scorer(model, method, setting, options):
    """A learned-scorer method (kvzap) on the fingerprint model: its scorer fitted by the real fit code on
    fixed random windows, in a temporary folder removed when the process exits (deterministic up to the
    BLAS's summation order)."""
    import atexit
    import shutil
    import tempfile

    from veloxquant_mlx.evaluation.kvzap_fit import tiny_scorer

    global _SCORER_DIR
    if _SCORER_DIR is None:
        _SCORER_DIR = tempfile.mkdtemp(prefix="vq-fingerprint-scorer-")
        atexit.register(shutil.rmtree, _SCORER_DIR, ignore_errors=True)
    # The tiny scorer replaces a label's own (fitted for a real model, it cannot run on the tiny one).
    return _config(method, setting, {**(options or {}), "scorer": str(tiny_scorer(model, _SCORER_DIR))})


def _file_sha(path) -> str:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError:
        return "missing"


_SCORER_DIR = None


def all_keys() -> list:
    from veloxquant_mlx.registry import methods

    return [FULL] + [f"{m}{s}" for m in methods() for s in ("", ":stream", ":ada")]


def fingerprint(labels=None, regime: str = "end") -> dict:
    """``{key: hash}`` for figure labels (see :func:`key_of`; default every key of every registered
    method and the full cache)."""
    import mlx.core as mx

    keys = all_keys() if labels is None else {key_of(label, regime) for label in labels}
    with mx.stream(mx.cpu):  # on every machine the CPU's arithmetic: a GPU's rounding moves kvzip's ties
        return {k: method_fingerprint(k) for k in sorted(keys)}


def method_of(label: str) -> str:
    """The registry method behind a figure's label: ``nexus-topk`` / ``nexus_topk`` -> ``nexus``,
    ``snapkv-ada`` / ``snapkv+ada`` -> ``snapkv`` (the longest registered name the label starts
    with); mlx-lm's own caches (``kvcache``, ``rotating``) -> ``full``; anything else as is."""
    from veloxquant_mlx.registry import methods

    if label in (FULL, "kvcache", "rotating") or label.startswith(FULL + "-"):  # full-4bit: QuantizedKVCache
        return FULL
    hits = [m for m in methods() if label == m or label[:len(m) + 1] in (m + "-", m + "_", m + "+")]
    return max(hits, key=len) if hits else label


def key_of(label: str, regime: str = "end", options: dict | None = None) -> str:
    """The fingerprint key a figure's label depends on: ``snapkv-ada`` -> ``snapkv:ada``; a label
    run with ``prompt_eviction="stream"`` (``regime="stream"``) -> ``<method>:stream``; a key
    (``nexus:stream``) is returned as is. ``options``: the method options the label pins
    (``nexus-reservoir`` -> ``nexus[prompt_top_k=False]``). A spec string used as a label
    (``snapkv:allocation=ada``) has the key of its method, options and allocation."""
    if "=" in label.partition(":")[2] and "[" not in label:
        from veloxquant_mlx.config_spec import parse_spec

        m, core, pinned = parse_spec(label)
        pinned = {**pinned, **{k: core[k] for k in KEYED_CORE_FIELDS if k in core}}
        return key_of(m + ("-ada" if core.get("allocation") == "ada" else ""), regime, options or pinned)
    if ":" in label or label.endswith("]"):
        return label
    m = method_of(label)
    if m == FULL:
        return FULL
    if options:
        m += "[" + ",".join(f"{k}={v!r}" for k, v in sorted(options.items())) + "]"
    if label.endswith(("-ada", "+ada")):
        return f"{m}:ada"
    return f"{m}:stream" if regime == "stream" else m


_PINNED: list = []  # this process's commit, once pin_commit ran


def pin_commit() -> str:
    """Fix this process's :func:`commit` to the tree as it is now, so a long run stamps the code it started
    from, not a HEAD that moved while it ran (benchmark scripts pin it before their subcommand starts)."""
    _PINNED.clear()
    _PINNED.append(commit())
    return _PINNED[0]


def commit() -> str:
    """HEAD of this checkout, with ``-dirty`` when tracked files differ from it (``unknown`` outside git);
    the pinned one where :func:`pin_commit` ran. ``$VELOXQUANT_COMMIT`` names it for a copy of the tree
    without its git folder (a lent GPU's)."""
    if _PINNED:
        return _PINNED[0]
    if os.environ.get("VELOXQUANT_COMMIT"):
        return os.environ["VELOXQUANT_COMMIT"] + " (named by VELOXQUANT_COMMIT: a copy of the tree without git)"
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=_REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], cwd=_REPO, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def provenance(command: str, labels=None, regime: str = "end") -> dict:
    """What a figure's JSON carries under ``"provenance"`` (``labels``, ``regime``: see :func:`fingerprint`)."""
    return {"commit": commit(), "command": command,
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "fingerprint": fingerprint(labels, regime)}


def command_line() -> str:
    """The running command as a user would type it (for ``provenance(command_line(), ...)``)."""
    import shlex
    import sys

    argv = list(sys.argv)
    if argv and argv[0].endswith("__main__.py"):
        argv[0] = "-m " + Path(argv[0]).parent.name
    elif argv:
        try:
            argv[0] = str(Path(argv[0]).resolve().relative_to(_REPO))
        except ValueError:
            pass
    return "python " + " ".join(shlex.quote(a) if i else a for i, a in enumerate(argv))


def stale_methods(stored: dict, current: dict | None = None) -> dict:
    """``{method: why}`` for every method of a stored provenance whose hash no longer matches.

    A provenance without a fingerprint, or with a ``stale_reason``, is stale as a whole (key ``"*"``)."""
    if not isinstance(stored, dict):
        return {"*": "no provenance" if stored is None else "provenance without a fingerprint"}
    if stored.get("stale_reason"):
        return {"*": stored["stale_reason"]}
    fp = stored.get("fingerprint") or {}
    if not fp:
        return {"*": "no fingerprint"}
    out = {}
    for m, h in sorted(fp.items()):
        now = (current or {}).get(m) if current is not None else None
        if now is None:
            try:
                now = method_fingerprint(m)
            except ValueError:  # no longer registered, or a key of an older scheme
                out[m] = "no such method or setting today"
                continue
        if now != h:
            out[m] = f"fingerprint {h} -> {now}"
    return out


def resumed(old: dict | None, new: dict) -> dict:
    """The provenance of a file that a run extended (resumable cells): ``new``, stale when the cells
    it kept came from code whose fingerprint differs (or is unknown). Re-run into a fresh file to
    clear it."""
    why = stale_methods(old, new.get("fingerprint")) if old != new else {}
    why = {m: w for m, w in why.items() if m == "*" or m in new.get("fingerprint", {})}
    if why:
        detail = why.get("*") or "; ".join(f"{m}: {w}" for m, w in why.items())
        return {**new, "stale_reason": f"extends cells from other code ({detail})",
                "resumed_from": (old or {}).get("commit")}
    return new
