"""The paged prompt (``prompt_eviction="offload"``) against ``"end"``, through mlx-lm's own loop.

* ``identity``: per needle prompt and method, the first greedy tokens and the prompt's last log-probabilities
  under ``"end"`` and ``"offload"`` (fresh caches each, ``mlx_lm.generate.generate_step``), and whether
  each answered the pass key. Same answers by construction: this counts how often the tokens agree.
* ``peak``: ``mx.get_peak_memory()`` minus the weights while a prompt of each length runs at a fixed
  budget and prefill step, for offload caches, ``"end"`` and mlx-lm's ``KVCache`` (up to ``--full-max``),
  each (cache, length) in a fresh process (``peak-cell``), as a user's own process would run it.
* ``cost``: the prefill's process time of ``"offload"`` over ``"end"``, paired per round, orders
  alternated, and the bytes read back from the page files.
* ``followup``: the follow-up task (2 facts, 2 turns on the same caches): ``"offload"``, ``"end"`` and the
  full cache; a later turn re-selects from every row under ``"offload"``. With ``--recall``: each method under
  ``"end"`` with that cold tier instead (``recall=``), its prompts paired with the offload file's by index.

Results go to ``--out`` (default: figures/offload/<subcommand>_<model>.json, followup_recall_<model>.json with
``--recall``; written there only with ``--publish``, else under ./veloxquant_bench/), resumed cell by cell.

    python benchmark_scripts/bench_offload.py identity --contexts 2048 4096 --prompts 12 [--rounds 2]
    python benchmark_scripts/bench_offload.py peak --lengths 4096 8192 16384 32768 --budget 1024 --step 512
    python benchmark_scripts/bench_offload.py peak --model tiny --lengths 8192 32768 131072
    python benchmark_scripts/bench_offload.py cost --length 8192 --rounds 3
    python benchmark_scripts/bench_offload.py followup --model bundled --prompts 16
    python benchmark_scripts/bench_offload.py followup --model gemma3-270m --prompts 16 --methods snapkv nexus --recall disk
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import _common
from _common import FIGURES, MIB, add_publish, output, preload_blas, run_subcommands, weights_bytes, write_json

DEFAULT_METHODS = ["snapkv", "pyramidkv", "h2o", "nexus", "nestedkv", "morphkv", "streaming", "random", "kvzap"]


def _out(args, name: str):
    return output(args.out or FIGURES / "offload" / f"{name}_{args.model}.json", args.publish)


def _common_args(p, name):
    p.add_argument("--model", default="bundled",
                   help="bundled | gemma3-270m | qwen2.5-coder-1.5b | tiny (peak) | twin:FOLDER (peak, cost)")
    p.add_argument("--out", default=None, help=f"results file (default: figures/offload/{name}_<model>.json)")
    add_publish(p)
    p.add_argument("--step", type=int, default=512, help="prefill_step_size")


def _load(path) -> dict:
    p = Path(path)
    text = p.read_text() if p.exists() else ""
    return json.loads(text) if text.strip() else {}


def _refuse_other_setting(path, held: dict, rows: str, setting: dict, holds: str = "holds") -> None:
    """Stop the run when ``held`` (the file at ``path``) has ``rows`` of a setting other than ``setting``."""
    if held.get(rows) and held.get("setting") != setting:
        raise SystemExit(f"{path} {holds} {len(held[rows])} {rows} of another setting ({held.get('setting')}); "
                         f"this run's is {setting}: give it another --out")


def _resume(path, setting: dict, rows: str, **fresh) -> dict:
    """The results at ``path`` to extend, or a new file's ``{"setting": setting, rows: [], **fresh}``; a file
    holding another setting's rows is refused rather than overwritten."""
    res = _load(path)
    _refuse_other_setting(path, res, rows, setting)
    return res if res.get(rows) else {"setting": setting, rows: [], **fresh}


