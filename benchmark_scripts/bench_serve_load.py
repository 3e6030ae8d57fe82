"""Load test of ``python -m veloxquant_mlx serve``: concurrent mixed-length chat requests on loopback.

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

    python benchmark_scripts/bench_serve_load.py                 # figures/serving/bench_serve_load.json
    python benchmark_scripts/bench_serve_load.py --clients 4 --out-dir /tmp/x   # a quick check
"""

from __future__ import annotations

import argparse
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
OUT = ROOT / "figures" / "serving"

# Common words: about one token each on SmolLM2's tokenizer, so a prompt's length is set by its word count.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case "
         "point number group problem fact water room mother area money story month lot right study book job "
         "word business issue side kind head house service friend father power hour game line end member law "
         "car city name team minute idea kid body back parent face level office door health art war history "
         "party result change morning reason research girl guy moment air teacher force education").split()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
    return p.parse_args(argv)


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


def main(argv=None):
    args = parse_args(argv)
    from veloxquant_mlx.evaluation.provenance import command_line, provenance

    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="bench_serve_load_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    methods = set()
    for spec in args.servers:  # the methods the servers run, from their flags
        flags = shlex.split(spec.split(":", 1)[1])
        methods.add(flags[flags.index("--method") + 1] if "--method" in flags else "full")
    prov = provenance(command_line(), sorted(methods))  # at the start: the code the servers run
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


if __name__ == "__main__":
    sys.exit(main())
