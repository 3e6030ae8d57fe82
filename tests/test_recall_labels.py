"""Recall in the evaluation's labels: ``<label>-recall-memory`` / ``-recall-disk`` run the label's spec
with ``recall=``, and a method that cannot keep uniform heads is refused before any run."""

import pytest

from veloxquant_mlx.evaluation.labels import method_specs, spec_of


def test_recall_suffixes_resolve_to_recall_specs():
    assert spec_of("snapkv-recall-disk") == "snapkv:recall=disk"
    assert spec_of("nexus-recall-memory") == "nexus:recall=memory"
    assert spec_of("snapkv-4bit-recall-memory") == "snapkv:kv_bits=4,kv_group_size=64,recall=memory"
    assert spec_of("snapkv-recall-memory-ada") == "snapkv:allocation=ada,recall=memory"
    (spec,) = method_specs(["snapkv-recall-memory"])
    cfg = spec.config(300)
    assert (cfg.method, cfg.budget, cfg.recall, cfg.recall_bits) == ("snapkv", 300, "memory", 4)
    assert spec_of("snapkv") == "snapkv" and spec.config(300).replace(recall=None) == method_specs(["snapkv"])[0].config(300)


def test_recall_labels_that_cannot_run_are_refused_before_any_run():
    with pytest.raises(ValueError, match="uniform per-head storage"):
        method_specs(["snapkv-recall-memory-ada"])
    with pytest.raises(ValueError, match="uniform per-head storage"):
        method_specs(["kvzip-recall-memory"])  # kvzip's default is Ada-KV head budgets
    assert method_specs(["kvzip-each-recall-memory"])[0].config(300).recall == "memory"
    with pytest.raises(ValueError, match="unknown method"):
        spec_of("full-recall-memory")  # mlx-lm's own cache has no cold tier
