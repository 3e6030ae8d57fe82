"""Serving benchmarks on the bundled SmolLM2-135M, one subcommand per question:

* ``batch``: 1, 4, 8 and 16 concurrent 2K-token conversations decoding in one mlx-lm
  ``BatchGenerator`` (the engine of ``mlx_lm.server``), for mlx-lm's ``KVCache``, its
  ``RotatingKVCache`` at the eviction budget and the eviction methods: KV bytes and decode tokens/s
  (figures/serving/bench_serving.json and .png);
* ``load``: a load test of ``python -m veloxquant_mlx serve``: two servers side by side on loopback,
  concurrent mixed-length chat requests: answers, p50 / p95 latency, tok/s, resident memory
  (figures/serving/bench_serve_load.json).

    python benchmark_scripts/bench_serving.py batch [--quick]
    python benchmark_scripts/bench_serving.py load [--clients 4 --out-dir /tmp/x]

``python benchmark_scripts/bench_serving.py SUBCOMMAND --help`` describes each one.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import _common
from _common import (FIGURES, ROOT, add_publish, blas_info, preload_blas, provenance, route_outputs, tiny_llama,
                     tiny_tokenizer, run_subcommands)

OUT = FIGURES / "serving"


# ================================================================================================
# batch: Serving benchmark: 1, 4, 8 and 16 concurrent 2K-token conversations on the bundled SmolLM2-135M.
# ================================================================================================
BATCH_DOC = """Serving benchmark: 1, 4, 8 and 16 concurrent 2K-token conversations on the bundled SmolLM2-135M.

For each cache (mlx-lm's KVCache, which batches as BatchKVCache; mlx-lm's RotatingKVCache at the
eviction budget, which batches as BatchRotatingKVCache: the limit, a cache that only holds that many
rows; and eviction methods at a fixed density) and each concurrency n: n conversations join one mlx-lm ``BatchGenerator`` (the engine of
``mlx_lm.server`` and ``batch_generate``) with their prompts already in their caches, the way the
server continues a stored conversation, and decode ``--tokens`` tokens each. Measured:

* total allocated KV: the sum of ``nbytes`` over the batch caches of every layer (what the buffers
  hold, capacity included), after every decode step; we report the largest value during decode and
  the value when the prompts were in (before the first decode step);
* aggregate decode tok/s: ``BatchGenerator.stats()`` (generated tokens of all rows / decode time).

Each conversation's prompt is prefilled once per eviction method, alone (exactly what one row of a
batch holds: tests/test_batching.py), its last token included, so eviction caches enter the batch
compressed, as a conversation the server stored after its turn; every concurrency level decodes
copies of those caches.
Under ``--prompt-eviction end`` (default) an eviction cache holds every prompt row until the prompt
ends, so mlx-lm's KVCache baseline is built from those same rows (bit-identical to its own prefill)
instead of a second prefill, and the RotatingKVCache holds the last ``budget`` of them. ``--distinct``
conversations are prefilled; higher concurrency repeats them (the decode work is the same). A
warm-up decode runs first for every cache; then, in each of ``--rounds`` rounds and for each
concurrency, every cache is measured in turn (the order reversed every other round), so they see
the same machine load; ratios are taken within a round and summarized as median [min, max]. ``--fast-blas`` (default on) re-runs the script
with OpenBLAS preloaded when one is installed; the JSON says whether it was.

    python benchmark_scripts/bench_serving.py batch           # figures/serving/bench_serving.{json,png}
    python benchmark_scripts/bench_serving.py batch --quick   # tiny random model, seconds (harness check)
