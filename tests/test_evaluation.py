"""End-to-end checks of the real-model evaluation harness on ``--quick`` (tiny random llama, byte
tokenizer): cells are written, a re-run skips finished cells, errors become cells, the report is
generated, and an eviction cache whose budget covers the whole sequence equals the full cache."""

from __future__ import annotations

import json

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from veloxquant_mlx.cli import main  # noqa: E402
from veloxquant_mlx.evaluation import report  # noqa: E402
from veloxquant_mlx.evaluation.report_paired import needle_cut_summary  # noqa: E402
from veloxquant_mlx.evaluation.report_passkey import PasskeyGrid, _passkey_tables, passkey_coverage  # noqa: E402
from veloxquant_mlx.evaluation import results as R  # noqa: E402
from veloxquant_mlx.evaluation.perplexity import streaming_nll  # noqa: E402
from veloxquant_mlx.evaluation.passkey import prose_paragraphs  # noqa: E402
from veloxquant_mlx.evaluation.retrieval import make_keys, make_prompt  # noqa: E402
from veloxquant_mlx.evaluation.speed import greedy_generate  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return R.tiny_model()


def _run(*argv):
    assert main(list(argv)) == 0


def _passkey_reading(data, figs_dir):
    """(the passkey section's headline numbers, the reading as data keyed by (regime, density))."""
    pk = _passkey_tables(data, [], figs_dir, [])
    return pk, {(r["regime"], r["density"]): r for r in report.passkey_reading(pk, data)}


def _counts(paired):
    return paired["n"], paired["only_a"], paired["only_b"], paired["p"]


def test_method_specs_follow_registry():
    from veloxquant_mlx.registry import methods

    names = [s.name for s in R.method_specs()]
    assert names[0] == R.FULL
    assert set(methods()) <= set(names)
    if "nexus" in methods():
        specs = {s.name: s for s in R.method_specs()}
        assert specs["nexus-topk"].opts == {"n_samples": None}
        assert specs["nexus-nowalk"].opts == {"lam": 0.0, "prompt_top_k": False}  # as measured: on the reservoir
    # Ada variants are opt-in labels, only for methods whose scores Ada-KV can allocate with.
    assert not any(n.endswith("-ada") for n in names)
    ada = R.method_specs(["snapkv-ada"])[0]
    assert (ada.method, ada.allocation) == ("snapkv", "ada")
    with pytest.raises(ValueError, match="unknown method 'streaming-ada'"):
        R.method_specs(["streaming-ada"])


def test_quantized_and_nocap_labels(tiny):
    from mlx_lm.models.cache import QuantizedKVCache

    q4, full4, nocap, ada8 = R.method_specs(["nexus-4bit", "full-4bit", "nestedkv-nocap", "h2o-ada-8bit"])
    assert (q4.method, q4.kv_bits, full4.method, full4.kv_bits) == ("nexus", 4, None, 4)
    assert (ada8.allocation, ada8.kv_bits) == ("ada", 8)
    model, _ = tiny
    assert all(c.config.kv_bits == 4 for c in R.make_caches(model, q4, budget=128))
    assert all(c.config.max_head_factor is None for c in R.make_caches(model, nocap, budget=64))
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 4 for c in R.make_caches(model, full4, budget=64))
    for bad in ("nexus-3bit", "full-nocap", "bogus-4bit"):
        with pytest.raises(ValueError, match="unknown method"):
            R.method_specs([bad])


def test_ada_spec_builds_ada_caches(tiny):
    model, _ = tiny
    caches = R.make_caches(model, R.method_specs(["snapkv-ada"])[0], budget=64)
    assert all(c.config.allocation == "ada" for c in caches)


