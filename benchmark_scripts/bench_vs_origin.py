"""Side by side, in one run: our H2O and NestedKV against the origin package (VeloxQuant-MLX 0.94.15).

The origin package has the same import name (``veloxquant_mlx``), so it lives in its own venv
(created on first use under ``~/.cache/veloxquant-bench/origin-venv``: ``python -m venv`` + pip install
of its wheel, with the *same* mlx / mlx-lm versions as this interpreter). This script is both the
driver and the worker: the driver starts one worker process per package and round (ours with this
interpreter, the origin's with the venv's), both with the same OpenBLAS preload, built by
`:func:`veloxquant_mlx.platform.blas.find_blas` / `:func:`veloxquant_mlx.platform.blas.preload_env` (each worker checks
that the library is mapped and measures a 1024x1024 fp32 matmul).

Workload: one llama-shaped attention layer, 8 query and 8 KV heads of head_dim 128, fp32
inputs, B=1, budget 512 (4 sinks), prompts of 2K/4K/8K tokens fed as ``mlx_lm.generate`` feeds them:
the first T-1 tokens in prefill chunks of at most 2048 (``mx.eval`` of the output and the cache after
each), then the prompt's last token as a single-token step (the "end step": ours compresses here
under ``prompt_eviction="end"``), then 32 single-token decode steps. Per step the layer does what an
mlx-lm attention module does: ``cache.make_mask`` (via ``create_attention_mask``), ``update_and_fetch``,
``scaled_dot_product_attention`` (ours through the query tap, as ``KVCacheBuilder`` installs it; the
origin has no tap), then ``mx.eval`` of the output and every array the cache holds. Every chunk's
k/v/q is a fresh array made (untimed) just before its step, so a cache that pins an input shows up in
the memory figures.

Measured per (package, method, prompt length): prefill ms (sum of the chunk steps), end-step ms,
median and mean decode-step ms, and after the 32 decode steps: the cache's own ``nbytes``, the bytes
of the key/value arrays it stores, their dtype, and ``mx.get_active_memory()`` growth (everything the
cache keeps alive, counted once even where two attributes view one buffer). mlx-lm's ``KVCache`` runs
in both workers as the reference (and as a check that the two environments run equally fast).

Each (round, prompt length) runs the two packages' workers back to back, in alternating order; the
JSON holds every round and the medians.

  python benchmark_scripts/bench_vs_origin.py              # 2 rounds, writes figures/origin_compare.json
  python benchmark_scripts/bench_vs_origin.py --rounds 1 --lengths 2048   # quick look
  python benchmark_scripts/bench_vs_origin.py --report-only   # the table of a written JSON
  python benchmark_scripts/bench_vs_origin.py --ours-only --out /tmp/ours.json   # this package alone
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _common import BENCH_CACHE, ROOT as REPO, add_publish, output, peer_venv, provenance

ORIGIN_DIST = "VeloxQuant-MLX"
ORIGIN_VERSION = "0.94.15"
ORIGIN_WHEEL = f"veloxquant_mlx-{ORIGIN_VERSION}-py3-none-any.whl"
CACHE_DIR = BENCH_CACHE

B, H, HQ, D, BUDGET, N_SINK, CHUNK = 1, 8, 8, 128, 512, 4, 2048
SCALE = D ** -0.5
METHODS = ("kvcache", "h2o", "nestedkv")


# ================================================================================================
# worker (runs inside ours' interpreter or the origin's venv; imports whichever veloxquant_mlx it sees)
# ================================================================================================
def _arrays(obj, depth=0):
    """Every mx.array an object holds in its attributes (one level into dicts / lists / tuples)."""
    import mlx.core as mx

    items = vars(obj).values() if depth == 0 else obj
    out = []
    for x in items:
        if isinstance(x, mx.array):
            out.append(x)
        elif depth == 0 and isinstance(x, dict):
            out += _arrays(list(x.values()), 1)
        elif depth == 0 and isinstance(x, (list, tuple)):
            out += _arrays(x, 1)
    return out


def _make_factory(pkg: str, method: str):
    from mlx_lm.models.cache import KVCache

    if method == "kvcache":
        return KVCache
    if pkg == "ours":
        from veloxquant_mlx import EvictionCache, KVCacheConfig

        def make():
            c = EvictionCache(KVCacheConfig(method=method, budget=BUDGET, n_sink=N_SINK))
            c.tap_active = True  # what KVCacheBuilder sets for a model whose attention is tapped
            return c
        return make
    # the origin package: its own config objects (budget 512 and 4 sinks are also its defaults)
    from veloxquant_mlx.cache.base import KVCacheConfig as OConfig

    if method == "h2o":
        from veloxquant_mlx.cache.h2o_cache import H2OKVCache as OH2O
        from veloxquant_mlx.cache.options import H2OOptions

        return lambda: OH2O(OConfig(method="h2o", options=H2OOptions(h2o_budget=BUDGET, h2o_n_sink=N_SINK)))
    from veloxquant_mlx.cache.nestedkv_cache import NestedKVKVCache as ONKV
    from veloxquant_mlx.cache.options import NestedKVOptions

    return lambda: ONKV(OConfig(method="nestedkv",
                                options=NestedKVOptions(nestedkv_budget=BUDGET, nestedkv_n_sink=N_SINK)))


def _attention(pkg: str):
    from mlx_lm.models import base

    if pkg == "ours":
        from veloxquant_mlx.tap import tapped_scaled_dot_product_attention

        return tapped_scaled_dot_product_attention
    return base.scaled_dot_product_attention


def _run_case(pkg, method, T, steps, seed=0):
    """One prompt of T tokens through one fresh cache; returns the timings and the memory held."""
    import mlx.core as mx
    from mlx_lm.models.base import create_attention_mask

    make, attend = _make_factory(pkg, method), _attention(pkg)

    def fresh(S, salt):  # a new k/v/q for one step (the same numbers in both workers: same mlx, keys)
        kk = mx.random.key(seed * 100_003 + salt)
        k1, k2, k3 = mx.random.split(kk, 3)
        k = mx.random.normal((B, H, S, D), key=k1)
        v = mx.random.normal((B, H, S, D), key=k2)
        q = mx.random.normal((B, HQ, S, D), key=k3)
        mx.eval(k, v, q)
        return k, v, q

    class _H:  # create_attention_mask reads only h.shape[1]
        def __init__(self, n):
            self.shape = (B, n)

    def step(c, k, v, q):
        t0 = time.perf_counter()
        mask = create_attention_mask(_H(k.shape[2]), c)
        K, V = c.update_and_fetch(k, v)
        o = attend(q, K, V, cache=c, scale=SCALE, mask=mask)
        mx.eval(o, *_arrays(c))
        return time.perf_counter() - t0

    gc.collect()
    mx.clear_cache()
    base_active = mx.get_active_memory()
    mx.reset_peak_memory()
    c = make()
    chunks, s, salt = [], 0, 0
    while T - s > 1:  # mlx_lm.generate_step: chunks of prefill_step_size over all but the last token
        n = min(CHUNK, T - 1 - s)
        k, v, q = fresh(n, salt)
        chunks.append(step(c, k, v, q))
        del k, v, q
        s, salt = s + n, salt + 1
    k, v, q = fresh(1, salt)
    end = step(c, k, v, q)  # the prompt's last token
    del k, v, q
    dec = []
    for i in range(steps):
        k, v, q = fresh(1, salt + 1 + i)
        dec.append(step(c, k, v, q))
        del k, v, q
    mx.eval(*_arrays(c))
    gc.collect()
    active = mx.get_active_memory() - base_active
    peak = mx.get_peak_memory() - base_active
    keys, values = getattr(c, "keys", None), getattr(c, "values", None)
    kv_bytes = sum(a.nbytes for a in (keys, values) if isinstance(a, mx.array))
    size = int(c.size()) if hasattr(c, "size") else None  # origin NestedKV: mlx-lm's (= offset)
    res = {
        "prefill_ms": sum(chunks) * 1e3,
        "prefill_chunks_ms": [t * 1e3 for t in chunks],
        "end_step_ms": end * 1e3,
        "decode_median_ms": statistics.median(dec) * 1e3,
        "decode_mean_ms": statistics.mean(dec) * 1e3,
        "decode_max_ms": max(dec) * 1e3,
        "nbytes": int(c.nbytes),  # the cache's own report (origin: mlx-lm's KVCache.nbytes = keys + values)
        "kv_array_bytes": int(kv_bytes),
        "kv_dtype": str(keys.dtype) if isinstance(keys, mx.array) else None,
        "bytes_per_element": keys.dtype.size if isinstance(keys, mx.array) else None,
        "kv_array_shape": list(keys.shape) if isinstance(keys, mx.array) else None,
        "held_arrays": len(_arrays(c)),
        "active_bytes": int(active),
        "peak_bytes_over_start": int(peak),
        "rows_stored": int(keys.shape[2]) if isinstance(keys, mx.array) else None,  # allocated rows / head
        "size": size,
        "offset": int(c.offset),
    }
    del c
    gc.collect()
    return res


def _warm_cache_only(pkg, method, T):
    """Feed a prompt of T tokens and a few decode tokens through update_and_fetch only (no attention)."""
    import mlx.core as mx

    c = _make_factory(pkg, method)()
    s = 0
    while T - s > 1:
        n = min(CHUNK, T - 1 - s)
        k = mx.random.normal((B, H, n, D), key=mx.random.key(s))
        mx.eval(c.update_and_fetch(k, k), *_arrays(c))
        s += n
    for i in range(3):
        k = mx.random.normal((B, H, 1, D), key=mx.random.key(T + i))
        mx.eval(c.update_and_fetch(k, k), *_arrays(c))


def _matmul_gflops(n=1024, repeats=3):
    import mlx.core as mx

    a = mx.random.normal((n, n), key=mx.random.key(0))
    b = mx.random.normal((n, n), key=mx.random.key(1))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


def worker_main(args) -> int:
    import importlib.metadata as md

    import mlx.core as mx
    import veloxquant_mlx

    pkg = args.worker
    where = os.path.realpath(veloxquant_mlx.__file__)
    inside_repo = where.startswith(str(REPO) + os.sep)
    if (pkg == "ours") != inside_repo:
        raise SystemExit(f"worker {pkg}: imported veloxquant_mlx from {where} -- wrong package")
    mx.set_default_device(mx.cpu)
    wanted = os.environ.get("BENCH_OPENBLAS", "")
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    info = {
        "package": pkg,
        "veloxquant_mlx_file": where,
        "veloxquant_mlx_version": md.version("veloxquant_mlx" if pkg == "ours" else ORIGIN_DIST),
        "python": sys.executable,
        "mlx": md.version("mlx"), "mlx_lm": md.version("mlx-lm"),
        "openblas_mapped": bool(wanted) and os.path.realpath(wanted) in maps,
        "LD_PRELOAD": os.environ.get("LD_PRELOAD", ""),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS"),
        "matmul_gflops_1024_fp32": _matmul_gflops(),
    }
    if wanted and not info["openblas_mapped"]:
        raise SystemExit(f"worker {pkg}: {wanted} is not mapped: the BLAS preload failed")
    # warm-up: every method once on a short prompt (first-call costs out of the timed runs), and
    # NestedKV's compression at every benchmarked length: MLX's CPU backend JIT-compiles the fused
    # kernels of an mx.compile'd function with a C++ compiler (cached on disk under /tmp/mlx), and
    # ours' scoring embeds the episodic block size (clip(T // 32, 128, 256)), so the first prompt of
    # 8K on a machine compiled new kernels inside the timed end step (8 s once, 0.9 s after).
    for method in args.methods:
        _run_case(pkg, method, 640, 4, seed=7)
    if "nestedkv" in args.methods:
        for T in args.lengths:
            _warm_cache_only(pkg, "nestedkv", T)
    results = {}
    for T in args.lengths:
        for method in args.methods:
            r = _run_case(pkg, method, T, args.steps)
            results[f"{method}/{T}"] = r
            print(f"[{pkg}] {method:8s} T={T:5d}: prefill {r['prefill_ms']:8.1f} ms, end step "
                  f"{r['end_step_ms']:6.1f} ms, decode {r['decode_median_ms']:6.2f} ms (mean "
                  f"{r['decode_mean_ms']:.2f}), nbytes {r['nbytes'] / 2**20:6.2f} MiB, active "
                  f"{r['active_bytes'] / 2**20:6.2f} MiB, {r['kv_dtype']}, rows stored {r['rows_stored']}",
                  file=sys.stderr, flush=True)
    Path(args.out).write_text(json.dumps({"info": info, "results": results}, indent=1))
    return 0


# ================================================================================================
# driver (this interpreter, with our package)
# ================================================================================================
def _origin_wheel(arg) -> Path:
    for cand in ([Path(arg)] if arg else []) + [CACHE_DIR / ORIGIN_WHEEL]:
        if cand.is_file():
            return cand
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", f"{ORIGIN_DIST}=={ORIGIN_VERSION}", "--no-deps",
                    "-d", str(CACHE_DIR)], check=True)
    return CACHE_DIR / ORIGIN_WHEEL


def ensure_origin_venv(venv: Path, wheel_arg) -> Path:
    """The origin's venv (made once): its wheel plus this interpreter's mlx / mlx-lm versions."""
    import importlib.metadata as md

    pins = [f"mlx[cpu]=={md.version('mlx')}", f"mlx-lm=={md.version('mlx-lm')}"]
    want = json.dumps({"origin": ORIGIN_VERSION, "pins": pins})
    ready = venv / ".bench-ready"
    if (venv / "bin" / "python").exists() and ready.exists() and ready.read_text() == want:
        return venv / "bin" / "python"
    return peer_venv(venv, [_origin_wheel(wheel_arg), *pins], marker=want)


def _blas_env():
    from veloxquant_mlx.platform import blas

    lib = blas.find_blas()
    if lib is None:
        print("no OpenBLAS found: both workers run on MLX's reference BLAS", file=sys.stderr)
        env = dict(os.environ)
        env.pop("BENCH_OPENBLAS", None)
        return env, None
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", blas.REEXEC_GUARD_ENV)}
    env = blas.preload_env(lib, base=base)  # OPENBLAS_NUM_THREADS: the user's, else the library default (1)
    env["BENCH_OPENBLAS"] = lib.path
    return env, {"path": lib.path, "source": lib.source, "deps": list(lib.deps),
                 "LD_PRELOAD": env["LD_PRELOAD"], "LD_LIBRARY_PATH": env.get("LD_LIBRARY_PATH", ""),
                 "OPENBLAS_NUM_THREADS": env["OPENBLAS_NUM_THREADS"],
                 "OPENBLAS_CORETYPE": env.get("OPENBLAS_CORETYPE"),
                 "built_by": "veloxquant_mlx.platform.blas.find_blas + preload_env (same env for both workers)"}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _summarize(rounds, lengths, methods, pkgs=("ours", "origin")):
    keys = ("prefill_ms", "end_step_ms", "decode_median_ms", "decode_mean_ms", "nbytes", "kv_array_bytes",
            "active_bytes", "peak_bytes_over_start")
    out = {}
    for pkg in pkgs:
        for method in methods:
            for T in lengths:
                runs = [r[pkg]["results"][f"{method}/{T}"] for r in rounds]
                m = {k: _median([x[k] for x in runs]) for k in keys}
                m["prompt_ms"] = _median([x["prefill_ms"] + x["end_step_ms"] for x in runs])
                for k in ("kv_dtype", "bytes_per_element", "rows_stored", "size", "kv_array_shape"):
                    m[k] = runs[-1][k]
                out[f"{pkg}/{method}/{T}"] = m
    return out


def _targets(s, lengths):
    t = {}
    for T in lengths:
        o, g = s.get(f"ours/nestedkv/{T}"), s.get(f"origin/nestedkv/{T}")
        if o and g:
            for k in ("prefill_ms", "prompt_ms", "decode_median_ms"):
                t[f"nestedkv_{k}_{T}"] = {"ours": o[k], "origin": g[k], "ratio": o[k] / g[k], "met": o[k] <= g[k]}
        for method in ("h2o", "nestedkv"):
            o, g = s.get(f"ours/{method}/{T}"), s.get(f"origin/{method}/{T}")
            if o and g:
                t[f"{method}_active_bytes_{T}"] = {"ours": o["active_bytes"], "origin": g["active_bytes"],
                                                   "ratio": o["active_bytes"] / g["active_bytes"],
                                                   "met": o["active_bytes"] <= g["active_bytes"]}
    return t


def markdown(s, lengths, methods, pkgs=("ours", "origin")):
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    lines = ["| method | prompt | package | prefill ms | end step ms | decode ms (median / mean) "
             "| active KV MiB | nbytes MiB | dtype (B/elem) | rows stored/head |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for method in methods:
        for T in lengths:
            for pkg in pkgs:
                m = s[f"{pkg}/{method}/{T}"]
                lines.append(f"| {method} | {T // 1024}K | {pkg} | {m['prefill_ms']:.0f} | {m['end_step_ms']:.1f} | "
                             f"{m['decode_median_ms']:.2f} / {m['decode_mean_ms']:.2f} | {mib(m['active_bytes'])} | "
                             f"{mib(m['nbytes'])} | {m['kv_dtype'].replace('mlx.core.', '')} ({m['bytes_per_element']}) | "
                             f"{m['rows_stored']} |")
    return "\n".join(lines)


def driver_main(args) -> int:
    pkgs = ("ours",) if args.ours_only else ("ours", "origin")
    pythons = {"ours": sys.executable}
    if not args.ours_only:
        pythons["origin"] = str(ensure_origin_venv(Path(args.venv).expanduser(), args.origin_wheel))
    env, blas_rec = _blas_env()
    tmp = CACHE_DIR / "runs"
    tmp.mkdir(parents=True, exist_ok=True)
    rounds = []
    t_start = time.time()
    for r in range(args.rounds):
        rec = {"order": [], **{pkg: {"info": None, "results": {}} for pkg in pkgs}}
        for li, T in enumerate(args.lengths):
            # one worker per (round, length, package), the two packages back to back, order alternating
            order = pkgs if (r + li) % 2 == 0 else pkgs[::-1]
            rec["order"].append([T, *order])
            for pkg in order:
                out = tmp / f"round{r}-{T}-{pkg}.json"
                cmd = [pythons[pkg], str(Path(__file__).resolve()), "--worker", pkg, "--out", str(out),
                       "--steps", str(args.steps), "--lengths", str(T), "--methods", *args.methods]
                # cwd outside the repo: the origin worker must not import our package from the working directory; ours'
                # worker imports this checkout (PYTHONPATH), not whatever editable install pip points at
                wenv = {k: v for k, v in env.items() if k != "PYTHONPATH"}
                if pkg == "ours":
                    wenv["PYTHONPATH"] = str(REPO)
                subprocess.run(cmd, env=wenv, cwd=str(tmp), check=True)
                got = json.loads(out.read_text())
                rec[pkg]["info"] = got["info"]
                rec[pkg]["results"].update(got["results"])
        rounds.append(rec)
        print(f"round {r + 1}/{args.rounds} done ({time.time() - t_start:.0f} s)", file=sys.stderr, flush=True)
    s = _summarize(rounds, args.lengths, args.methods, pkgs)
    import mlx.core as mx

    res = {
        "what": "one llama-shaped attention layer, ours vs the origin package, same run; see the script's docstring",
        "shapes": {"B": B, "H_q": HQ, "H_kv": H, "head_dim": D, "input_dtype": "float32", "budget": BUDGET,
                   "n_sink": N_SINK, "prefill_chunk": CHUNK, "decode_steps": args.steps,
                   "prompt_lengths": args.lengths},
        "configs": {"ours": f"KVCacheConfig(method, budget={BUDGET}, n_sink={N_SINK}) defaults "
                            "(prompt_eviction='end'), tap_active=True, attention through the query tap",
                    "origin": f"{ORIGIN_DIST} {ORIGIN_VERSION} KVCacheConfig(method, options=H2OOptions(h2o_budget="
                              f"{BUDGET}, h2o_n_sink={N_SINK}) / NestedKVOptions(nestedkv_budget={BUDGET}, "
                              f"nestedkv_n_sink={N_SINK})), its other defaults; plain mlx-lm attention"},
        "memory_note": "active_bytes = mx.get_active_memory() growth from before the cache was made to after the "
                       "32 decode steps (inputs freed): everything the cache keeps alive. nbytes = the cache's own "
                       "report (the origin's is mlx-lm's KVCache.nbytes: its keys + values arrays only). "
                       "kv_array_bytes = the .keys/.values arrays' bytes.",
        "timing_note": "prefill_ms = sum of the chunk steps over the first T-1 tokens; end_step_ms = the prompt's "
                       "last token (ours compresses here); prompt_ms = prefill + end step; decode = 32 single-token "
                       "steps after it. Every step includes mx.eval of the output and all arrays the cache holds.",
        "blas": blas_rec,
        "workers": {pkg: [r[pkg]["info"] for r in rounds] for pkg in pkgs},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "mlx": mx.__version__,
                    "note": "2 shared CPU cores (other jobs running): expect noise of tens of percent"},
        "methods": list(args.methods),
        "rounds": len(rounds), "round_orders": [r["order"] for r in rounds],
        "medians": s,
        "targets": {} if args.ours_only else _targets(s, args.lengths),
        "raw": [{pkg: r[pkg]["results"] for pkg in pkgs} for r in rounds],
        "wall_s": time.time() - t_start,
    }
    res["provenance"] = provenance(["full", *args.methods])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(markdown(s, args.lengths, args.methods, pkgs))
    for k, v in res["targets"].items():
        print(f"{k}: ours {v['ours']:.4g} vs origin {v['origin']:.4g} ({v['ratio']:.2f}x) {'met' if v['met'] else 'MISSED'}")
    print("wrote", args.out)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", choices=("ours", "origin"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    ap.add_argument("--venv", default=str(CACHE_DIR / "origin-venv"))
    ap.add_argument("--origin-wheel", default=None, help=f"a local {ORIGIN_WHEEL} (else pip download)")
    ap.add_argument("--out", default=str(REPO / "figures" / "origin_compare.json"))
    ap.add_argument("--ours-only", action="store_true",
                    help="run this package's worker alone (no origin venv): its methods against mlx-lm's KVCache")
    ap.add_argument("--report-only", action="store_true", help="measure nothing: print --out's table")
    add_publish(ap)
    args = ap.parse_args(argv)
    if args.worker:
        return worker_main(args)
    if not args.report_only:
        args.out = output(args.out, args.publish)
        return driver_main(args)
    res = json.loads(Path(args.out).read_text())
    pkgs = tuple(res.get("workers", {"ours": 0, "origin": 0}))
    print(markdown(res["medians"], res["shapes"]["prompt_lengths"], res.get("methods", list(METHODS)), pkgs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