def _caches(model, spec: str, budget: int, policy: str, tokenizer=None, **kw):
    """Fresh caches; ``tokenizer``: KVzip's repeat prompt (its reconstruction pass), as a user's for_model gets it."""
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig

    if spec == "kvcache":
        return make_prompt_cache(model)
    return KVCacheBuilder.for_model(model, KVCacheConfig.parse(spec, budget=budget, prompt_eviction=policy, **kw),
                                    tokenizer=tokenizer)


def _generate(model, tokens, caches, step: int, new_tokens: int):
    """(greedy tokens, the first step's log-probabilities) through mlx_lm's generate_step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    toks, first = [], None
    for tok, lp in generate_step(mx.array(tokens), model, max_tokens=new_tokens, prompt_cache=caches,
                                 prefill_step_size=step):
        toks.append(int(tok))
        if first is None:
            first = lp
    return toks, first


_STAMPED: set = set()
def _stamp_and_write(path, res, labels, regime, key):
    """Write ``res``, its provenance stamped once per run (fingerprints take seconds). Runs of one subcommand
    may extend one file side by side (other contexts, other lengths): under a lock, the file's rows that this
    run does not hold yet (``key``: the fields naming a row of the file's one list) are kept, so no run's rows
    overwrite another's; a file that a run of another setting has written since is refused, never written over."""
    import fcntl

    if str(path) not in _STAMPED:
        _common.stamp(res, labels, regime=regime)
        _STAMPED.add(str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as held:  # the results file is its own lock
        fcntl.flock(held, fcntl.LOCK_EX)
        disk = _load(path)
        name = next(n for n in ("cells", "rows", "prompts") if n in res)
        # another run's rows, written since _resume read the file
        _refuse_other_setting(path, disk, name, res.get("setting"), holds="now holds")
        mine = {tuple(r[k] for k in key) for r in res[name]}
        res[name] += [r for r in disk.get(name, []) if tuple(r[k] for k in key) not in mine]
        write_json(path, res)


# -- identity -------------------------------------------------------------------------------------------
def needle_prompt(i: int, per_round: int):
    """Prompt ``i`` of every context, whatever the run's size: (i, haystack, depth, key). Round r = i // per_round
    puts its needles at depths (j + 0.5 / (r + 1)) / per_round; keys are draw i of one fixed sequence."""
    r, j = divmod(i, per_round)
    rng = random.Random(0)
    key = [str(rng.randrange(10000, 99999)) for _ in range(i + 1)][-1]
    return i, ("grass", "text")[i % 2], (j + 0.5 / (r + 1)) / per_round, key


def identity(argv) -> int:
    p = argparse.ArgumentParser(description="offload vs end: tokens, log-probabilities, answers")
    _common_args(p, "identity")
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--prompts", type=int, default=12, help="needle prompts per context and round (depths on a grid)")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of --prompts prompts; round r shifts the depth grid (r=0: the cell centres)")
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS)
    args = p.parse_args(argv)
    preload_blas()
    import mlx.core as mx

    from veloxquant_mlx.config import budget_for
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(args.model)
    path = _out(args, "identity")
    setting = {"model": args.model, "density": args.density, "prefill_step_size": args.step,
               "new_tokens": args.new_tokens}
    res = _resume(path, setting, "cells")
    done = {(c["context"], c["prompt"], c["method"]) for c in res["cells"]}
    prompts = [(ctx, *needle_prompt(i, args.prompts)) for ctx in args.contexts
               for i in range(args.prompts * args.rounds)]
    for ctx, i, hay, depth, key in prompts:
        held = {(c["depth"], c["key"]) for c in res["cells"] if (c["context"], c["prompt"]) == (ctx, i)}
        if held - {(round(depth, 3), key)}:
            raise SystemExit(f"{path} holds another prompt #{i} at {ctx} tokens ({held}): was it run with another "
                             f"--prompts than {args.prompts}? Use that, or another --out")
        tokens, _ = make_prompt(tokenizer, hay, ctx, depth, key)
        budget = budget_for(args.density, len(tokens))
        for method in args.methods:
            if (ctx, i, method) in done:
                continue
            out = {}
            for policy in (("end", "offload") if i % 2 == 0 else ("offload", "end")):
                gc.collect()
                toks, lp = _generate(model, tokens, _caches(model, method, budget, policy, tokenizer), args.step,
                                     args.new_tokens)
                out[policy] = (toks, lp)
            (te, le), (to, lo) = out["end"], out["offload"]
            cell = {"context": ctx, "prompt": i, "haystack": hay, "depth": round(depth, 3), "key": key,
                    "method": method, "budget": budget, "end_tokens": te, "offload_tokens": to,
                    "same_tokens": te == to, "max_abs_logprob_diff": float(mx.abs(le - lo).max()),
                    "end_answered": key in tokenizer.decode(te), "offload_answered": key in tokenizer.decode(to)}
            res["cells"].append(cell)
            print(f"{ctx} #{i:2d} {method:>10}: same {cell['same_tokens']}  |dlogp| {cell['max_abs_logprob_diff']:.2e}"
                  f"  answered end {cell['end_answered']} offload {cell['offload_answered']}", flush=True)
            _stamp_and_write(path, res, sorted(set(args.methods)), "offload", ("context", "prompt", "method"))
    return 0