def test_prose_has_no_digits_and_needle_is_found(tiny):
    _, tok = tiny
    paras = prose_paragraphs()
    assert len(paras) > 50 and not any(ch.isdigit() for p in paras[:200] for ch in p)
    key = make_keys(1)[0]
    toks, pos = make_prompt(tok, "text", 700, 0.5, key)
    text = tok.decode(toks)
    assert f"The magic number is {key}" in text and text.rstrip().endswith("The magic number is")
    assert abs(len(toks) - 700) < 80 and 0 < pos < len(toks)
    assert sum(ch.isdigit() for ch in text) == 2 * len(key)  # the needle is the only number


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_full_cache_equals_eviction_with_budget_covering_prompt(tiny):
    model, tok = tiny
    toks, _ = make_prompt(tok, "grass", 640, 0.5, "12345")
    full = R.make_caches(model, R.method_specs([R.FULL])[0], 0)
    ref = greedy_generate(model, toks, full, 6, 256)
    for name in ("nexus", "h2o", "snapkv", "streaming"):
        spec = R.method_specs([name])[0]
        for step in (2048, 256):
            caches = R.make_caches(model, spec, budget=len(toks) + 64)
            out = greedy_generate(model, toks, caches, 6, step)
            assert out["tokens"] == ref["tokens"], (name, step)
    # Streaming NLL too.
    seq = toks[:400]
    nll_full = streaming_nll(model, seq, R.make_caches(model, R.method_specs([R.FULL])[0], 0), 64)
    nll_ev = streaming_nll(model, seq, R.make_caches(model, R.method_specs(["h2o"])[0], budget=len(seq) + 64), 64)
    assert max(abs(a - b) for a, b in zip(nll_full, nll_ev)) < 1e-3


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_shared_prefill_equals_separate_runs(tiny):
    from veloxquant_mlx.evaluation.retrieval import shared_prefill_generate

    model, tok = tiny
    toks, _ = make_prompt(tok, "text", 700, 0.3, "54321")
    specs = [s for s in R.method_specs() if s.method is not None]
    budget = 160
    named = {}
    for s in specs:
        try:
            named[s.name] = R.make_caches(model, s, budget)
        except ValueError:
            pass
    assert "nexus" in named
    out = shared_prefill_generate(model, toks, named, 6)
    ref = greedy_generate(model, toks, R.make_caches(model, R.method_specs([R.FULL])[0], 0), 6, 2048)
    assert out["__full__"]["tokens"] == ref["tokens"]
    for s in specs:
        if s.name not in named:
            continue
        alone = greedy_generate(model, toks, R.make_caches(model, s, budget), 6, 2048)
        assert out[s.name]["tokens"] == alone["tokens"], s.name
        assert out[s.name]["kv_bytes_end"] == alone["kv_bytes_end"], s.name


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
@pytest.mark.parametrize("regime", ["prefill", "decode"])
def test_harness_gives_what_mlx_lm_generate_gives(tiny, regime):
    """Every published passkey number is reproducible through plain mlx_lm.generate with the
    setting it names: the harness feeds the prompt exactly as generate_step does."""
    from mlx_lm.generate import generate_step

    from veloxquant_mlx.evaluation.retrieval import REGIME_POLICY, shared_prefill_generate

    model, tok = tiny
    toks, _ = make_prompt(tok, "grass", 900, 0.5, "24680")
    policy, step = REGIME_POLICY[regime], (2048 if regime == "prefill" else 128)
    names = ["nexus", "h2o", "snapkv", "streaming", "nestedkv"]
    named = {n: R.make_caches(model, R.method_specs([n])[0], 180, prompt_eviction=policy) for n in names}
    shared = shared_prefill_generate(model, toks, named, 6) if regime == "prefill" else None
    for n in names:
        spec = R.method_specs([n])[0]
        ref_caches = R.make_caches(model, spec, 180, prompt_eviction=policy)
        ref = [int(t) for t, _ in generate_step(mx.array(toks), model, prompt_cache=ref_caches, max_tokens=6,
                                               prefill_step_size=step)]
        out = greedy_generate(model, toks, R.make_caches(model, spec, 180, prompt_eviction=policy), 6, step)
        assert out["tokens"] == ref, (n, regime)
        assert ref_caches[0].evictions >= 1
        if shared is not None:
            assert shared[n]["tokens"] == ref, n


