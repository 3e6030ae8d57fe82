"""Evaluation labels (evaluation/labels.py): a label keeps meaning exactly what its cells ran.

``tests/data/labels_before.json`` was written by the label code that preceded the ``{label: spec}``
table (MethodSpec fields + ABLATIONS + suffix rules), for every base label x every suffix and the
suffix pairs figures use: what each resolved to (method, full / rotating, quantization, pinned options)
and its KVCacheConfig at budget 512 (options: only those that differ from the method's defaults), or
that the label was refused.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from veloxquant_mlx.config import KVCacheConfig
from lab.stamp import pinned_options
from veloxquant_mlx.evaluation import labels as L
from veloxquant_mlx.registry import get_method

BEFORE = json.loads((Path(__file__).parent / "data" / "labels_before.json").read_text())


def _changed_options(d: dict) -> dict:
    dflt = {k: (list(v) if isinstance(v, tuple) else v)
            for k, v in dataclasses.asdict(get_method(d["method"]).Options()).items()}
    return {k: v for k, v in d["options"].items() if v != dflt[k]}


@pytest.mark.parametrize("label", sorted(BEFORE))
def test_label_resolves_as_before(label):
    before = BEFORE[label]
    if before.get("label_error"):
        plain = BEFORE.get(label.replace("-ada", ""), {})
        if "-ada" in label and plain.get("method") and get_method(plain["method"]).supports_allocation("ada"):
            # "-ada" is a suffix for every label now (before, only "<method>-ada"): new labels, old ones unchanged
            plain = L.method_specs([label.replace("-ada", "")])[0]
            assert L.method_specs([label])[0].config(512) == plain.config(512, allocation="ada")
            return
        with pytest.raises(ValueError, match="unknown method"):
            L.method_specs([label])
        return
    spec = L.method_specs([label])[0]
    pinned = pinned_options(label)
    got = {"method": spec.method, "is_full": spec.is_full, "mlx_cache": spec.mlx_cache, "quant": list(spec.quant),
           "pinned": repr(sorted(pinned.items())) if pinned else None, "prefill_only": spec.prefill_only}
    assert got == {k: v for k, v in before.items() if k != "config"}
    if spec.method is None:
        assert "config" not in before
        return
    d = spec.config(512, seed=0, prompt_eviction="end").to_dict()
    d["options"] = _changed_options(d)
    assert d == before["config"]["512"]


def test_every_figure_label_is_pinned():
    """The labels published figures carry are all in the pinned set (so none can drift unseen)."""
    figures = Path(__file__).resolve().parents[1] / "figures"
    seen = set()
    for p in figures.rglob("*.json"):
        try:
            data = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        cells = data.get("cells") if isinstance(data, dict) else None
        for c in cells.values() if isinstance(cells, dict) else cells if isinstance(cells, list) else ():
            if isinstance(c, dict):
                seen |= {c["method"]} if isinstance(c.get("method"), str) else set()
    seen -= {"kvcache"}  # the speed harness's name for mlx-lm's KVCache, not a label

    def pins_itself(label):  # a spec string means what it spells; a pinned label plus a suffix, that suffix's field
        if ":" in label:
            return L.method_specs([label])[0].method is not None
        return any(label.endswith(s) and label[:-len(s)] in BEFORE for s in L.SUFFIXES)

    loose = sorted(label for label in seen - set(BEFORE) if not pins_itself(label))
    assert seen and not loose, loose


def test_table_is_spec_strings():
    """Every label of the table is a plain spec string that the config grammar parses, and a label's
    config is the spec's config (no side channel)."""
    for label, spec in {**L.ABLATIONS, **L.OPT_IN_ABLATIONS, **L.VARIANTS}.items():
        if spec == L.ROTATING:
            continue
        assert L.spec_of(label) == spec
        assert L.MethodSpec(label, spec).config(512) == KVCacheConfig.parse(spec, budget=512)
    assert L.spec_of("snapkv-ada") == "snapkv:allocation=ada"
    assert L.spec_of("nexus-4bit-g32") == "nexus:kv_bits=4,kv_group_size=32"  # a later suffix wins
    assert L.spec_of("full-4bit") == "full:kv_bits=4,kv_group_size=64"


def test_suffixes_apply_to_any_method_label():
    """A suffix is a rule of the grammar, so it applies to labels that had no entry before (a new
    method, an ablation) and a method that refuses the field refuses the label."""
    spec = L.method_specs(["nexus-topk-ada"])[0]
    assert spec.opts == {"n_samples": None} and spec.allocation == "ada"
    assert spec.config(256).allocation == "ada"
    with pytest.raises(ValueError, match="allocation='ada' is not supported by method 'streaming'"):
        L.method_specs(["streaming-ada"])
    with pytest.raises(ValueError, match="valid keys for full: kv_bits, kv_group_size"):
        L.method_specs(["full-ada"])
    with pytest.raises(ValueError, match="rotating takes no suffix"):
        L.method_specs(["rotating-8bit"])


def test_a_spec_is_a_label_with_the_fingerprint_key_of_its_setting():
    from lab.provenance import key_of

    spec = L.method_specs(["nexus:n_samples=none"])[0]
    assert spec.config(512) == L.method_specs(["nexus-topk"])[0].config(512)
    pinned = pinned_options("nexus:n_samples=none")
    assert key_of("nexus:n_samples=none", options=pinned) == key_of("nexus-topk", options=pinned_options("nexus-topk"))
    assert key_of("snapkv:allocation=ada") == key_of("snapkv-ada") == "snapkv:ada"
    assert key_of("h2o:kv_bits=4", "stream") == "h2o:stream" and key_of("full:kv_bits=4") == "full"
    with pytest.raises(ValueError, match="unknown key 'windw'"):
        L.method_specs(["nexus:windw=8"])
