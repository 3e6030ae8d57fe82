"""Side by side with NVIDIA kvpress on the same model, prompts and budget (passkey, question inside the
compressed prompt).

* **This project**: the passkey harness (``python -m veloxquant_mlx eval passkey``, its public path) on
  the chosen cells; the cells are written to ``<out-dir>/ours.json``.
* **kvpress**: installed with torch and transformers into its own venv
  (``~/.cache/veloxquant-bench/kvpress-venv``, made on first use from PyPI; nothing of torch enters the
  package). The bundled SmolLM2 GGUF is converted once to a folder transformers loads (the GGUF's
  config, weights and tokenizer, through transformers' own GGUF reader). Each press compresses the
  whole prompt (the same token ids as ours) to ``density`` in one prefill forward; the first answer
  token comes from that forward's logits and the rest are greedy steps on the compressed cache with
  explicit positions, as kvpress's pipeline decodes. Our prefill-only caches do the same (the prompt's
  last token attends to everything, then the cache compresses).

Pairs: SnapKV, ObservedAttention / H2O, StreamingLLM, PyramidKV and KVzip by name;
Knorm runs on the kvpress side only (no such method here); "none" is kvpress's
uncompressed model (checks the conversion). Output: ``<out-dir>/compare.json`` (per prompt, Wilson
intervals, exact McNemar per pair, provenance) and a markdown table on stdout.

    python benchmark_scripts/bench_vs_kvpress.py                       # 20 prompts, 1K, 20 %
    python benchmark_scripts/bench_vs_kvpress.py --depths 0.1 0.5 --skip-ours   # reuse ours.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _common import BENCH_CACHE, ROOT, add_publish, peer_venv, provenance, route_outputs

VENV = BENCH_CACHE / "kvpress-venv"
HF_DIR = BENCH_CACHE / "smollm2-135m-hf"
PINS = ["kvpress==0.5.5", "transformers==4.57.6", "torch==2.14.1", "gguf==0.19.0"]
DEPTHS = [0.02, 0.1, 0.22, 0.3, 0.42, 0.54, 0.62, 0.74, 0.82, 0.94]  # the comparison's 20 prompts (x2 haystacks)
KEY = "67767"
# (our eval label, kvpress press class, its keyword arguments beyond compression_ratio)
PAIRS = [("full", "none", {}), ("snapkv", "SnapKVPress", {}), ("h2o", "ObservedAttentionPress", {}),
         ("streaming", "StreamingLLMPress", {}), ("pyramidkv", "PyramidKVPress", {}),
         ("kvzip", "KVzipPress", {}), (None, "KnormPress", {})]


# -- the kvpress side (runs inside the venv: stdlib + torch + transformers + kvpress only) ----------
def worker(job: Path, out: Path) -> None:
    import kvpress
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    spec = json.loads(job.read_text())
    torch.set_num_threads(int(os.environ.get("KVPRESS_THREADS", "1")))
    models = {}

    def model_for(press_name):
        attn = "eager" if press_name == "ObservedAttentionPress" else "sdpa"  # observed needs the weights
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], torch_dtype=torch.float32,
                                                                attn_implementation=attn).eval()
        return models[attn]

    results = json.loads(out.read_text()) if out.exists() else {}
    for p in spec["prompts"]:
        for press_name in spec["presses"]:
            key = f"{press_name}|{p['id']}"
            if key in results:
                continue
            model = model_for(press_name)
            press = None if press_name == "none" else getattr(kvpress, press_name)(
                compression_ratio=1.0 - spec["density"])
            ids = torch.tensor([p["tokens"]])
            cache = DynamicCache()
            t0 = time.perf_counter()
            with torch.no_grad():
                with press(model) if press else contextlib.nullcontext():
                    logits = model(input_ids=ids, past_key_values=cache).logits
                gen = [int(logits[0, -1].argmax())]
                pos = ids.shape[1]
                for i in range(spec["max_new_tokens"] - 1):
                    logits = model(input_ids=torch.tensor([[gen[-1]]]), past_key_values=cache,
                                   position_ids=torch.tensor([[pos + i]])).logits
                    gen.append(int(logits[0, -1].argmax()))
            results[key] = {"press": press_name, "prompt": p["id"], "tokens": gen,
                            "seconds": round(time.perf_counter() - t0, 2)}
            out.write_text(json.dumps(results))
            print(f"{key}: {gen}", flush=True)


def convert(gguf: Path) -> None:
    """The bundled GGUF as a folder transformers loads (runs inside the venv)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(HF_DIR)
    tok.save_pretrained(HF_DIR)


# -- this project's side -------------------------------------------------------------------------
def ensure_hf_model(py: Path) -> None:
    if (HF_DIR / "config.json").exists():
        return
    from veloxquant_mlx.models import find_bundled_gguf

    subprocess.run([str(py), __file__, "--convert", str(find_bundled_gguf())], check=True)