def test_run_cells_records_errors_and_resumes(tmp_path):
    store = R.ResultStore(tmp_path / "x.json", "x")
    cells = [(f"c{i}", {"i": i}) for i in range(4)]

    def run_one(p):
        if p["i"] == 2:
            raise ValueError("boom")
        return {"v": p["i"] * 10}

    res = R.run_cells(store, cells, run_one, progress=False)
    assert res["ran"] == 4 and res["errors"] == 1
    data = store.load()
    assert data["cells"]["c2"]["error"] == "ValueError: boom" and data["cells"]["c3"]["v"] == 30
    res = R.run_cells(store, cells, run_one, progress=False)
    assert res["ran"] == 0
    # A claim left by a dead process does not block the cell.
    store.put("c0", {})
    data = store.load()
    del data["cells"]["c0"]
    data["claims"] = {"c0": {"pid": 2**22 + 12345, "host": __import__("platform").node(), "t": "x"}}
    (tmp_path / "x.json").write_text(json.dumps(data))
    assert R.run_cells(store, cells, run_one, progress=False)["ran"] == 1


def test_run_cells_calls_after_cell_once_per_stored_cell(tmp_path):
    # run_experiment stamps provenance through this hook, so a partial file carries it too
    store = R.ResultStore(tmp_path / "y.json", "t")
    seen = []
    R.run_cells(store, [(f"c{i}", {"i": i}) for i in range(3)], lambda p: {"v": p["i"]}, progress=False,
                after_cell=lambda: seen.append(sorted(store.load()["cells"])))
    assert seen == [["c0"], ["c0", "c1"], ["c0", "c1", "c2"]]


def test_cli_quick_end_to_end(tmp_path):
    out, md = str(tmp_path / "eval"), str(tmp_path / "results.md")
    common = ["--quick", "--out-dir", out, "--results-md", md, "--no-progress"]
    pk = ["eval", "passkey", *common, "--methods", "full", "nexus", "snapkv", "streaming",
          "--contexts", "640", "--densities", "0.2", "--depths", "0.5", "--n-keys", "1",
          "--haystacks", "grass", "text", "--regimes", "prefill", "decode"]
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    cells = data["cells"]
    # per haystack: full (1) + nexus (2 regimes) + snapkv (prefill-only: 1) + streaming (2)
    assert len(cells) == 12
    assert not any(c["method"] == "snapkv" and c["regime"] == "decode" for c in cells.values())
    assert all("correct" in c and c["prompt_tokens"] > 600 for c in cells.values())
    assert data["meta"]["quick"] is True and "openblas_preloaded" in data["meta"]["machine"]
    # Resume: nothing is re-run; a deleted cell is re-run alone.
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    assert data["runs"][-1]["ran"] == 0
    victim = next(iter(data["cells"]))
    del data["cells"][victim]
    (tmp_path / "eval" / "passkey.json").write_text(json.dumps(data))
    _run(*pk)
    data = json.loads((tmp_path / "eval" / "passkey.json").read_text())
    assert data["runs"][-1]["ran"] == 1 and victim in data["cells"]

    _run("eval", "perplexity", *common, "--methods", "full", "nexus", "streaming", "--densities", "0.2",
         "--n-tokens", "640")
    ppl = json.loads((tmp_path / "eval" / "perplexity.json").read_text())["cells"]
    assert len(ppl) == 3 and all(c.get("ppl", 0) > 1 for c in ppl.values())

    _run("eval", "speed", *common, "--methods", "kvcache", "rotating", "nexus", "--repeats", "3",
         "--decode-tokens", "8")
    sp = json.loads((tmp_path / "eval" / "speed.json").read_text())["cells"]
    assert len(sp) == 1
    per = next(iter(sp.values()))["per_cache"]
    assert set(per) == {"kvcache", "rotating", "nexus"}
    for r in per.values():
        assert len(r["segments"]) == 3 and r["decode_tps"] > 0 and r["prefill_tps"] > 0
    assert per["nexus"]["kv_bytes_end"] < 0.5 * per["kvcache"]["kv_bytes_end"]
    assert per["nexus"]["kv_bytes_end"] <= per["nexus"]["kv_bytes_after_prefill"] * 1.2  # bounded in decode
    # KVCache grows: its kept rows every token, its allocation in steps of 256 rows (640 + 24 stays in 768)
    assert per["kvcache"]["kv_kept_bytes_end"] > per["kvcache"]["kv_kept_bytes_after_prefill"]
    assert per["kvcache"]["kv_bytes_end"] >= per["kvcache"]["kv_bytes_after_prefill"]

    _run("eval", "report", "--out-dir", out, "--results-md", md)
    text = (tmp_path / "results.md").read_text()
    for needle in ("Passkey accuracy", "Streaming perplexity", "Decode throughput", "KV memory", "Reading"):
        assert needle in text
    # Coverage is counted from the cells: grass 640 prefill-only at 20% = nexus, snapkv, streaming on 1 prompt.
    cov = passkey_coverage(json.loads((tmp_path / "eval" / "passkey.json").read_text()))
    assert cov[("grass", 640, "prefill", 0.2)] == {"prompts": 1, "methods": 3, "cells": 3, "errors": 0}
    assert cov[("text", 640, "decode", 0.2)] == {"prompts": 1, "methods": 2, "cells": 2, "errors": 0}
    for fig in ("passkey_accuracy_vs_density.png", "passkey_accuracy_by_depth.png", "perplexity_vs_density.png",
                "speed_memory_vs_context.png"):
        assert (tmp_path / "eval" / fig).exists()