# -- peak -------------------------------------------------------------------------------------------------
def _tiny(args):
    """A random llama of real width (64-dim heads, 8 query / 2 KV heads, 4 layers): shapes, not quality."""
    return _common.tiny_llama(layers=4, heads=8, kv_heads=2, head_dim=64, vocab=1024, seed=0), None


def _peak_args(argv, one: bool):
    p = argparse.ArgumentParser(description="one cell of peak, in a process of its own" if one else
                                "peak memory during a growing prompt, each cell in a fresh process")
    _common_args(p, "peak")
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--block", type=int, default=1024, help="page_block")
    p.add_argument("--new-tokens", type=int, default=4)
    if one:
        p.add_argument("--cache", required=True)
        p.add_argument("--length", type=int, required=True)
    else:
        p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
        p.add_argument("--caches", nargs="+", default=["snapkv:offload", "h2o:offload", "kvzap:offload",
                                                       "snapkv:end", "kvcache"],
                       help="METHOD:POLICY or kvcache")
        p.add_argument("--full-max", type=int, default=16384, help="longest prompt for caches that hold it whole")
    return p.parse_args(argv)


def _load_timed_model(name):
    """(model, tokenizer) for peak and cost: also ``tiny`` and a random-weight twin (``twin:FOLDER``, a GPU's
    stand-in for a model whose weights cannot travel: costs only)."""
    if name == "tiny":
        return _tiny(None)
    from veloxquant_mlx.evaluation.results import load_eval_model

    return load_eval_model(name)[:2]


def peak_cell(argv) -> int:
    """One (cache, length) of ``peak`` in this process, which has run nothing else: the peak a user's own
    process would see. Prints the row as the last line of its output."""
    args = _peak_args(argv, one=True)
    preload_blas()
    import mlx.core as mx

    model, tokenizer = _load_timed_model(args.model)
    n = args.length
    if tokenizer is None:
        tokens = mx.random.randint(0, 1024, (n,), key=mx.random.key(n)).tolist()
    else:
        from veloxquant_mlx.evaluation.tasks.filler import long_filler

        ids = tokenizer.encode(" ".join(long_filler(seed=0)))
        while len(ids) < n:
            ids = ids + ids
        tokens = ids[:n]
    method, _, policy = args.cache.partition(":")
    kw = {"page_block": args.block} if policy == "offload" else {}
    caches = _caches(model, method, args.budget, policy or "end", tokenizer, **kw)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    _generate(model, tokens, caches, args.step, args.new_tokens)
    row = {"cache": args.cache, "prompt_tokens": n,
           "peak_over_weights_bytes": mx.get_peak_memory() - weights_bytes(model),
           "wall_s": round(time.perf_counter() - t0, 1), "commit": _common.commit()}
    reports = [c.byte_report() for c in caches if hasattr(c, "byte_report")]
    if reports and "page_disk_bytes" in reports[0]:
        row.update({k: sum(r[k] for r in reports) for k in ("page_disk_bytes", "page_resident_bytes",
                                                            "page_bytes_read")})
    row["kv_allocated_after_bytes"] = sum(c.nbytes for c in caches if getattr(c, "keys", None) is not None)
    print(json.dumps(row), flush=True)
    return 0