"""




def batch_parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_serving.py batch", description=BATCH_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per conversation")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--distinct", type=int, default=8, help="distinct conversations prefilled (then repeated)")
    p.add_argument("--rounds", type=int, default=2, help="measurement rounds, alternating the cache order")
    p.add_argument("--tokens", type=int, default=64, help="decoded tokens per conversation")
    p.add_argument("--density", type=float, default=0.2, help="eviction budget / context")
    p.add_argument("--methods", nargs="+", default=["nexus", "streaming"],
                   help="eviction methods (registry names) measured against mlx-lm's KVCache")
    p.add_argument("--prompt-eviction", choices=("end", "stream"), default="end")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--no-fast-blas", action="store_true", help="keep MLX's reference BLAS")
    p.add_argument("--quick", action="store_true", help="tiny random model (numbers meaningless)")
    p.add_argument("--out-dir", default=str(OUT))
    add_publish(p)
    return route_outputs(p.parse_args(argv), "out_dir")


def load(args):
    if args.quick:
        return tiny_llama(layers=4, max_position_embeddings=4096), tiny_tokenizer(), "tiny random llama (--quick)"
    from veloxquant_mlx.models import load_model

    model, tokenizer = load_model()
    return model, tokenizer, "SmolLM2-135M-Instruct (bundled GGUF, float32)"


def conversations(tokenizer, n, context, quick):
    if quick:
        import numpy as np

        rng = np.random.default_rng(0)
        return [rng.integers(1, 128, size=context).tolist() for _ in range(n)]
    from veloxquant_mlx.evaluation.passkey import make_passkey_prompt

    keys = ["31416", "27182", "14142", "17320", "22360", "16180", "57721", "69314"]
    return [make_passkey_prompt(tokenizer, context, (i + 0.5) / n, keys[i % len(keys)])[0][:context]
            for i in range(n)]


def prefill(model, make_cache, prompt, step):
    """Caches holding prompt[:-1] (``last_token`` feeds the last one)."""
    import mlx.core as mx

    caches = make_cache()
    body = prompt[:-1]
    for start in range(0, len(body), step):
        model(mx.array(body[start:start + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def last_token(model, caches, prompt):
    """Feed the prompt's last token (an eviction cache's one-shot compression runs here, as for a
    conversation the server stored after its turn); returns the greedy next token."""
    import mlx.core as mx

    logits = model(mx.array(prompt[-1:])[None], cache=caches)
    mx.eval(logits, [c.state for c in caches])
    return int(mx.argmax(logits[0, -1]).item())


def kv_total(gen):
    return sum(c.nbytes for c in gen._generation_batch.prompt_cache)


def decode(model, prompts, caches, firsts, tokens, step):
    """n conversations in one BatchGenerator, their caches holding the whole prompts and ``firsts``
    their first decode inputs: (stats, max total KV bytes after a decode step, tokens)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         prefill_step_size=step)
    gen.insert([[t] for t in firsts], [tokens] * len(prompts), caches=copy.deepcopy(caches),
               all_tokens=[list(p) for p in prompts])
    with gen.stats() as stats:
        peak = 0
        out = []
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            now = kv_total(gen) if len(gen._generation_batch) else peak
            peak = max(peak, now)
            out.extend(r.token for r in responses)
    gen.close()
    return stats, peak, len(out)


def kvcache_from(cache):
    """mlx-lm's KVCache holding the same rows as an eviction cache that has not evicted yet."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    kv = KVCache()
    kv.keys, kv.values = mx.contiguous(cache.stored("keys")), mx.contiguous(cache.stored("values"))
    kv.offset = cache.offset
    mx.eval(kv.keys, kv.values)
    return kv


def rotating_from(cache, budget):
    """mlx-lm's RotatingKVCache(max_size=budget) holding the last ``budget`` rows of an eviction cache
    that has not evicted yet: what a plain window of the eviction budget holds after the prompt."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    rc = RotatingKVCache(max_size=budget)
    rc.keys = mx.contiguous(cache.stored("keys")[:, :, -budget:])
    rc.values = mx.contiguous(cache.stored("values")[:, :, -budget:])
    rc.offset, rc._idx = cache.offset, rc.keys.shape[2]
    mx.eval(rc.keys, rc.values)
    return rc


def summarize(results):
    """Per cache and concurrency: median tok/s over rounds, and ratios to KVCache and to the rotating
    limit taken within each round (same machine load), as median [min, max]."""
    import statistics

    out = []
    keys = list(dict.fromkeys((r["cache"], r["concurrency"]) for r in results))
    by = {(r["cache"], r["concurrency"], r["round"]): r for r in results}
    rounds = sorted({r["round"] for r in results})
    for cache, n in keys:
        rows = [by[cache, n, k] for k in rounds]
        row = {**{k: v for k, v in rows[0].items() if k not in ("round", "decode_tps", "decode_time_s",
                                                                "load_average_1min_before")},
               "decode_tps": statistics.median(r["decode_tps"] for r in rows),
               "decode_tps_rounds": [r["decode_tps"] for r in rows],
               "kv_allocated_peak_decode_bytes": max(r["kv_allocated_peak_decode_bytes"] for r in rows)}
        for ref in ("kvcache", "rotating"):
            ratios = [by[cache, n, k]["decode_tps"] / by[ref, n, k]["decode_tps"] for k in rounds]
            row[f"decode_tps_vs_{ref}"] = statistics.median(ratios)
            row[f"decode_tps_vs_{ref}_range"] = [min(ratios), max(ratios)]
            row[f"kv_vs_{ref}"] = row["kv_allocated_peak_decode_bytes"] / max(
                by[ref, n, k]["kv_allocated_peak_decode_bytes"] for k in rounds)
        out.append(row)
    return out