def test_reading_compares_methods_only_where_all_of_them_ran(tmp_path):
    """A method that errors on one haystack (budget too small) must not be averaged over fewer prompts
    than the others: the generated reading compares on the columns where every runnable method ran."""
    cells = {}

    def put(method, hay, ctx, depth, correct=None, error=None):
        c = {"method": method, "haystack": hay, "context": ctx, "depth": depth, "key": "1", "seed": 0,
             "regime": "prefill", "density": None if method == R.FULL else 0.1,
             "prefill_only_method": method == R.FULL}
        c.update({"error": error} if error else {"correct": correct})
        cells[R.cell_id(**c)] = c

    for depth in (0.1, 0.5):
        for ctx in (1024, 2048):
            put(R.FULL, "grass", ctx, depth, True)
            put("snapkv", "grass", ctx, depth, ctx == 1024)  # 100% at 1K, 0% at 2K
        put("nexus", "grass", 1024, depth, error="ValueError: nexus budget too small")
        put("nexus", "grass", 2048, depth, depth == 0.1)  # 50% at 2K
    put("snapkv-ada", "grass", 1024, 0.1, False)  # opt-in Ada row on one prompt only
    data = {"cells": cells, "grid": {}, "meta": {}}
    pk, reading = _passkey_reading(data, tmp_path)
    r = reading[("prefill", 0.1)]
    assert (r["columns"], r["prompts"], r["winners"], r["best"]) == (["grass 2K"], 2, ["nexus"], 0.5)
    assert r["not_run"] == [] and r["rows"] == {"nexus": 0.5, "snapkv": 0.0}
    # 1 prompt only Nexus got right, none only SnapKV: the reading reports it and calls no winner.
    assert _counts(r["paired"]["snapkv"]) == (2, 1, 0, 1.0) and r["ahead"] == r["behind"] == []
    # The partial Ada run neither joins nor shrinks the main table; it gets its own paired table.
    tables = PasskeyGrid(data).tables
    assert tables[(0.1, "prefill", ("grass", 1024))][0]["snapkv"] == (2, 2, 0)
    assert tables[(0.1, "prefill", ("grass", 2048))][0]["snapkv"] == (0, 2, 0)
    assert "snapkv-ada" not in tables[(0.1, "prefill", ("grass", 1024))][0]
    assert pk[("ada", "prefill", 0.1)] == {"snapkv": (1.0, 0.0, 1)}


