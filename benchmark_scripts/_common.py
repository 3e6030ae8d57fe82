"""What the benchmark scripts share: the repository's paths, tiny random models, the density -> budget
rule, a figure's provenance, the BLAS preload, timing helpers and the peer packages' venvs.

Scripts run as ``python benchmark_scripts/<name>.py`` and import this file as a sibling module (the
script's folder is on the import path by Python's own rule); the package is installed with
``pip install -e .`` and the repository's lab (reports, provenance; its own distribution, never in the
wheel) with ``pip install -e ./lab`` (README). Only the standard library is imported at the top: the
peer workers of bench_vs_kvpress / bench_vs_origin import this file inside venvs that lack both.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("veloxquant_mlx") and not importlib.util.find_spec("lab"):  # (a peer venv has neither)
    raise SystemExit(f"the benchmark scripts import the lab: pip install -e {ROOT / 'lab'}")
FIGURES = ROOT / "figures"
MIB = 1024 * 1024
BENCH_CACHE = Path(os.environ.get("VELOXQUANT_BENCH_CACHE", Path.home() / ".cache" / "veloxquant-bench")).expanduser()

__all__ = ["ROOT", "FIGURES", "MIB", "BENCH_CACHE", "SCRATCH_ENV", "scratch_dir", "published", "output",
           "add_publish", "route_outputs", "budget", "tiny_llama", "tiny_tokenizer", "stamp",
           "provenance", "command_line", "resumed", "commit", "write_json", "machine", "preload_blas",
           "blas_info", "median", "cpu_timed", "peer_venv", "AllocationRecorder", "total_nbytes",
           "weights_bytes"]



SCRATCH_ENV = "VELOXQUANT_BENCH_OUT"
PUBLISHED = ("figures", "docs", "README.md")  # this checkout's tracked results and the pages that quote them


def scratch_dir() -> Path:
    """Where a run writes what would land in the published tree without ``--publish``:
    ``$VELOXQUANT_BENCH_OUT``, else ``./veloxquant_bench`` (relative to the working directory)."""
    return Path(os.environ.get(SCRATCH_ENV) or "veloxquant_bench")


def published(path) -> bool:
    """True for a path inside this checkout's published figures/ or docs (the tracked results)."""
    p = Path(path).resolve()
    return any(p == (ROOT / d) or (ROOT / d) in p.parents for d in PUBLISHED)


def output(path, publish: bool):
    """Where a run writes ``path``: as given when it is outside the published tree or with ``--publish``;
    else the same relative path under :func:`scratch_dir` (``figures/memory/x.json`` ->
    ``veloxquant_bench/figures/memory/x.json``), said once on stderr. Returns the type it was given."""
    if path is None or publish or not published(path):
        return path
    moved = scratch_dir() / Path(path).resolve().relative_to(ROOT)
    print(f"note: writing {moved} instead of {Path(path).resolve().relative_to(ROOT)} "
          "(the published figures change only with --publish)", file=sys.stderr, flush=True)
    return str(moved) if isinstance(path, str) else moved


def add_publish(parser) -> None:
    parser.add_argument("--publish", action="store_true",
                        help="write the published figures (figures/, docs/) of this checkout; without it their "
                             f"paths go under ./veloxquant_bench/ (or ${SCRATCH_ENV})")


def route_outputs(args, *names):
    """Apply :func:`output` to each named output argument of ``args`` (``args.publish`` decides)."""
    for name in names:
        setattr(args, name, output(getattr(args, name), args.publish))
    return args


def commit() -> str:
    from lab.provenance import commit as head

    return head()


def command_line() -> str:
    from lab.provenance import command_line as line

    return line()


def resumed(old, new) -> dict:
    from lab.provenance import resumed as merge

    return merge(old, new)


def budget(density: float, n_tokens: int, minimum: int = 1) -> int:
    """Rows kept per KV head: the package's one density -> budget rule (``config.budget_for``)."""
    from veloxquant_mlx.config import budget_for

    return budget_for(density, n_tokens, minimum)


