"""End-to-end checks of the real-model evaluation harness on ``--quick`` (tiny random llama, byte
tokenizer): cells are written, a re-run skips finished cells, errors become cells, and an eviction
cache whose budget covers the whole sequence equals the full cache (the lab's report on the same
runs: lab/tests/test_report_passkey.py)."""

from __future__ import annotations

import json

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from veloxquant_mlx.cli import main  # noqa: E402
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


def test_a_run_prints_each_caches_accuracy_with_its_interval_as_it_goes_and_at_the_end(tmp_path, capsys):
    from veloxquant_mlx.evaluation.outputs import RunControl

    store = R.ResultStore(tmp_path / "p.json", "passkey")
    right = {"full": [True, True, True, True], "nexus": [True, False, True, False]}
    cells = [(f"{m}{i}", {"method": m, "density": None if m == "full" else 0.2, "i": i})
             for i in range(4) for m in right]

    def run_one(p):
        return {"correct": right[p["method"]][p["i"]]} if p["i"] < 3 else {"error": "ValueError: budget"}

    R.run_experiment(store, cells, run_one, RunControl(out_dir=str(tmp_path), progress=False, note_every=0))
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("passkey so far: ")]
    assert len(notes) == len(cells)  # one per finished cell with note_every=0
    assert notes[0] == "passkey so far: full 1/1 100% [21, 100]"
    assert notes[5] == "passkey so far: full 3/3 100% [44, 100] | nexus 2/3 67% [21, 94]"
    table = out[out.index("accuracy (right / answered, Wilson 95 % interval):"):].splitlines()
    assert table[1].split() == ["full", "3/3", "100.0%", "[43.9,", "100.0]"]  # the errored cells are no answers
    assert table[2].split() == ["nexus", "2/3", "66.7%", "[20.8,", "93.9]"]
    rows = R.accuracy_rows([{"method": "nexus", "density": d, "regime": "decode", "correct": c}
                            for d, c in ((0.1, False), (0.2, True), (0.2, True))])
    assert rows == [("nexus (density 0.1)", 0, 1), ("nexus (density 0.2)", 2, 2)]  # names what varies only


@pytest.mark.parametrize("argv,pattern", [
    (["passkey", "--contexts", "-5"], "--contexts: must be >= 64, got -5"),
    (["passkey", "--densities", "2"], r"--densities: must be in \(0, 1\], got 2"),
    (["passkey", "--densities", "0"], r"--densities: must be in \(0, 1\], got 0"),
    (["passkey", "--depths", "1.5"], r"--depths: must be in \[0.0, 1.0\], got 1.5"),
    (["passkey", "--n-keys", "0"], "--n-keys: must be >= 1"),
    (["passkey", "--time-budget", "-1"], "--time-budget: must be >= 0.0"),
    (["perplexity", "--densities", "1.5"], r"--densities: must be in \(0, 1\]"),
    (["speed", "--density", "2"], r"--density: must be in \(0, 1\]"),
    (["speed", "--repeats", "0"], "--repeats: must be >= 1"),
    (["tasks", "--densities", "-0.2"], r"--densities: must be in \(0, 1\]"),
    (["tasks", "--n-facts", "5"], r"--n-facts: must be in \[2, 4\]")])
def test_eval_refuses_values_out_of_range_in_one_line(tmp_path, capsys, argv, pattern):
    import re

    # --quick --max-cells 0: were the value taken, a dry run on the tiny model would answer at once
    assert main(["eval", *argv, "--out-dir", str(tmp_path), "--quick", "--max-cells", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and re.search(pattern, err), err
    assert list(tmp_path.iterdir()) == []  # refused before anything is written


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


def test_passkey_out_name_writes_its_own_file(tmp_path):
    out = tmp_path / "eval"
    _run("eval", "passkey", "--quick", "--out-dir", str(out), "--no-progress", "--methods", "full",
         "--contexts", "640", "--depths", "0.5", "--n-keys", "1", "--regimes", "prefill",
         "--out-name", "study.json")
    assert not (out / "passkey.json").exists()
    data = json.loads((out / "study.json").read_text())
    # a user's run writes its cells and no report; the repository's provenance stamp is the lab's (python -m lab eval)
    assert len(data["cells"]) == 1 and "provenance" not in data and not (out / "results.md").exists()


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
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "PUBLISHED").write_text("")
    assert is_published(tmp_path / "mine" / "a" / "b") and not is_published(tmp_path)
    (tmp_path / "mine" / "PUBLISHED").unlink()
    (tmp_path / "mine").rmdir()
    _run("eval", "passkey", "--max-cells", "1", *small)  # the bare command: the user's folder
    data = json.loads((tmp_path / "veloxquant_eval" / "passkey.json").read_text())
    assert len(data["cells"]) == 1 and not (tmp_path / "veloxquant_eval" / "results.md").exists()  # reports: the lab


def test_max_cells_counts_json_records_in_summary_bar_and_file_and_leaves_no_lock(tmp_path, capsys):
    """Prefill-only cells of one prompt share a pass and finish together: --max-cells, the summary's
    'ran', the progress bar and the JSON all count those records, and no lock file is left behind."""
    import re

    out = tmp_path / "runs"
    small = ["--quick", "--methods", "full", "h2o", "snapkv", "--contexts", "640", "--depths", "0.5",
             "--n-keys", "2", "--regimes", "prefill", "--densities", "0.2", "--out-dir", str(out)]
    _run("eval", "passkey", "--max-cells", "2", *small)
    captured = capsys.readouterr()
    data = json.loads((out / "passkey.json").read_text())
    ran = int(re.search(r"'ran': (\d+)", captured.out).group(1))
    assert ran == len(data["cells"]) >= 2  # one prompt's three methods share a pass: 3 records, all counted
    assert ran < 6  # the second prompt never started
    bar = re.findall(r"(\d+)/(\d+) \[", captured.err)[-1]
    assert (int(bar[0]), int(bar[1])) == (ran, 6)
    table = captured.out.split("accuracy (right / answered, Wilson 95 % interval):\n")[1].splitlines()
    assert [row.split()[0] for row in table] == ["full", "h2o", "snapkv"]  # the end's accuracy per cache
    assert all(re.fullmatch(r"\s+\S+\s+[01]/1\s+[\d.]+% \[[\d.]+, [\d.]+\]", row) for row in table), table
    assert sorted(p.name for p in out.iterdir()) == ["passkey.json"]  # no .lock (nor temporary) file