def test_decode_reading_ranks_only_methods_that_evict_during_the_prompt(tmp_path):
    """In the prefill + decode regime a prefill-only method (snapkv) holds the whole prompt and its row is
    copied from the prefill-only regime; the reading must not call it the best bounded method."""
    cells = {}

    def put(method, regime, depth, correct, prefill_only):
        c = {"method": method, "haystack": "grass", "context": 1024, "depth": depth, "key": "1", "seed": 0,
             "regime": regime, "density": None if method == R.FULL else 0.2, "prefill_only_method": prefill_only,
             "correct": correct}
        cells[R.cell_id(**c)] = c

    for depth in (0.1, 0.5):
        put(R.FULL, "prefill", depth, True, True)
        put("snapkv", "prefill", depth, True, True)  # 100%, copied into the decode regime
        put("nexus", "prefill", depth, True, False)
        put("nexus", "decode", depth, depth == 0.5, False)  # 50%
        put("h2o", "prefill", depth, False, False)
        put("h2o", "decode", depth, False, False)  # 0%
    _, reading = _passkey_reading({"cells": cells, "grid": {}, "meta": {}}, tmp_path)
    dec = reading[("decode", 0.2)]
    assert (dec["winners"], dec["best"], dec["unbounded"]) == (["nexus"], 0.5, ["snapkv"])
    assert "snapkv" not in dec["paired"] and _counts(dec["paired"]["h2o"]) == (2, 1, 0, 1.0)
    # The prefill-only reading still ranks snapkv.
    pre = reading[("prefill", 0.2)]
    assert (set(pre["winners"]), pre["best"], pre["unbounded"]) == ({"snapkv", "nexus"}, 1.0, [])


def test_generatepasskey_spec_names_one_evaluation_prompt():
    import argparse

    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.generate import passkey_spec

    assert passkey_spec("text:2048:0.9:40718") == ("text", 2048, 0.9, "40718")
    for bad in ("grass:1024:0.5", "hay:1024:0.5:1", "grass:10:0.5:1", "grass:1024:1.5:1", "grass:1024:0.5:x1"):
        with pytest.raises(argparse.ArgumentTypeError):
            passkey_spec(bad)
    args = build_parser().parse_args(["generate", "--passkey", "grass:640:0.5:12345", "--method", "nexus"])
    assert args.passkey == ("grass", 640, 0.5, "12345")