def peak(argv) -> int:
    import subprocess

    args = _peak_args(argv, one=False)
    model, _ = _load_timed_model(args.model)
    path = _out(args, "peak")
    setting = {"model": args.model, "budget": args.budget, "prefill_step_size": args.step, "page_block": args.block,
               "new_tokens": args.new_tokens, "weights_bytes": weights_bytes(model), "process": "one per cell"}
    del model
    res = _resume(path, setting, "rows")
    done = {(r["cache"], r["prompt_tokens"]) for r in res["rows"]}
    for n in args.lengths:
        for label in args.caches:
            method, _, policy = label.partition(":")
            if (label, n) in done or ((policy == "end" or method == "kvcache") and n > args.full_max):
                continue
            cmd = [sys.executable, __file__, "peak-cell", "--model", args.model, "--budget", str(args.budget),
                   "--step", str(args.step), "--block", str(args.block), "--new-tokens", str(args.new_tokens),
                   "--cache", label, "--length", str(n)]
            run = subprocess.run(cmd, capture_output=True, text=True)
            if run.returncode != 0:
                print(f"{label:>16} {n:>7}: failed\n{run.stderr[-2000:]}", flush=True)
                continue
            row = json.loads(run.stdout.strip().splitlines()[-1])
            res["rows"].append(row)
            print(f"{label:>16} {n:>7}: peak - weights {row['peak_over_weights_bytes'] / MIB:8.1f} MiB"
                  + (f", pages {row['page_disk_bytes'] / MIB:.0f} MiB on disk, "
                     f"{row['page_resident_bytes'] / MIB:.2f} MiB per-row state" if "page_disk_bytes" in row else "")
                  + f" ({row['wall_s']:.0f} s)", flush=True)
            _stamp_and_write(path, res, sorted({lb.partition(":")[0] for lb in args.caches} - {"kvcache"}), "offload",
                             ("cache", "prompt_tokens"))
    return 0


