"""Figure provenance: per-method behaviour fingerprints and check_figures' stale-quote check."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from veloxquant_mlx.methods.h2o import H2O
from lab import provenance as P
from lab.stamp import stamp_store
from veloxquant_mlx.evaluation.results import ResultStore

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmark_scripts"))
import check_figures  # noqa: E402


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(P, "_cache", {})


def test_fingerprint_is_deterministic_and_per_method(fresh_cache):
    a = P.fingerprint(["h2o", "streaming"])
    P._cache.clear()
    b = P.fingerprint(["h2o-topk", "streaming"])  # labels map to their method
    assert a == b and set(a) == {"h2o", "streaming"}
    assert all(len(h) == 12 and int(h, 16) >= 0 for h in a.values())
    assert a["h2o"] != a["streaming"]
    # each setting has its own key: a figure depends only on what it measured
    c = P.fingerprint(["h2o-ada", "h2o"], regime="stream")
    assert set(c) == {"h2o:ada", "h2o:stream"} and c["h2o:stream"] != a["h2o"]


def test_fingerprint_changes_with_the_kept_set_of_that_method_only(fresh_cache, monkeypatch):
    before = P.fingerprint(["h2o", "streaming"])
    P._cache.clear()
    original = H2O.scores
    monkeypatch.setattr(H2O, "scores", lambda self, view: -original(self, view))  # keep the least attended
    after = P.fingerprint(["h2o", "streaming"])
    assert after["h2o"] != before["h2o"]
    assert after["streaming"] == before["streaming"]


def test_method_of_and_key_of_labels():
    assert P.method_of("nexus-topk") == P.method_of("nexus_topk") == "nexus"
    assert P.method_of("snapkv-ada") == P.method_of("snapkv+ada") == "snapkv"
    assert P.method_of("kvcache") == P.method_of("rotating") == "full"
    assert P.method_of("nope") == "nope"
    assert P.key_of("snapkv+ada") == "snapkv:ada" and P.key_of("nexus-topk", "stream") == "nexus:stream"
    assert P.key_of("full", "stream") == "full" and P.key_of("nexus:stream") == "nexus:stream"


def test_spec_labels_pinning_head_budgets_have_their_own_key():
    # A label pinning Ada's floor / cap is keyed by them, so its figure is checked against that setting's
    # behaviour, not the method's defaults; pinning the defaults gives the defaults' behaviour.
    ref = P.key_of("kvzap:layers=global,allocation=ada,floor_alpha=0.2,max_head_factor=1.1")
    assert ref == "kvzap[floor_alpha=0.2,layers='global',max_head_factor=1.1]:ada" and P.key_of(ref) == ref
    assert P.key_of("snapkv:allocation=ada,floor_alpha=0.5") == "snapkv[floor_alpha=0.5]:ada"
    default = P.key_of("kvzap:layers=global,allocation=ada")
    explicit = P.key_of("kvzap:layers=global,allocation=ada,floor_alpha=0,max_head_factor=2")
    assert default != explicit
    assert P.method_fingerprint(default) == P.method_fingerprint(explicit)  # kvzap's defaults: floor 0, cap 2
    assert P.method_fingerprint(ref) != P.method_fingerprint(default)


def test_stale_methods_and_resumed():
    cur = {"nexus": "a" * 12, "full": "b" * 12}
    assert P.stale_methods({"fingerprint": dict(cur)}, cur) == {}
    assert set(P.stale_methods({"fingerprint": {"nexus": "c" * 12, "full": "b" * 12}}, cur)) == {"nexus"}
    assert "*" in P.stale_methods(None, cur)
    assert "*" in P.stale_methods({"fingerprint": dict(cur), "stale_reason": "old harness"}, cur)
    new = {"commit": "x", "fingerprint": dict(cur)}
    assert "stale_reason" not in P.resumed({"fingerprint": dict(cur)}, new)
    assert "nexus" in P.resumed({"fingerprint": {"nexus": "c" * 12}}, new)["stale_reason"]
    assert "stale_reason" in P.resumed({"stale_reason": "old"}, new)


def test_result_store_stamps_the_methods_of_its_cells(tmp_path, fresh_cache):
    store = ResultStore(tmp_path / "x.json", "passkey")
    store.put("a", {"method": "streaming"})
    store.put("b", {"method": "full"})
    stamp_store(store)
    prov = json.loads((tmp_path / "x.json").read_text())["provenance"]
    assert set(prov["fingerprint"]) == {"streaming", "full"} and "stale_reason" not in prov
    assert prov["fingerprint"] == P.fingerprint(["streaming", "full"])
    # a later run that extends the file keeps it fresh only while the code is the same
    data = json.loads((tmp_path / "x.json").read_text())
    data["provenance"]["fingerprint"]["streaming"] = "0" * 12
    (tmp_path / "x.json").write_text(json.dumps(data))
    stamp_store(store)
    assert "streaming" in json.loads((tmp_path / "x.json").read_text())["provenance"]["stale_reason"]


def test_a_run_cut_short_keeps_the_provenance_of_the_cells_it_stored(tmp_path, fresh_cache):
    from veloxquant_mlx.evaluation.outputs import RunControl
    from veloxquant_mlx.evaluation.results import run_experiment

    store = ResultStore(tmp_path / "x.json", "passkey")
    cells = [("a", {"method": "full"}), ("b", {"method": "streaming"})]

    def run_one(params):  # the process dies (a session ends) on the second cell
        if params["method"] == "streaming":
            raise KeyboardInterrupt
        return {"correct": True}

    with pytest.raises(KeyboardInterrupt):
        run_experiment(store, cells, run_one, RunControl(out_dir=str(tmp_path), progress=False, stamp=stamp_store))
    data = json.loads((tmp_path / "x.json").read_text())
    assert list(data["cells"]) == ["a"]
    assert data["provenance"]["fingerprint"] == P.fingerprint(["full"])


def _figure(root: Path, rel: str, prov):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"x": 1, **({"provenance": prov} if prov is not None else {})}))


def _doc(root: Path, rel: str, text: str):
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def test_check_figures_flags_a_quoted_stale_figure_and_passes_fresh_ones(tmp_path):
    cur = {"streaming": "a" * 12, "full": "b" * 12}
    _figure(tmp_path, "figures/fresh.json", {"commit": "c", "fingerprint": dict(cur)})
    _figure(tmp_path, "figures/sub/old.json", {"commit": "c", "fingerprint": {"streaming": "f" * 12}})
    _figure(tmp_path, "figures/none.json", None)
    _doc(tmp_path, "README.md", "Speed: see `figures/fresh.json`.\n")
    _doc(tmp_path, "docs/a/b.md", "Nothing quoted here.\n")
    res = check_figures.check(tmp_path, current=cur)
    assert set(res["fresh"]) == {"figures/fresh.json"}
    assert set(res["stale"]) == {"figures/sub/old.json", "figures/none.json"}
    assert res["failing"] == []

    _doc(tmp_path, "docs/a/b.md", "intro\nRetention 0.42 (figures/sub/old.json)\n")
    res = check_figures.check(tmp_path, current=cur)
    assert res["failing"] == [("figures/sub/old.json", "docs/a/b.md", 2)]
    assert "figures/sub/old.json" in check_figures.report(res)

    # a quote that tells the reader the figure is stale is listed, not failing
    _doc(tmp_path, "docs/a/b.md", "Retention 0.42 (figures/sub/old.json, stale: before the fix)\n")
    res = check_figures.check(tmp_path, current=cur)
    assert res["failing"] == [] and res["quotes"]["figures/sub/old.json"] == [("docs/a/b.md", 1, True)]


def test_check_figures_main_exit_code(tmp_path, monkeypatch):
    monkeypatch.setattr(check_figures, "fingerprint", lambda: {"streaming": "a" * 12})
    _figure(tmp_path, "figures/old.json", {"commit": "c", "fingerprint": {"streaming": "f" * 12}})
    _doc(tmp_path, "docs/x.md", "figures/old.json says 3x\n")
    assert check_figures.main(["--root", str(tmp_path)]) == 1
    _doc(tmp_path, "docs/x.md", "no quote\n")
    assert check_figures.main(["--root", str(tmp_path)]) == 0


def test_generated_report_names_its_source_and_says_when_it_is_stale(tmp_path, fresh_cache):
    from lab.report import _source_line

    lines = []
    _source_line(tmp_path, "speed", {"cells": {}}, lines)  # no provenance
    fresh = {"provenance": {"commit": "abc", "date": "2026-12-01", "fingerprint": P.fingerprint(["streaming"])}}
    _source_line(tmp_path, "passkey", fresh, lines)
    path = (tmp_path / "speed.json").as_posix()
    assert path in lines[0] and "stale" in lines[0]
    assert (tmp_path / "passkey.json").as_posix() in lines[1] and "stale" not in lines[1]


def test_stamp_keeps_what_an_older_provenance_recorded():
    new = {"commit": "bbbbbbbbbbbb", "command": "c", "date": "d", "fingerprint": {"h2o": "x"}, "note": "stamped"}
    old = {"commit": "aaaaaaaaaaaa", "dirty": True, "blas": "OpenBLAS", "note": "4K: round 1", "fingerprint": {}}
    out = check_figures.merged(old, new)
    assert out["fingerprint"] == {"h2o": "x"} and out["commit"] == "bbbbbbbbbbbb" and out["blas"] == "OpenBLAS"
    assert out["recorded_commit"] == "aaaaaaaaaaaa" and out["recorded_dirty"] is True and "dirty" not in out
    assert "4K: round 1" in out["note"] and out["note"].startswith("stamped")
    assert check_figures.merged(None, new) == new


def test_labels_that_pin_options_get_their_own_key(fresh_cache):
    """nexus-reservoir pins prompt_top_k=False: its key hashes that config, so its cells stay fresh when
    Nexus's default moves, and the key differs from the default's exactly when behaviour does."""
    from lab.stamp import pinned_options

    opts = pinned_options("nexus-reservoir")
    assert opts == {"prompt_top_k": False} and pinned_options("nexus") is None and pinned_options("nope") is None
    key = P.key_of("nexus-reservoir", options=opts)
    assert key == "nexus[prompt_top_k=False]" and P.key_of(key) == key
    assert P.key_of("nexus-reservoir", "stream", opts) == "nexus[prompt_top_k=False]:stream"
    assert P.method_fingerprint(key) != P.method_fingerprint("nexus")  # the default is top-K at the one shot
    assert P.method_fingerprint("nexus[prompt_top_k=True]") == P.method_fingerprint("nexus")
    with pytest.raises(ValueError):
        P.method_fingerprint("nexus[no_such_option=1]")


def test_a_label_naming_a_real_models_scorer_fingerprints_its_file(tmp_path):
    # a kvzap label with scorer=FILE (fitted for another model than the tiny fingerprint model) hashes
    # the method's code on the tiny model plus the file's bytes: no error, and a changed file shows
    from lab.provenance import key_of, method_fingerprint
    from veloxquant_mlx.methods.kvzap.scorer import SHIPPED_DIR

    f = tmp_path / "s.safetensors"
    f.write_bytes((SHIPPED_DIR / "smollm2-135m.safetensors").read_bytes())
    key = key_of(f"kvzap:scorer={f}", "end")
    before = method_fingerprint(key)
    assert before != method_fingerprint("kvzap")
    g = tmp_path / "t.safetensors"
    g.write_bytes(f.read_bytes() + b" ")
    assert method_fingerprint(key_of(f"kvzap:scorer={g}", "end")) not in (before, method_fingerprint("kvzap"))


def test_a_pinned_commit_is_the_tree_the_run_started_from(monkeypatch, tmp_path):
    """A long run stamps the commit it started from: after ``pin_commit`` a HEAD that moves (here: the
    checkout itself gone) does not change what ``commit`` says."""
    monkeypatch.setattr(P, "_PINNED", [])
    monkeypatch.delenv("VELOXQUANT_COMMIT", raising=False)
    started = P.pin_commit()
    assert started == P.commit() and started != "unknown"
    monkeypatch.setattr(P, "_REPO", tmp_path)  # no git here: unpinned, commit() would say "unknown"
    assert P.commit() == started
    P._PINNED.clear()
    assert P.commit() == "unknown"