def prompt_kv(caches_per_conv):
    return sum(c.nbytes for caches in caches_per_conv for c in caches)


def batch_main(argv=None):
    args = batch_parse_args(argv)
    preload_blas(num_threads=None, skip=args.no_fast_blas)
    import mlx.core as mx
    import mlx_lm

    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, __version__ as vq_version

    model, tokenizer, model_name = load(args)
    n_max = min(max(args.concurrency), args.distinct)
    distinct = conversations(tokenizer, n_max, args.context, args.quick)
    budget = _common.budget(args.density, args.context)
    caches_kinds = [("kvcache", None), ("rotating", None)] + [
        (m, KVCacheConfig(method=m, budget=budget, prompt_eviction=args.prompt_eviction)) for m in args.methods]
    stored, prefill_s = {}, {}
    prompts = distinct
    for label, config in caches_kinds[2:]:
        make = lambda c=config: KVCacheBuilder.for_model(model, c)  # noqa: E731
        t0 = time.perf_counter()
        stored[label] = [prefill(model, make, p, args.prefill_step_size) for p in prompts]
        prefill_s[label] = time.perf_counter() - t0
        print(f"{label}: prefilled {n_max} x {args.context} tokens in {prefill_s[label]:.1f} s", flush=True)
    first = caches_kinds[2][0] if len(caches_kinds) > 2 else None
    derived = first is not None and all(
        c.evictions == 0 and c.size() == len(p) - 1 for p, caches in zip(prompts, stored[first]) for c in caches)
    if derived:
        # Under prompt_eviction="end" the eviction cache holds every prompt row until the prompt ends,
        # and attention saw all of them: its keys/values are exactly what mlx-lm's KVCache holds after
        # the same prefill, so the baseline reuses them instead of a second prefill.
        stored["kvcache"] = [[kvcache_from(c) for c in caches] for caches in stored[first]]
        stored["rotating"] = [[rotating_from(c, budget) for c in caches] for caches in stored[first]]
        prefill_s["kvcache"] = prefill_s["rotating"] = 0.0
    else:
        from mlx_lm.models.cache import make_prompt_cache

        KVCacheBuilder.uninstall(model)
        for label, kw in (("kvcache", {}), ("rotating", {"max_kv_size": budget})):
            t0 = time.perf_counter()
            stored[label] = [prefill(model, lambda kw=kw: make_prompt_cache(model, **kw), p, args.prefill_step_size)
                             for p in prompts]
            prefill_s[label] = time.perf_counter() - t0
    firsts = {}
    for label in stored:  # the prompts' last tokens: eviction caches compress here, before the batch
        t0 = time.perf_counter()
        firsts[label] = [last_token(model, c, p) for c, p in zip(stored[label], prompts)]
        prefill_s[label] += time.perf_counter() - t0
    prompts = [distinct[i % n_max] for i in range(max(args.concurrency))]  # conversations repeat past --distinct
    firsts = {k: [v[i % n_max] for i in range(len(prompts))] for k, v in firsts.items()}
    stored = {k: [v[i % n_max] for i in range(len(prompts))] for k, v in stored.items()}
    configs = dict(caches_kinds)
    for label in configs:  # warm-up (compiles the eviction graphs)
        decode(model, prompts[:1], stored[label][:1], firsts[label][:1], 4, args.prefill_step_size)
    results = []
    for rnd, n in ((rnd, n) for rnd in range(args.rounds) for n in args.concurrency):
        order = caches_kinds if rnd % 2 == 0 else caches_kinds[::-1]
        for label, config in order:  # interleaved: every cache sees the same machine load
            load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
            stats, peak, n_tokens = decode(model, prompts[:n], stored[label][:n], firsts[label][:n], args.tokens,
                                           args.prefill_step_size)
            row = {"cache": label, "round": rnd, "method": None if config is None else config.method,
                   "config": None if config is None else config.to_dict(), "concurrency": n,
                   "context": args.context, "decode_tokens_per_conversation": args.tokens,
                   "generated_tokens": stats.generation_tokens, "decode_time_s": stats.decode_time,
                   "decode_tps": stats.generation_tps, "kv_allocated_peak_decode_bytes": peak,
                   "kv_allocated_prompt_bytes": prompt_kv(stored[label][:n]),
                   "prefill_s_all_conversations": prefill_s[label], "peak_memory_gb": stats.peak_memory,
                   "load_average_1min_before": load_before}
            results.append(row)
            print(f"  round {rnd} {label} n={n}: decode {row['decode_tps']:.1f} tok/s aggregate ({n_tokens} tokens), "
                  f"KV allocated peak {peak / 2**20:.1f} MiB (prompt held: "
                  f"{row['kv_allocated_prompt_bytes'] / 2**20:.1f} MiB); load {load_before}", flush=True)
    summary = summarize(results)
    meta = {"model": model_name, "context": args.context, "density": args.density, "budget": budget,
            "prompt_eviction": args.prompt_eviction, "tokens": args.tokens, "concurrency": args.concurrency,
            "prefill_step_size": args.prefill_step_size, "rounds": args.rounds,
            "distinct_conversations": n_max, "engine": "mlx_lm.generate.BatchGenerator",
            "kvcache_prefill": ("rows of the first eviction method's prefill (prompt_eviction=end holds "
                                "them all: identical to a KVCache prefill)") if derived else "own prefill",
            "compression": ("the prompt's last token is fed before the batch, so eviction caches enter it "
                            "compressed (as a conversation the server stored after its turn); that "
                            "compression is prefill time"),
            "order": ("prefill all, warm-up each cache, then per round and concurrency every cache in turn, "
                      "the order reversed every other round"),
            "rotating": f"mlx-lm RotatingKVCache(max_size={budget}) -> BatchRotatingKVCache (the limit)",
            "prompts": "passkey-filler prompts, one key/depth per conversation" if not args.quick else "random",
            "quick": args.quick, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
            "veloxquant_mlx": vq_version, "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg() if hasattr(os, "getloadavg") else None, **blas_info()}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance(["full", *args.methods], "stream" if args.prompt_eviction == "stream" else "end")
    (out / "bench_serving.json").write_text(json.dumps({"meta": meta, "summary": summary, "results": results,
                                                        "provenance": prov},
                                                       indent=1) + "\n")
    figure(summary, meta, out / "bench_serving.png")
    for r in summary:
        lo, hi = r["decode_tps_vs_rotating_range"]
        print(f"{r['cache']:>10s} n={r['concurrency']}: KV {r['kv_vs_kvcache']:.3f}x kvcache, decode "
              f"{r['decode_tps_vs_kvcache']:.2f}x kvcache, {r['decode_tps_vs_rotating']:.2f}x rotating "
              f"[{lo:.2f}, {hi:.2f}] ({r['decode_tps']:.1f} tok/s)")
    print(f"wrote {out / 'bench_serving.json'} and bench_serving.png; BLAS: {meta['blas']}")
    return 0


def figure(results, meta, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["cache"] for r in results))
    ns = sorted({r["concurrency"] for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / len(labels)
    for k, label in enumerate(labels):
        rows = {r["concurrency"]: r for r in results if r["cache"] == label}
        xs = [i + (k - (len(labels) - 1) / 2) * width for i in range(len(ns))]
        name = {"kvcache": "mlx-lm KVCache (BatchKVCache)",
                "rotating": f"mlx-lm RotatingKVCache({meta['budget']}) (limit)"}.get(
            label, f"{label} @ {meta['density']:.0%}")
        axes[0].bar(xs, [rows[n]["kv_allocated_peak_decode_bytes"] / 2**20 for n in ns], width, label=name)
        axes[1].bar(xs, [rows[n]["decode_tps"] for n in ns], width, label=name)
    for ax, title in zip(axes, ("total allocated KV during decode (MiB)",
                                f"aggregate decode tokens/s (median of {meta['rounds']} rounds)")):
        ax.set_xticks(range(len(ns)), [str(n) for n in ns])
        ax.set_xlabel(f"concurrent {meta['context']}-token conversations")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    blas = "OpenBLAS preloaded" if meta.get("openblas_preloaded") else "reference BLAS"
    fig.suptitle(f"{meta['model']} served through mlx-lm's BatchGenerator (CPU, {blas})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================================================
# load: Load test of ``python -m veloxquant_mlx serve``: concurrent mixed-length chat requests on loopback.
# ================================================================================================
LOAD_DOC = """Load test of ``python -m veloxquant_mlx serve``: concurrent mixed-length chat requests on loopback.

Two servers run side by side on 127.0.0.1 (``--method nexus --budget 410`` and ``--method full`` by
default, both with ``--fast-blas`` and the same server flags), each started once. At every client
count (4, 8, 16) the same requests go to one server and then the other, the order alternating from
one count to the next, so both see the same machine load. A request is a chat turn of ``--lo`` to
``--hi`` prompt tokens (spread evenly over the clients, each its own text: no prefix is shared but the
chat template's system prompt) asking for ``--new-tokens`` tokens; every client sends its request at
once and waits at most ``--timeout`` seconds (an answer may end early at the model's end token). Measured per server and count: requests answered, p50 /
p95 latency (request sent -> full answer), aggregate tok/s (answer tokens of all requests / the
wall time until the last one finished), and the server's resident memory (VmRSS) when idle (after a
warm-up request) and a few seconds after each load. Everything is bounded: a fixed count of
requests, a timeout per request and per server start; the servers are stopped at the end.

    python benchmark_scripts/bench_serving.py load               # figures/serving/bench_serve_load.json
    python benchmark_scripts/bench_serving.py load --clients 4 --out-dir /tmp/x   # a quick check
"""



# Common words: about one token each on SmolLM2's tokenizer, so a prompt's length is set by its word count.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point number group problem fact water room mother area money story month lot right study book job "
         "word business issue side kind head house service friend father power hour game line end member law "
         "car city name team minute idea kid body back parent face level office door health art war history "
         "party result change morning reason research girl guy moment air teacher force education").split()


def load_parse_args(argv=None):
    p = argparse.ArgumentParser(prog="bench_serving.py load", description=LOAD_DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, nargs="+", default=[4, 8, 16], help="concurrent clients per level")
    p.add_argument("--lo", type=int, default=45, help="shortest prompt (tokens, chat template included)")
    p.add_argument("--hi", type=int, default=1500, help="longest prompt (tokens)")
    p.add_argument("--new-tokens", type=int, default=16, help="answer tokens per request")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds a client waits for its answer")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to come up")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after a load before reading RSS")
    p.add_argument("--servers", nargs="+", default=["nexus:--method nexus --budget 410", "full:--method full"],
                   help="label:flags for each server")
    p.add_argument("--server-flags", default="", help="flags given to every server (e.g. --prefill-step-size 256)")
    p.add_argument("--model", default="bundled")
    p.add_argument("--out-dir", default=str(OUT))
    p.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temporary folder)")
    p.add_argument("--name", default="bench_serve_load", help="output file stem")
    add_publish(p)
    return route_outputs(p.parse_args(argv), "out_dir")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class Server:
    def __init__(self, label, flags, args, log_dir):
        self.label, self.port = label, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "veloxquant_mlx", "--fast-blas", "serve", "--model", args.model,
                    "--host", "127.0.0.1", "--port", str(self.port), *shlex.split(flags),
                    *shlex.split(args.server_flags)]
        self.log_path = Path(log_dir) / f"{label}.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)})

    def wait_up(self, timeout):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.label} exited ({self.proc.returncode}):\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.label} did not come up in {timeout:.0f} s")

    def rss(self):
        return rss_bytes(self.proc.pid)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def chat(url, content, max_tokens, timeout):
    """(latency s, prompt tokens, answer tokens, error or None) of one chat request."""
    body = json.dumps({"model": "default_model", "max_tokens": max_tokens, "temperature": 0.0,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            usage = json.loads(r.read())["usage"]
        return time.perf_counter() - t0, usage["prompt_tokens"], usage["completion_tokens"], None
    except (OSError, ValueError, KeyError) as e:
        return time.perf_counter() - t0, None, 0, f"{type(e).__name__}: {e}"


def text(n_words, seed):
    import random

    rng = random.Random(seed)
    return f"Note {seed}: " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + ". Summarize the note."


def calibrate(server, timeout):
    """(tokens of the template and fixed words, tokens per word) from two warm-up requests."""
    (_, a, _, e1), (_, b, _, e2) = (chat(server.url, text(n, 7), 1, timeout) for n in (20, 220))
    if e1 or e2:
        raise RuntimeError(f"warm-up failed on {server.label}: {e1 or e2}")
    per_word = (b - a) / 200
    return a - 20 * per_word, per_word


def requests_for(n, args, fit, level_seed):
    base, per_word = fit
    lengths = [round(args.lo + (args.hi - args.lo) * i / max(n - 1, 1)) for i in range(n)]
    return [(L, text(max(1, round((L - base) / per_word)), level_seed * 1000 + i)) for i, L in enumerate(lengths)]


def percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def run_level(server, reqs, args):
    rss_before = server.rss()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(reqs)) as pool:
        out = list(pool.map(lambda r: chat(server.url, r[1], args.new_tokens, args.timeout), reqs))
    wall = time.perf_counter() - t0
    time.sleep(args.settle)
    ok = [o for o in out if o[3] is None and o[2] > 0]  # an answer may end (EOS) before --new-tokens
    lat = [o[0] for o in ok]
    return {"server": server.label, "clients": len(reqs), "answered": len(ok), "sent": len(reqs),
            "p50_s": statistics.median(lat) if lat else None, "p95_s": percentile(lat, 0.95),
            "max_s": max(lat) if lat else None, "wall_s": wall,
            "aggregate_tok_s": sum(o[2] for o in ok) / wall,
            "prompt_tokens": [o[1] for o in out], "answer_tokens": [o[2] for o in out],
            "latencies_s": [o[0] for o in out],
            "errors": [o[3] for o in out if o[3]], "rss_before": rss_before, "rss_after": server.rss(),
            "load_average": os.getloadavg()}


def load_main(argv=None):
    args = load_parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serve_load_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    methods = set()
    for spec in args.servers:  # the methods the servers run, from their flags
        flags = shlex.split(spec.split(":", 1)[1])
        methods.add(flags[flags.index("--method") + 1] if "--method" in flags else "full")
    prov = provenance(sorted(methods))  # at the start: the code the servers run
    servers = []
    try:
        for spec in args.servers:
            label, flags = spec.split(":", 1)
            servers.append(Server(label, flags, args, log_dir))
        for s in servers:
            s.wait_up(args.start_timeout)
        fits, idle = {}, {}
        for s in servers:
            fits[s.label] = calibrate(s, args.timeout)
            time.sleep(args.settle)
            idle[s.label] = s.rss()
        rows = []
        for k, n in enumerate(args.clients):
            order = servers if k % 2 == 0 else servers[::-1]
            for s in order:
                reqs = requests_for(n, args, fits[s.label], level_seed=k + 1)
                r = run_level(s, reqs, args)
                r["rss_idle"] = idle[s.label]
                rows.append(r)
                print(f"{s.label:>6s} x{n:2d}: {r['answered']}/{n} answered, p50 {r['p50_s'] or float('nan'):.1f} s, "
                      f"p95 {r['p95_s'] or float('nan'):.1f} s, {r['aggregate_tok_s']:.2f} tok/s, RSS idle "
                      f"{idle[s.label] / 2**30:.2f} -> after {r['rss_after'] / 2**30:.2f} GiB", flush=True)
    finally:
        for s in servers:
            s.stop()
    meta = {"model": args.model, "clients": args.clients, "prompt_tokens": [args.lo, args.hi],
            "new_tokens": args.new_tokens, "timeout_s": args.timeout,
            "servers": {s.label: " ".join(s.cmd[1:]) for s in servers}, "host": "127.0.0.1",
            "order": "per client count the servers in turn, the order reversed every other count",
            "latency": "request sent -> full (non-streamed) answer; p95 interpolated over answered requests",
            "aggregate_tok_s": "answer tokens of the answered requests / wall time of the level",
            "rss": "VmRSS of the server process: idle = after two warm-up requests, after = --settle s after a level",
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "fast_blas": True}
    path = out_dir / f"{args.name}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows,
                                "provenance": prov}, indent=1) + "\n")
    print(f"wrote {path}; server logs in {log_dir}")
    return 0 if all(r["answered"] == r["sent"] for r in rows) else 1


SUBCOMMANDS = {"batch": batch_main, "load": load_main}


def main(argv=None) -> int:
    return run_subcommands(__doc__, SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