def test_reading_calls_a_difference_only_where_mcnemar_supports_it(tmp_path):
    """Nexus right on 10 prompts where H2O fails (p = 2/1024) and SnapKV equal but on other prompts
    (2/2 discordant, p = 1): the reading says ahead of h2o only; the paired table and the block-cut
    table carry the counts."""
    cells = {}

    def put(method, i, correct, cut=None):
        c = {"method": method, "haystack": "grass", "context": 1024, "depth": i / 20, "key": "1", "seed": 0,
             "regime": "prefill", "density": None if method == R.FULL else 0.2,
             "prefill_only_method": method in (R.FULL, "snapkv"), "correct": correct}
        if cut is not None:
            c.update(needle_cut_frac=cut, needle_kept_frac=1 - cut, needle_whole_frac=1 - cut)
        cells[R.cell_id(**c)] = c

    for i in range(12):
        put(R.FULL, i, True, 0.0)
        put("nexus", i, i < 10, 0.0 if i < 10 else 0.5)  # the two misses are cut
        put("h2o", i, False, 0.3)
        put("snapkv", i, 2 <= i < 12)  # 10/12 on other prompts: 2 discordant each way
    data = {"cells": cells, "grid": {}, "meta": {}}
    _, reading = _passkey_reading(data, tmp_path)
    r = reading[("prefill", 0.2)]
    assert (r["ahead"], r["behind"], r["undecided"]) == (["h2o"], [], ["full", "snapkv"])
    h2o = r["paired"]["h2o"]
    assert (h2o["n"], h2o["both"], h2o["only_a"], h2o["only_b"], h2o["neither"]) == (12, 0, 10, 0, 2)
    assert h2o["p"] == pytest.approx(2 / 1024) and _counts(r["paired"]["snapkv"]) == (12, 2, 2, 1.0)
    assert (r["full"], r["prompts"], set(r["winners"]), r["best"]) == (1.0, 12, {"nexus", "snapkv"}, 10 / 12)
    # Block cut: nexus cut on 2 prompts (both wrong), intact on 10 (all right).
    cut = needle_cut_summary(list(cells.values()), "prefill", 0.2)["nexus"]
    assert (cut["n"], cut["cut"], cut["nocut"]) == (12, (0, 2), (10, 10))
    assert cut["cut_mean"] == pytest.approx(1 / 12) and cut["cut_any"] == pytest.approx(2 / 12)
    assert (tmp_path / "passkey_accuracy_ci.png").exists()
    # The reservoir-n study (figures/eval/nexus_seed_n.json) gets its own table when present.
    per = {n: {"p_whole_mean_over_layers": p, "layers_keeping_whole_frac_sd_over_seeds": 0.05}
           for n, p in (("1", 0.47), ("topk", 0.7))}
    (tmp_path / "nexus_seed_n.json").write_text(json.dumps({"seeds": 10, "prompts": {"grass:0.5": {"per_n": per}}}))
    (tmp_path / "passkey.json").write_text(json.dumps(data))
    text = report.write_report(tmp_path, tmp_path / "r.md").read_text()
    assert "| grass:0.5 | 47 ± 5 | 70 ± 5 |" in text  # the one rendered-markdown check (a snapshot row)


def test_passkey_out_name_writes_its_own_file(tmp_path):
    out = tmp_path / "eval"
    _run("eval", "passkey", "--quick", "--out-dir", str(out), "--no-progress", "--no-report", "--methods", "full",
         "--contexts", "640", "--depths", "0.5", "--n-keys", "1", "--regimes", "prefill",
         "--out-name", "study.json")
    assert not (out / "passkey.json").exists()
    data = json.loads((out / "study.json").read_text())
    assert len(data["cells"]) == 1 and "provenance" in data


def test_speed_table_limit_column_pairs_rounds():
    """×limit is decode tok/s over RotatingKVCache's, paired round by round (median [min–max]), not a
    ratio of medians: a cache that is 2× the limit in one round and 0.5× in another reads 1.00× [0.50–2.00]."""
    from veloxquant_mlx.evaluation.report_perf import _speed_block, limit_ratios

    def rec(tps):
        return {"decode_tps": sorted(tps)[1], "prefill_tps": 10.0, "segments": [{"decode_tps": t} for t in tps],
                "kv_bytes_after_prefill": 1, "kv_bytes_end": 1, "kv_kept_bytes_end": 1}

    med = {("kvcache", 1024): rec([4.0, 4.0, 4.0]), ("rotating", 1024): rec([10.0, 4.0, 8.0]),
           ("h2o", 1024): rec([5.0, 8.0, 8.0])}
    assert limit_ratios(med[("h2o", 1024)], med[("rotating", 1024)]) == [0.5, 2.0, 1.0]
    lines = []
    _speed_block(med, lines, [1024], ["kvcache", "rotating", "h2o"], with_peak=False)
    head = lines[0].split(" | ")
    row = lines[4].split(" | ")
    assert lines[4].startswith("| h2o |")
    assert row[head.index("1K ×limit")] == "1.00× [0.50–2.00]"
    assert lines[3].split(" | ")[head.index("1K ×limit")] == "1.00× [1.00–1.00]"
    # CPU time recorded by both: the ratio uses it (the wall clock mostly measures the machine's load)
    for m in med.values():
        for i, seg in enumerate(m["segments"]):
            seg["decode_cpu_tps"] = 3.0 if m is med[("h2o", 1024)] else 4.0
    assert limit_ratios(med[("h2o", 1024)], med[("rotating", 1024)]) == [0.75, 0.75, 0.75]
    lines = []
    _speed_block(med, lines, [1024], ["kvcache", "rotating", "h2o"], with_peak=False)
    assert "1K ×limit (CPU time)" in lines[0] and "| 0.75× [0.75–0.75] |" in lines[4]
    # no limit cache in the run: no ×limit column at all
    lines = []
    _speed_block({k: v for k, v in med.items() if k[0] != "rotating"}, lines, [1024], ["kvcache", "h2o"],
                 with_peak=False)
    assert "×limit" not in lines[0]


