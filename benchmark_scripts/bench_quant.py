"""Quantized kept rows (issue 22): allocated KV through plain ``mlx_lm.generate`` and decode speed.

Part ``memory``: the bundled SmolLM2-135M (30 layers, 3 KV heads of 64, float32) through
``mlx_lm.generate.generate_step`` with its defaults (prefill_step_size 2048, greedy), a prose prompt of
2K or 4K tokens, 16 new tokens, budget = 20 % of the prompt, ``prompt_eviction="end"``. Per run:
``kv_allocated_bytes`` = sum of ``c.nbytes`` after generation (packed words + scales + biases for
quantized rows, positions, per-row state, query window: everything held), the kept rows' bytes and the
K/V of every token in fp32 (``veloxquant_mlx.cli.kv_report``). References: mlx-lm's ``KVCache`` and its
``QuantizedKVCache`` (8 / 4 bits, no eviction). Labels: ``<method>[-8bit|-4bit]``, ``nestedkv-nocap``
(the spec's per-head bound, ``max_head_factor=None``), ``kvcache``, ``kvcache-4bit``.

Part ``speed``: decode tokens/s of a method with fp rows against the same method with 4-bit rows at
the same budget (``stream_generate``'s generation_tps), prompt 1K tokens, 20 %, 64 new tokens,
rounds alternating the order (fp first, then 4-bit first, ...). Only ratios measured side by side
are meant to be quoted (a shared CPU).

    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_quant.py --part memory   # OpenBLAS preloaded
    python -m veloxquant_mlx.platform.blas benchmark_scripts/bench_quant.py --part speed

Results: figures/memory/quant.json, figures/eval/quant_speed.json (resumable: finished runs are kept),
each with the project's provenance (commit, command, date, behaviour fingerprint of every label in
the file; stale when a run extends rows of other code) and each run's machine and BLAS under
``runs_provenance``.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MIB = 2**20


def run_info() -> dict:
    from veloxquant_mlx.platform.blas import blas_info

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "veloxquant_mlx"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    try:
        blas = blas_info()
    except Exception as e:  # reported, never fatal
        blas = {"error": str(e)}
    return {"commit": commit, "package_dirty": dirty, "command": " ".join(sys.argv),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": platform.platform(),
            "processor": platform.processor(), "blas": blas}


def stamp(res: dict, labels):
    """The figure's provenance over ``labels`` (every label it holds) plus this run's machine record."""
    from veloxquant_mlx.evaluation.provenance import command_line, provenance, resumed

    new = provenance(command_line(), sorted({parse_label(lb)[0] for lb in labels}))
    old = res.get("provenance")
    res["provenance"] = new if old is None else resumed(old if isinstance(old, dict) else None, new)
    res.setdefault("runs_provenance", []).append(run_info())


def parse_label(label: str):
    """label -> (method or 'kvcache', kwargs for KVCacheConfig)."""
    extra = {}
    for suffix, kw in (("-4bit", {"kv_bits": 4, "kv_group_size": 64}), ("-8bit", {"kv_bits": 8}), ("-nocap", {"max_head_factor": None})):
        if label.endswith(suffix):
            label, extra = label[:-len(suffix)], {**kw, **extra}
    return label, extra


def make_caches(model, label: str, budget: int):
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.caches.quant import model_caches

    method, extra = parse_label(label)
    if method == "kvcache":
        return model_caches(model, extra.get("kv_bits"), extra.get("kv_group_size", 64))
    return KVCacheBuilder.for_model(model, KVCacheConfig(method=method, budget=budget, **extra))


def measure_memory(model, prompt, label, budget, max_tokens) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from veloxquant_mlx.caches.accounting import kv_report

    gc.collect()
    mx.clear_cache()
    caches = make_caches(model, label, budget)
    t0 = time.perf_counter()
    toks = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=caches)]
    wall = time.perf_counter() - t0
    rep = kv_report(caches)
    out = {"label": label, "prompt_tokens": len(prompt), "budget": budget, "new_tokens": len(toks),
           "kv_allocated_bytes": rep["allocated_bytes"], "kv_kept_bytes": rep["kept_bytes"],
           "kv_full_bytes": rep["full_bytes"], "wall_s": round(wall, 1), "tokens_head": toks[:8]}
    if hasattr(caches[0], "tokens_kept"):
        out["tokens_kept_mean"] = sum(c.tokens_kept for c in caches) / len(caches)
        out["evictions"] = sum(c.evictions for c in caches)
    del caches
    gc.collect()
    return out


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"runs": {}}


def save(path: Path, res: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1))
    tmp.replace(path)


def derive(res: dict):
    """allocated / KVCache's at the same context, and allocated / the same method's fp rows."""
    runs = res["runs"]
    for key, r in runs.items():
        n = r["prompt_tokens"]
        base = runs.get(f"{n}|kvcache")
        if base:
            r["allocated_vs_kvcache"] = r["kv_allocated_bytes"] / base["kv_allocated_bytes"]
        fp = runs.get(f"{n}|{parse_label(r['label'])[0]}")
        if fp and fp is not r:
            r["allocated_vs_fp_rows"] = r["kv_allocated_bytes"] / fp["kv_allocated_bytes"]
        r["allocated_vs_kept"] = r["kv_allocated_bytes"] / r["kv_kept_bytes"] if r["kv_kept_bytes"] else None


def run_memory(args):
    from veloxquant_mlx.evaluation.speed import _prompt
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    path = Path(args.out_memory)
    res = load(path)
    res.update({"what": "allocated KV through plain mlx_lm.generate (generate_step defaults), 20 % budget, "
                        "prompt_eviction='end'", "model": "SmolLM2-135M-Instruct (bundled GGUF, float32)",
                "density": args.density, "max_tokens": args.max_tokens})
    stamp(res, [k.split("|")[1] for k in res["runs"]] + args.labels)
    for n in args.contexts:
        prompt = _prompt(tokenizer, n)
        budget = max(int(round(args.density * n)), 1)
        for label in args.labels:
            key = f"{n}|{label}"
            if key in res["runs"]:
                continue
            r = measure_memory(model, prompt, label, budget, args.max_tokens)
            r["commit"] = res["runs_provenance"][-1]["commit"]
            res["runs"][key] = r
            derive(res)
            save(path, res)
            print(f"{key}: allocated {r['kv_allocated_bytes'] / MIB:8.2f} MiB  vs KVCache "
                  f"{r.get('allocated_vs_kvcache', float('nan')):.3f}  vs fp rows "
                  f"{r.get('allocated_vs_fp_rows', float('nan')):.3f}  ({r['wall_s']} s)", flush=True)


def run_speed(args):
    import mlx.core as mx
    from mlx_lm.generate import stream_generate

    from veloxquant_mlx.evaluation.speed import _prompt
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    path = Path(args.out_speed)
    res = load(path)
    res.update({"what": "decode tokens/s, fp rows vs 4-bit rows at the same budget (stream_generate "
                        "generation_tps), alternating order per round; quote ratios only",
                "model": "SmolLM2-135M-Instruct (bundled GGUF, float32)", "context": args.speed_context,
                "density": args.density, "decode_tokens": args.decode_tokens})
    methods = [k.split("|")[0] for k in res["runs"]] + args.speed_methods
    stamp(res, methods + [m + "-4bit" for m in methods])
    prompt = _prompt(tokenizer, args.speed_context)
    budget = max(int(round(args.density * args.speed_context)), 1)
    for method in args.speed_methods:
        pair = [method, method + "-4bit"]
        for rnd in range(args.rounds):
            key = f"{method}|round{rnd}"
            if key in res["runs"]:
                continue
            row = {}
            for label in (pair if rnd % 2 == 0 else pair[::-1]):
                caches = make_caches(model, label, budget)
                last = None
                for last in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=args.decode_tokens,
                                            prompt_cache=caches):
                    pass
                row[label] = {"generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps,
                              "tokens": last.generation_tokens}
                del caches
                gc.collect()
            row["decode_ratio_4bit_over_fp"] = row[pair[1]]["generation_tps"] / row[pair[0]]["generation_tps"]
            row["prefill_ratio_4bit_over_fp"] = row[pair[1]]["prompt_tps"] / row[pair[0]]["prompt_tps"]
            row["order"] = pair if rnd % 2 == 0 else pair[::-1]
            res["runs"][key] = row
            save(path, res)
            print(f"{key}: decode 4-bit/fp {row['decode_ratio_4bit_over_fp']:.3f}  prefill 4-bit/fp "
                  f"{row['prefill_ratio_4bit_over_fp']:.3f}", flush=True)


def replay_bytes(label: str, n_prompt: int, budget: int, decode_steps: int, shapes: dict, seed: int = 0) -> dict:
    """The cache calls plain mlx_lm.generate makes (prompt[:-1] in chunks of 2048, the last prompt
    token alone, then one token per decode step; queries through the tap after each fetch) on random
    K/V / queries of the model's shapes, without the model. For uniform storage the allocated bytes
    depend on shapes only, so they equal a real run's (checked against real runs in the JSON); ragged
    storage (NestedKV, Ada) depends on the key values and needs the real model."""
    import mlx.core as mx

    from veloxquant_mlx import KVCacheConfig

    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from veloxquant_mlx.caches.accounting import kv_report

    method, extra = parse_label(label)
    L, H, Hq, D = shapes["layers"], shapes["kv_heads"], shapes["q_heads"], shapes["head_dim"]
    caches = []
    for i in range(L):
        if method == "kvcache":
            c = QuantizedKVCache(group_size=64, bits=extra["kv_bits"]) if "kv_bits" in extra else KVCache()
        else:
            config = KVCacheConfig(method=method, budget=budget, **extra)
            c = config.cache_class(config, layer_idx=i, n_layers=L)
            c.tap_active = True
        caches.append(c)
    steps, left = [], n_prompt - 1
    while left > 0:
        steps.append(min(2048, left))
        left -= steps[-1]
    steps += [1] * (1 + decode_steps)
    key = mx.random.key(seed)
    for S in steps:
        key, k1, k2 = mx.random.split(key, 3)
        k = mx.random.normal((1, H, S, D), key=k1)
        q = mx.random.normal((1, Hq, S, D), key=k2)
        for c in caches:
            c.update_and_fetch(k, k)
            if hasattr(c, "observe_queries"):
                c.observe_queries(q, D ** -0.5)
        mx.eval([c.state for c in caches])
    rep = kv_report(caches)
    return {"label": label, "prompt_tokens": n_prompt, "budget": budget, "decode_steps": decode_steps,
            "kv_allocated_bytes": rep["allocated_bytes"], "kv_kept_bytes": rep["kept_bytes"],
            "kv_full_bytes": rep["full_bytes"], "offset": caches[0].offset,
            "source": "replay (random K/V of the model's shapes through the calls generate makes)"}


def run_replay(args):
    real_runs = load(Path(args.out_memory))["runs"]  # the real generate runs (written by --part memory)
    path = Path(args.out_memory).with_name("quant_replay.json")
    res = load(path)
    stamp(res, [k.split("|")[1] for k in res.get("replay", {})] + args.labels)
    shapes = {"layers": 30, "kv_heads": 3, "q_heads": 9, "head_dim": 64}  # SmolLM2-135M
    res["what"] = replay_bytes.__doc__.split("\n\n")[0].replace("\n", " ")
    res.setdefault("replay", {})
    for n in args.contexts:
        budget = max(int(round(args.density * n)), 1)
        for label in args.labels:
            key = f"{n}|{label}"
            r = replay_bytes(label, n, budget, args.max_tokens, shapes)
            real = real_runs.get(key)
            if real:
                r["equals_real_run"] = r["kv_allocated_bytes"] == real["kv_allocated_bytes"]
            base = res["replay"].get(f"{n}|kvcache")
            if base:
                r["allocated_vs_kvcache"] = r["kv_allocated_bytes"] / base["kv_allocated_bytes"]
            res["replay"][key] = r
            save(path, res)
            print(f"replay {key}: {r['kv_allocated_bytes'] / MIB:.2f} MiB vs KVCache "
                  f"{r.get('allocated_vs_kvcache', float('nan')):.4f} real-equal {r.get('equals_real_run')}", flush=True)


def table(args):
    """Markdown table of allocated KV / KVCache (real generate runs where measured, else the replay)."""
    real = load(Path(args.out_memory))["runs"]
    replay = load(Path(args.out_memory).with_name("quant_replay.json")).get("replay", {})
    lines = []
    for n in args.contexts:
        base = (real.get(f"{n}|kvcache") or replay.get(f"{n}|kvcache") or {}).get("kv_allocated_bytes")
        if not base:
            continue
        lines += [f"\n{n}-token prompt, budget {max(int(round(args.density * n)), 1)} (20 %): allocated KV after "
                  f"generation / mlx-lm `KVCache` ({base / MIB:.2f} MiB); `r` = real `generate_step` run, "
                  "`p` = replay\n", "| cache | fp32 rows | 8-bit | 4-bit | 4-bit / fp rows |", "|---|---|---|---|---|"]
        for m in ("kvcache", "nexus", "nestedkv", "nestedkv-nocap", "h2o", "snapkv", "pyramidkv", "streaming",
                  "morphkv", "random"):
            cells, vals = [], {}
            for suffix in ("", "-8bit", "-4bit"):
                key = f"{n}|{m}{suffix}"
                r, src = (real[key], "r") if key in real else (replay.get(key), "p")
                if r is None:
                    cells.append("–")
                    continue
                vals[suffix] = r["kv_allocated_bytes"]
                cells.append(f"{r['kv_allocated_bytes'] / base:.3f} ({src})")
            ratio = f"{vals['-4bit'] / vals['']:.3f}" if "" in vals and "-4bit" in vals else "–"
            if any(c != "–" for c in cells):
                lines.append(f"| {m} | " + " | ".join(cells) + f" | {ratio} |")
    print("\n".join(lines))


def figure(args):
    """Allocated KV / KVCache per method for fp, 8-bit and 4-bit rows, one panel per context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = load(Path(args.out_memory))
    replay = load(Path(args.out_memory).with_name("quant_replay.json")).get("replay", {})
    runs = {**replay, **res["runs"]}  # real runs where measured, else the replay (hatched)
    ctxs = sorted({r["prompt_tokens"] for r in runs.values()})
    fig, axes = plt.subplots(1, len(ctxs), figsize=(7 * len(ctxs), 4.2), squeeze=False)
    for ax, n in zip(axes[0], ctxs):
        names = [m for m in ("kvcache", "nexus", "nestedkv", "nestedkv-nocap", "h2o", "snapkv", "pyramidkv",
                             "streaming", "morphkv", "random") if f"{n}|{m}" in runs or f"{n}|{m}-4bit" in runs]
        if f"{n}|kvcache" not in runs:
            continue
        for j, (suffix, color) in enumerate((("", "tab:gray"), ("-8bit", "tab:blue"), ("-4bit", "tab:green"))):
            base = runs[f"{n}|kvcache"]["kv_allocated_bytes"]
            for i, m in enumerate(names):
                r = runs.get(f"{n}|{m}{suffix}")
                if r:
                    ax.bar(i + (j - 1) * 0.27, r["kv_allocated_bytes"] / base, 0.27, color=color,
                           hatch="//" if "source" in r else None,
                           label={"": "fp32 rows", "-8bit": "8-bit", "-4bit": "4-bit"}[suffix] if i == 0 else None)
        ax.set_xlabel("hatched: replay of generate's cache calls (uniform storage: bytes equal a real run)")
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_yscale("log")
        ax.axhline(0.06, color="k", lw=0.6, ls="--")
        ax.set_title(f"{n}-token prompt, budget 20 %: allocated KV / mlx-lm KVCache")
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(args.out_memory).with_name("quant_memory.png")
    fig.savefig(out, dpi=120)
    print(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("memory", "speed", "figure", "replay", "table"), required=True)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--density", type=float, default=0.2)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--labels", nargs="+", default=[
        "kvcache", "nexus-4bit", "nestedkv-4bit", "nexus", "nestedkv", "nestedkv-nocap", "kvcache-4bit",
        "nexus-8bit", "nestedkv-8bit", "h2o-4bit", "snapkv-4bit", "pyramidkv-4bit", "streaming-4bit",
        "morphkv-4bit", "random-4bit", "h2o", "snapkv", "pyramidkv", "streaming", "morphkv", "random",
        "kvcache-8bit", "h2o-8bit", "snapkv-8bit", "pyramidkv-8bit", "streaming-8bit", "morphkv-8bit",
        "random-8bit"])
    p.add_argument("--out-memory", default=str(ROOT / "figures" / "memory" / "quant.json"))
    p.add_argument("--speed-context", type=int, default=1024)
    p.add_argument("--speed-methods", nargs="+", default=["nexus", "nestedkv"])
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out-speed", default=str(ROOT / "figures" / "eval" / "quant_speed.json"))
    args = p.parse_args(argv)
    {"memory": run_memory, "speed": run_speed, "figure": figure, "replay": run_replay, "table": table}[args.part](args)


if __name__ == "__main__":
    main()
