"""A cold tier's bytes in kv_report and serve's request log, and its disk files' lifetime: freed with the
serve store's dropped entries and at a normal interpreter exit."""

import gc
import os
import subprocess
import sys

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheBuilder
from veloxquant_mlx.caches.accounting import COLD_KEYS, kv_report

from conftest import make_tiny_model, random_prompt, small_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", hidden_size=128)  # head_dim 32


def _turns(model, caches, n=2):
    """A prompt that evicts, then ``n - 1`` follow-ups (each recalls), with a few decode steps each."""
    for i in range(n):
        for c in caches:
            c.continue_on_purpose()
        model(mx.array([random_prompt(90 if i == 0 else 12, seed=i)]), cache=caches)
        for t in range(3):
            model(mx.array([[5 + t]]), cache=caches)


@pytest.mark.parametrize("tier", ["memory", "disk"])
def test_kv_report_splits_hot_cold_disk_and_summary_bytes(tier, model, tmp_path):
    kw = {"recall_dir": str(tmp_path)} if tier == "disk" else {}
    caches = KVCacheBuilder.for_model(model, small_config("snapkv", recall=tier, recall_page=8, **kw))
    _turns(model, caches)
    kv = kv_report(caches)
    for key in COLD_KEYS:  # the per-layer reports, summed
        assert kv[key] == sum(c.byte_report()[key] for c in caches), key
    assert kv["hot_bytes"] + kv["cold_resident_bytes"] + kv["summary_bytes"] == kv["allocated_bytes"]
    assert kv["summary_bytes"] > 0 and kv["hot_bytes"] > 0
    if tier == "disk":
        assert kv["cold_disk_bytes"] == sum(os.path.getsize(c.cold.path) for c in caches) > 0
    else:
        assert kv["cold_disk_bytes"] == 0 and kv["cold_resident_bytes"] > 0
    plain = KVCacheBuilder.for_model(model, small_config("snapkv"))
    _turns(model, plain)
    assert not set(COLD_KEYS) & set(kv_report(plain))  # without recall the report has no cold keys


def test_serve_request_log_names_the_cold_tier(model, tmp_path):
    from veloxquant_mlx.cli.serve_memory import mib, request_log_line

    caches = KVCacheBuilder.for_model(model, small_config("snapkv", recall="disk", recall_page=8,
                                                          recall_dir=str(tmp_path)))
    _turns(model, caches)
    kv = kv_report(caches)
    line = request_log_line(caches[0].offset, caches)
    assert (f"recall: hot {mib(kv['hot_bytes'])}, cold resident {mib(kv['cold_resident_bytes'])}, "
            f"summaries {mib(kv['summary_bytes'])}, on disk {mib(kv['cold_disk_bytes'])}") in line
    plain = KVCacheBuilder.for_model(model, small_config("snapkv"))
    _turns(model, plain)
    assert "recall" not in request_log_line(plain[0].offset, plain)


def test_serve_store_frees_the_files_of_a_dropped_conversation(model, tmp_path):
    """mlx-lm's prompt cache (serve's LRU store) drops the oldest conversation when the next does not
    fit: its caches are let go, and with them their cold tier's files."""
    from veloxquant_mlx.cli.serve_memory import prompt_cache_class

    cfg = small_config("snapkv", recall="disk", recall_page=8, recall_dir=str(tmp_path))
    convs = []
    for _ in range(2):
        caches = KVCacheBuilder.for_model(model, cfg)
        _turns(model, caches)
        convs.append(caches)
    paths = [[c.cold.path for c in caches] for caches in convs]
    assert all(os.path.getsize(p) > 0 for ps in paths for p in ps)
    store = prompt_cache_class()(1)  # one conversation at most
    for i, caches in enumerate(convs):
        store.insert_cache("m", [i + 1] * 40, caches)
    del caches, convs
    gc.collect()
    assert not any(os.path.exists(p) for p in paths[0])  # the dropped conversation's files are gone
    assert all(os.path.exists(p) for p in paths[1])  # the stored one keeps its own
    store.trim_to(n_sequences=0)
    gc.collect()
    assert not any(os.path.exists(p) for p in paths[1])


def test_files_are_removed_at_a_normal_exit_while_the_cache_is_alive(tmp_path):
    script = f"""
import sys
sys.path.insert(0, {os.path.join(REPO, "tests")!r})
from test_recall_accounting import _turns
from conftest import make_tiny_model, small_config
from veloxquant_mlx import KVCacheBuilder
model = make_tiny_model("llama", hidden_size=128)
caches = KVCacheBuilder.for_model(model, small_config("snapkv", recall="disk", recall_page=8,
                                                      recall_dir={str(tmp_path)!r}))
_turns(model, caches)
assert all(c.cold.disk_bytes > 0 for c in caches)
print("\\n".join(c.cold.path for c in caches))
KEEP = caches  # alive at exit: only the exit handler can remove the files
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    paths = proc.stdout.split()
    assert len(paths) == 2 and all(os.path.dirname(p) == str(tmp_path) for p in paths)
    assert not any(os.path.exists(p) for p in paths)
    assert not list(tmp_path.iterdir())


def test_serve_with_recall_serves_sequentially_and_says_why(model, caplog):
    """A cold tier per conversation is not wired into a batch's shared buffers: serve's provider turns
    continuous batching off and logs the reason, instead of failing at the first merge."""
    from veloxquant_mlx.cli.serve import _model_provider_class, server_args

    from conftest import tiny_tokenizer

    config = small_config("snapkv", recall="memory", recall_page=8)
    provider = _model_provider_class()(server_args(model="tiny"), model, tiny_tokenizer(), config)
    try:
        with caplog.at_level("INFO", logger="veloxquant_mlx.serve"):
            provider.load("default_model")
        assert not provider.is_batchable
        assert "off (sequential requests: EvictionCache cannot batch: recall='memory' keeps a cold tier" in caplog.text
    finally:
        KVCacheBuilder.uninstall(model)
    plain = _model_provider_class()(server_args(model="tiny"), model, tiny_tokenizer(), small_config("snapkv"))
    try:
        plain.load("default_model")
        assert plain.is_batchable
    finally:
        KVCacheBuilder.uninstall(model)


def test_batch_generate_refuses_caches_with_a_cold_tier(model):
    """mlx-lm's batch_generate merges per-sequence caches; ours with a cold tier have no merge, so it
    refuses before generating anything (mlx-lm's own message) rather than batching them wrongly."""
    from mlx_lm.generate import batch_generate

    from conftest import tiny_tokenizer

    KVCacheBuilder.install(model, small_config("snapkv", recall="memory", recall_page=8))
    try:
        with pytest.raises(ValueError, match="does not yet support batching"):
            batch_generate(model, tiny_tokenizer(), [random_prompt(60, seed=1), random_prompt(40, seed=2)],
                           max_tokens=4)
    finally:
        KVCacheBuilder.uninstall(model)