def run_ours(args, labels) -> dict:
    if not args.skip_ours:
        base = [sys.executable, "-m", "lab", "--fast-blas", "eval", "passkey", "--contexts",  # stamped
                str(args.context), "--haystacks", *args.haystacks, "--densities", str(args.density),
                "--regimes", "prefill", "--n-keys", "1", "--depths", *map(str, args.depths),
                "--out-dir", str(args.out_dir), "--out-name", "ours.json", "--no-report"]
        shared = ["full"] + [lab for lab in labels if not lab.startswith("kvzip")]
        alone = [lab for lab in labels if lab.startswith("kvzip")]
        subprocess.run(base + ["--methods", *shared], check=True, cwd=ROOT)  # one prefill per prompt
        if alone:  # kvzip's pass runs after its own prefill (the harness's fan-out cannot drive it)
            subprocess.run(base + ["--methods", *alone, "--no-shared-prefill"], check=True, cwd=ROOT)
    cells = {}
    for f in sorted(args.out_dir.glob("ours*.json")):  # ours.json, plus any run written beside it
        cells.update(json.loads(f.read_text())["cells"])
    res = {}
    for c in cells.values():
        if c.get("context") == args.context and c.get("key") == KEY and "correct" in c \
                and c.get("density") in (args.density, None) and c["depth"] in args.depths:
            res.setdefault(c["method"], {})[f"{c['haystack']}:{c['depth']}"] = bool(c["correct"])
    return res


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--convert":
        convert(Path(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--density", type=float, default=0.2)
    ap.add_argument("--haystacks", nargs="+", default=["grass", "text"])
    ap.add_argument("--depths", nargs="+", type=float, default=DEPTHS)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--ours", nargs="*", default=None, help="our labels (default: every paired one)")
    ap.add_argument("--presses", nargs="*", default=None, help="kvpress presses (default: every listed one)")
    ap.add_argument("--skip-ours", action="store_true", help="reuse <out-dir>/ours*.json")
    ap.add_argument("--skip-kvpress", action="store_true", help="reuse <out-dir>/kvpress_raw.json (a partial run "
                    "compares the prompts both sides finished)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "figures" / "kvpress")
    add_publish(ap)
    args = route_outputs(ap.parse_args(), "out_dir")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    labels = args.ours if args.ours is not None else [o for o, _, _ in PAIRS if o and o != "full"]
    presses = args.presses if args.presses is not None else [p for _, p, _ in PAIRS if p]

    py = peer_venv(VENV, PINS)
    ensure_hf_model(py)
    from veloxquant_mlx.evaluation.passkey import extract_digits
    from veloxquant_mlx.evaluation.results import load_eval_model
    from veloxquant_mlx.evaluation.retrieval import make_prompt
    from lab.stats import fmt_ci, fmt_p, paired

    _, tok, _ = load_eval_model("bundled")
    prompts = []
    depths = sorted(args.depths)
    bits = max(len(depths) - 1, 1).bit_length()
    spread = [depths[i] for i in sorted(range(len(depths)), key=lambda i: int(f"{i:0{bits}b}"[::-1], 2))]
    for d in spread:  # partial runs stay balanced: haystacks alternate, depths spread over (0, 1)
        for hay in args.haystacks:
            tokens, _ = make_prompt(tok, hay, args.context, d, KEY)
            prompts.append({"id": f"{hay}:{d}", "tokens": [int(t) for t in tokens]})
    job = args.out_dir / "kvpress_job.json"
    job.write_text(json.dumps({"hf_dir": str(HF_DIR), "prompts": prompts, "presses": presses,
                               "density": args.density, "max_new_tokens": args.max_new_tokens}))
    raw = args.out_dir / "kvpress_raw.json"
    if not args.skip_kvpress:
        subprocess.run([str(py), __file__, "--worker", str(job), str(raw)], check=True)
    theirs = {}
    for r in json.loads(raw.read_text()).values():
        if r["press"] in presses and r["prompt"] in {p["id"] for p in prompts}:
            theirs.setdefault(r["press"], {})[r["prompt"]] = extract_digits(tok.decode(r["tokens"])) == KEY
    ours = run_ours(args, labels)

    table = {}
    lines = ["| method | this project | kvpress 0.5.5 | paired (ours only / kvpress only) | McNemar p |",
             "|---|---|---|---|---|"]
    for o, p, _ in PAIRS:
        a, b = ours.get(o, {}) if o else {}, theirs.get(p, {}) if p else {}
        row = {"ours": o, "kvpress": p}
        cols = []
        for name, r in (("ours_correct", a), ("kvpress_correct", b)):
            k, n = sum(r.values()), len(r)
            row[name] = [k, n]
            cols.append(f"{k}/{n} {fmt_ci(k, n)}" if n else "—")
        s = paired(a, b) if a and b else None
        row["paired"] = s
        lines.append(f"| {o or '—'} / {p or '—'} | {cols[0]} | {cols[1]} | "
                     + (f"{s['only_a']} / {s['only_b']} | {fmt_p(s['p'])} |" if s else "— | — |"))
        table[f"{o}|{p}"] = row
    print("\n".join(lines))
    result = {"experiment": "vs_kvpress", "setting": {"model": "SmolLM2-135M-Instruct (bundled Q4_1 GGUF, fp32)",
              "context": args.context, "density": args.density, "haystacks": args.haystacks,
              "depths": args.depths, "key": KEY, "max_new_tokens": args.max_new_tokens, "kvpress_pins": PINS},
              "ours": ours, "kvpress": theirs, "table": table,
              "kvpress_outputs": json.loads(raw.read_text()),  # the worker's tokens and seconds per press and prompt
              "provenance": provenance([o for o in labels if o])}
    (args.out_dir / "compare.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