def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, hidden: int | None = None,
               vocab: int = 128, seed: int = 0, dtype=None, **args):
    """A random mlx-lm llama (no weights to load; numbers on it measure shapes, not quality).
    ``hidden`` defaults to heads x head_dim; ``args`` override other ``ModelArgs`` fields."""
    import mlx.core as mx
    from mlx_lm.models import llama

    mx.random.seed(seed)
    fields = dict(model_type="llama", hidden_size=hidden or heads * head_dim, num_hidden_layers=layers,
                  intermediate_size=128, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  rms_norm_eps=1e-5, vocab_size=vocab, max_position_embeddings=1 << 17, tie_word_embeddings=False)
    if hidden is not None and hidden != heads * head_dim:
        fields["head_dim"] = head_dim
    model = llama.Model(llama.ModelArgs(**{**fields, **args}))
    if dtype is not None:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def tiny_tokenizer():
    """The evaluation's byte tokenizer (one token per UTF-8 byte), for ``--quick`` runs."""
    from veloxquant_mlx.evaluation.eval_model import ByteTokenizer

    return ByteTokenizer()


def provenance(labels=None, regime: str = "end", command: str | None = None) -> dict:
    """A figure's ``"provenance"``: commit, command (this run's by default), date, behaviour fingerprint
    of every label it holds."""
    from lab.provenance import provenance as record

    return record(command or command_line(), labels, regime)


def stamp(result: dict, labels=None, regime: str = "end", note: str | None = None) -> dict:
    """Set ``result["provenance"]``; a resumed figure keeps the old one when the fingerprints agree."""
    new = provenance(labels, regime)
    old = result.get("provenance")
    result["provenance"] = resumed(old if isinstance(old, dict) else None, new) if old else new
    if note:
        result["provenance"]["note"] = note
    return result


def write_json(path, data, indent: int = 1) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, sort_keys=False) + "\n")
    return path


def machine() -> dict:
    """The machine a figure ran on (timings are only comparable within one run)."""
    import mlx.core as mx

    return {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "mlx": mx.__version__, "device": str(mx.default_device()), "blas": blas_info()}


def preload_blas(num_threads: int | None = 1, skip: bool = False) -> None:
    """Re-exec this script with the OpenBLAS preload (MLX's Linux CPU wheel ships a slow reference BLAS);
    returns at once when it is already preloaded, when none is installed, or when ``skip``."""
    if skip:
        return
    from veloxquant_mlx.platform.blas import reexec_with_openblas

    reexec_with_openblas(num_threads=num_threads)


def blas_info(measure: bool = False) -> dict:
    from veloxquant_mlx.platform.blas import blas_info as info

    return info(measure=measure)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def cpu_timed(fn):
    """(fn(), process seconds, wall seconds): process time is robust to other jobs on a shared machine."""
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.process_time() - c, time.perf_counter() - w


def peer_venv(venv: Path, requirements, marker: str | None = None) -> Path:
    """The python of ``venv`` (made once with ``pip install`` of ``requirements``), for packages that must
    not enter this interpreter (another ``veloxquant_mlx``, torch). ``marker`` (default: the requirements)
    is what the venv was made for; another one re-installs."""
    venv = Path(venv).expanduser()
    py = venv / "bin" / "python"
    ready = venv / ".bench-ready"
    want = " ".join(map(str, requirements)) if marker is None else marker
    if py.exists() and ready.exists() and ready.read_text() == want:
        return py
    print(f"setting up {venv} ({want}) ...", file=sys.stderr, flush=True)
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *map(str, requirements)], check=True)
    ready.write_text(want)
    return py


def run_subcommands(doc: str, subcommands: dict, argv=None) -> int:
    """``script.py NAME [args...]``: run ``subcommands[NAME](args)``; the script's docstring otherwise."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in subcommands:
        print(doc, file=sys.stderr)
        return 2
    from lab.provenance import pin_commit

    pin_commit()  # the figure's commit is the tree this run started from
    return subcommands[argv[0]](argv[1:]) or 0


class AllocationRecorder:
    """Wraps ``update_and_fetch`` of every cache in a list and records the largest total
    ``sum(c.nbytes)`` over the list right after any layer's call (shapes only: no evaluation).
    Eviction caches evict in the query tap right after ``update_and_fetch``, so this sees the
    chunk before it is evicted: the KV part of the peak."""

    def __init__(self, caches):
        self.caches = caches
        self.max_bytes = 0
        for c in caches:
            orig = c.update_and_fetch

            def wrapped(keys, values, _orig=orig):
                out = _orig(keys, values)
                self.max_bytes = max(self.max_bytes, total_nbytes(self.caches))
                return out

            c.update_and_fetch = wrapped

    def close(self):
        for c in self.caches:
            c.__dict__.pop("update_and_fetch", None)


def total_nbytes(caches) -> int:
    return sum(c.nbytes for c in caches if getattr(c, "keys", None) is not None)


def weights_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))