# -- cost -------------------------------------------------------------------------------------------------
def cost(argv) -> int:
    p = argparse.ArgumentParser(description="prefill time, offload over end, paired per round")
    _common_args(p, "cost")
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--budget", type=int, default=None, help="default: 20 %% of the prompt")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["snapkv", "h2o", "kvzap"])
    args = p.parse_args(argv)
    preload_blas()
    from veloxquant_mlx.config import budget_for
    from veloxquant_mlx.evaluation.tasks.filler import long_filler

    model, tokenizer = _load_timed_model(args.model)
    ids = tokenizer.encode(" ".join(long_filler(seed=0)))
    while len(ids) < args.length:
        ids = ids + ids
    tokens = ids[:args.length]
    budget = args.budget or budget_for(0.2, len(tokens))
    path = _out(args, "cost")
    setting = {"model": args.model, "length": args.length, "budget": budget, "prefill_step_size": args.step}
    res = _resume(path, setting, "rows", machine=_common.machine())
    done = {(r["method"], r["round"]) for r in res["rows"]}
    warm = _caches(model, args.methods[0], budget, "offload", tokenizer)
    _generate(model, tokens[:1024], warm, args.step, 1)  # warm-up
    for rnd in range(args.rounds):
        for method in args.methods:
            if (method, rnd) in done:
                continue
            t = {}
            for policy in (("end", "offload") if rnd % 2 == 0 else ("offload", "end")):
                gc.collect()
                caches = _caches(model, method, budget, policy, tokenizer)
                (_, _), cpu, wall = _common.cpu_timed(lambda: _generate(model, tokens, caches, args.step, 1))
                t[policy] = (cpu, wall, sum(c.byte_report().get("page_bytes_read", 0) for c in caches))
                del caches
            row = {"method": method, "round": rnd, "end_cpu_s": round(t["end"][0], 2),
                   "offload_cpu_s": round(t["offload"][0], 2), "cpu_ratio": round(t["offload"][0] / t["end"][0], 3),
                   "wall_ratio": round(t["offload"][1] / t["end"][1], 3), "page_bytes_read": t["offload"][2]}
            res["rows"].append(row)
            print(f"round {rnd} {method:>8}: offload / end process time {row['cpu_ratio']:.3f} (wall "
                  f"{row['wall_ratio']:.3f}), {row['page_bytes_read'] / MIB:.0f} MiB read back", flush=True)
            _stamp_and_write(path, res, sorted(args.methods), "offload", ("method", "round"))
    return 0


# -- followup ---------------------------------------------------------------------------------------------
def followup(argv) -> int:
    p = argparse.ArgumentParser(description="the follow-up task under offload, end and the full cache")
    _common_args(p, "followup")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--methods", nargs="+", default=["snapkv", "kvzap", "h2o"])
    p.add_argument("--recall", choices=("memory", "disk"), default=None,
                   help="instead of end and offload: each method under end with this cold tier (recall=), beside the "
                        "full cache; its prompts pair with the same model's offload file by index")
    args = p.parse_args(argv)
    preload_blas()
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.config import budget_for
    from veloxquant_mlx.evaluation.task_run import run_prompt
    from veloxquant_mlx.evaluation.tasks import build
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model(args.model)
    eos = list(getattr(tokenizer, "eos_token_ids", []) or [])
    path = _out(args, "followup_recall" if args.recall else "followup")
    setting = {"model": args.model, "length": args.length, "density": args.density, "facts": 2,
               **({"recall": args.recall} if args.recall else {})}
    res = _resume(path, setting, "prompts")
    done = {r["index"] for r in res["prompts"]}
    for index in range(args.prompts):
        if index in done:
            continue
        inst, tokens = build(tokenizer, "followup", args.length, index, 0, 2)
        budget = budget_for(args.density, len(tokens))
        named = {"full": (make_prompt_cache(model), True)}
        for m in args.methods:
            if args.recall:
                named[f"{m}:recall-{args.recall}"] = (_caches(model, m, budget, "end", tokenizer, recall=args.recall),
                                                      True)
                continue
            for policy in ("end", "offload"):
                named[f"{m}:{policy}"] = (_caches(model, m, budget, policy, tokenizer), True)
        cells = run_prompt(model, tokenizer, inst, tokens, named, shared=False, eos_ids=eos)
        rec = {"index": index, "prompt_tokens": len(tokens), "budget": budget,
               "correct": {n: [bool(t.get("correct")) for t in c.get("turns", [])] for n, c in cells.items()},
               "errors": {n: c["error"] for n, c in cells.items() if "error" in c}}
        res["prompts"].append(rec)
        print(f"#{index:2d}: " + "  ".join(f"{n} {''.join('x' if ok else '.' for ok in v)}"
                                           for n, v in rec["correct"].items()), flush=True)
        _stamp_and_write(path, res, sorted(args.methods), "offload", ("index",))
    return 0


SUBCOMMANDS = {"identity": identity, "peak": peak, "peak-cell": peak_cell, "cost": cost, "followup": followup}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