def test_user_runs_never_touch_the_published_grid(tmp_path, monkeypatch, capsys):
    """A bare `eval passkey` writes to ./veloxquant_eval, a run into figures/ needs --publish, and
    --max-cells 0 writes nothing anywhere (not even into the published grid it reads)."""
    from pathlib import Path

    from veloxquant_mlx.evaluation.outputs import is_published

    repo = Path(__file__).resolve().parents[1]
    published = repo / "figures" / "eval"
    before = {p: p.read_bytes() for p in published.iterdir() if p.is_file()}
    monkeypatch.chdir(tmp_path)
    small = ["--quick", "--no-progress", "--methods", "full", "--contexts", "640", "--depths", "0.5",
             "--n-keys", "1", "--regimes", "prefill"]
    assert main(["eval", "passkey", "--out-dir", str(published), "--max-cells", "0", "--publish"]) == 0
    assert "nothing written" in capsys.readouterr().out
    assert main(["eval", "passkey", "--max-cells", "0", *small]) == 0 and list(tmp_path.iterdir()) == []
    assert main(["eval", "tasks", "--max-cells", "0", "--quick", "--no-progress"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert main(["eval", "passkey", "--out-dir", str(published / "x"), "--max-cells", "1", *small]) == 2
    assert "--publish" in capsys.readouterr().err and not (published / "x").exists()
    assert {p: p.read_bytes() for p in published.iterdir() if p.is_file()} == before
    assert is_published(published) and not is_published(tmp_path)
    _run("eval", "passkey", "--max-cells", "1", *small)  # the bare command: the user's folder
    data = json.loads((tmp_path / "veloxquant_eval" / "passkey.json").read_text())
    assert len(data["cells"]) == 1 and (tmp_path / "veloxquant_eval" / "results.md").exists()


def test_max_cells_counts_json_records_in_summary_bar_and_file_and_leaves_no_lock(tmp_path, capsys):
    """Prefill-only cells of one prompt share a pass and finish together: --max-cells, the summary's
    'ran', the progress bar and the JSON all count those records, and no lock file is left behind."""
    import re

    out = tmp_path / "runs"
    small = ["--quick", "--methods", "full", "h2o", "snapkv", "--contexts", "640", "--depths", "0.5",
             "--n-keys", "2", "--regimes", "prefill", "--densities", "0.2", "--out-dir", str(out), "--no-report"]
    _run("eval", "passkey", "--max-cells", "2", *small)
    captured = capsys.readouterr()
    data = json.loads((out / "passkey.json").read_text())
    ran = int(re.search(r"'ran': (\d+)", captured.out).group(1))
    assert ran == len(data["cells"]) >= 2  # one prompt's three methods share a pass: 3 records, all counted
    assert ran < 6  # the second prompt never started
    bar = re.findall(r"(\d+)/(\d+) \[", captured.err)[-1]
    assert (int(bar[0]), int(bar[1])) == (ran, 6)
    assert sorted(p.name for p in out.iterdir()) == ["passkey.json"]  # no .lock (nor temporary) file
