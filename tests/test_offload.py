"""prompt_eviction="offload": the paged prompt (caches/pages.py).

Every registered method that works under "end" gives "end"'s tokens and prompt-end logits under
"offload" (the prompt is read exactly, then compressed exactly as "end" does); a chunk never holds its
prefix in memory; a follow-up input re-selects from every row; the page files never outlive their
caches (free, exit, SIGKILL then reopen); bad folders and full disks fail in one line.
"""

import gc
import glob
import os
import signal
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, load_prompt_cache, methods, save_prompt_cache
from veloxquant_mlx.caches import scratch_files

from conftest import greedy, make_tiny_model, random_prompt, small_config

METHODS = sorted(methods())


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("qwen3", head_dim=32)  # head_dim 32: quantized rows fit in groups of 32


def _config(method, policy, page_dir, **kw):
    extra = {"page_dir": str(page_dir)} if policy == "offload" else {}
    return small_config(method, budget=kw.pop("budget", 48), prompt_eviction=policy, **extra, **kw)


def _pages_in(folder):
    return glob.glob(os.path.join(str(folder), "veloxquant-pages-*"))


@pytest.mark.parametrize("allocation", ["uniform", "ada"])
@pytest.mark.parametrize("method", METHODS)
def test_offload_gives_the_tokens_and_logits_of_end(method, allocation, model, tmp_path):
    if not small_config(method).method_class.supports_allocation(allocation):
        pytest.skip(f"{method} has no {allocation} allocation")
    prompt = random_prompt(150, seed=7)
    out = {}
    for policy in ("end", "offload"):
        caches = KVCacheBuilder.for_model(model, _config(method, policy, tmp_path, allocation=allocation))
        out[policy] = greedy(model, prompt, max_tokens=8, prompt_cache=caches, prefill_step_size=32)
        assert all(c.evictions >= 1 for c in caches)
    (t_end, lp_end), (t_off, lp_off) = out["end"], out["offload"]
    assert t_off == t_end
    assert np.abs(lp_off - lp_end).max() <= 1e-4


@pytest.mark.parametrize("spec", ["snapkv:kv_bits=8,kv_group_size=32", "h2o:kv_bits=4,kv_group_size=32",
                                  "kvzap:kv_bits=8,kv_group_size=32,layers=global"])
def test_offload_with_quantized_rows_gives_the_tokens_of_end(spec, model, tmp_path):
    prompt = random_prompt(150, seed=8)
    toks = {}
    for policy in ("end", "offload"):
        extra = {"page_dir": str(tmp_path)} if policy == "offload" else {}
        cfg = KVCacheConfig.parse(spec, budget=48, prompt_eviction=policy, **extra)
        toks[policy] = greedy(model, prompt, max_tokens=8, prompt_cache=KVCacheBuilder.for_model(model, cfg),
                              prefill_step_size=32)[0]
    assert toks["offload"] == toks["end"]


def test_a_chunk_never_holds_its_prefix_and_every_row_is_paged(model, tmp_path):
    caches = KVCacheBuilder.for_model(model, _config("h2o", "offload", tmp_path))
    held = []
    originals = [c.update_and_fetch for c in caches]

    def recording(c, fn):
        def update_and_fetch(k, v):
            out = fn(k, v)
            held.append((k.shape[2], out[0].shape[2]))
            return out
        return update_and_fetch

    for c, fn in zip(caches, originals):
        c.update_and_fetch = recording(c, fn)
    prompt = random_prompt(200, seed=9)
    greedy(model, prompt, max_tokens=4, prompt_cache=caches, prefill_step_size=32)
    prompt_steps = [(s, rows) for s, rows in held if s > 1]
    assert prompt_steps and all(rows == s for s, rows in prompt_steps)  # attention got the chunk alone
    for c in caches:
        rep = c.byte_report()
        assert rep["paged_rows"] == len(prompt)  # the file holds every prompt row
        assert rep["page_disk_bytes"] > 0 and rep["page_bytes_read"] > 0
        assert c.size() <= c.budget + c.slack  # and the hot cache is at its budget after the prompt


def test_h2o_accumulated_attention_over_the_file_equals_end(model, tmp_path):
    prompt = random_prompt(120, seed=10)
    scores = {}
    for policy in ("end", "offload"):
        caches = KVCacheBuilder.for_model(model, _config("h2o", policy, tmp_path, budget=4096))
        greedy(model, prompt, max_tokens=1, prompt_cache=caches, prefill_step_size=32)
        scores[policy] = np.array(caches[1].stored("score"))
    assert scores["end"].shape == scores["offload"].shape
    assert np.abs(scores["end"] - scores["offload"]).max() <= 1e-4


def test_a_follow_up_reselects_from_every_row(model, tmp_path):
    caches = KVCacheBuilder.for_model(model, _config("snapkv", "offload", tmp_path))
    first, second = random_prompt(160, seed=11), random_prompt(60, seed=12)
    greedy(model, first, max_tokens=4, prompt_cache=caches, prefill_step_size=32)
    kept_first = [set(np.array(c.kept_positions()).ravel().tolist()) for c in caches]
    seen_first = caches[0].offset
    for c in caches:
        c.continue_on_purpose()
    greedy(model, second, max_tokens=4, prompt_cache=caches, prefill_step_size=32)
    back = 0
    for c, before in zip(caches, kept_first):
        assert c.byte_report()["paged_rows"] == c.offset - 4  # every row but the second answer's 4 decode rows
        now = set(np.array(c.kept_positions()).ravel().tolist()) - {-1}
        back += len({p for p in now if p < seen_first} - before)  # dropped by turn 1, picked by turn 2
    assert back > 0


def _feed(model, caches, tokens, step=32):
    """An input as mlx_lm.generate feeds it: chunks of ``step``, then its last token alone."""
    for i in range(0, len(tokens) - 1, step):
        model(mx.array([tokens[i:min(i + step, len(tokens) - 1)]]), cache=caches)
    return model(mx.array([tokens[-1:]]), cache=caches)[0, -1]


def test_a_follow_up_reads_the_history_exactly(model, tmp_path):
    """A second input attends to every earlier row, read back from the file, although the first input's
    end compressed the hot cache: its last logits equal the full cache's over both inputs."""
    from mlx_lm.models.cache import make_prompt_cache

    first, second = random_prompt(140, seed=13), random_prompt(50, seed=14)
    caches = KVCacheBuilder.for_model(model, _config("snapkv", "offload", tmp_path))
    _feed(model, caches, first)
    assert all(c.size() < len(first) for c in caches)  # compressed
    for c in caches:
        c.continue_on_purpose()
    logits = _feed(model, caches, second)
    full = make_prompt_cache(model)
    _feed(model, full, first)
    ref = _feed(model, full, second)
    assert np.abs(np.array(logits) - np.array(ref)).max() <= 1e-4


def test_a_follow_up_without_continue_on_purpose_warns_and_reads_as_one_that_says_so(model, tmp_path):
    """A cache reused after decoding without ``continue_on_purpose()`` warns, as any cache does, and its new
    input (paged chunks, then the last token alone) is read exactly as a cache told so reads it."""
    first, second = random_prompt(140, seed=13), random_prompt(50, seed=14)
    told, untold = (KVCacheBuilder.for_model(model, _config("snapkv", "offload", tmp_path)) for _ in range(2))
    for cs in (told, untold):
        y = _feed(model, cs, first)
        for t in (3, 7, 11):  # the same decode tokens in both
            y = model(mx.array([[t]]), cache=cs)[0, -1]
        mx.eval(y)
    for c in told:
        c.continue_on_purpose()
    ref = _feed(model, told, second)
    with pytest.warns(UserWarning, match="continue_on_purpose"):
        logits = _feed(model, untold, second)
    assert np.abs(np.array(logits) - np.array(ref)).max() <= 1e-6


def test_save_and_load_keep_the_hot_rows_and_a_new_input_pages_them(model, tmp_path):
    caches = KVCacheBuilder.for_model(model, _config("nexus", "offload", tmp_path))
    greedy(model, random_prompt(150, seed=15), max_tokens=3, prompt_cache=caches, prefill_step_size=32)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, caches)
    loaded = load_prompt_cache(path, model=model)
    tok = [int(mx.argmax(model(mx.array([[5]]), cache=caches)[:, -1], axis=-1).item())]
    tok2 = [int(mx.argmax(model(mx.array([[5]]), cache=loaded)[:, -1], axis=-1).item())]
    assert tok == tok2
    for c in loaded:
        c.continue_on_purpose()
    tokens, lp = greedy(model, random_prompt(40, seed=16), max_tokens=3, prompt_cache=loaded, prefill_step_size=32)
    assert np.isfinite(lp).all()
    assert all(c.byte_report()["paged_rows"] >= c.budget for c in loaded)  # its kept rows joined the file


def test_page_files_go_when_the_caches_do(model, tmp_path):
    caches = KVCacheBuilder.for_model(model, _config("h2o", "offload", tmp_path))
    greedy(model, random_prompt(100, seed=17), max_tokens=2, prompt_cache=caches, prefill_step_size=32)
    assert len(_pages_in(tmp_path)) == len(caches)
    del caches
    gc.collect()
    assert _pages_in(tmp_path) == []


_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {tests!r})
    from conftest import make_tiny_model, greedy, random_prompt
    from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig
    model = make_tiny_model("qwen3", head_dim=32)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="h2o", budget=48, prompt_eviction="offload",
                                                           page_dir={folder!r}))
    greedy(model, random_prompt(100, seed=1), max_tokens=2, prompt_cache=caches, prefill_step_size=32)
    print("ready", flush=True)
    if {wait}:
        time.sleep(60)
""")


@pytest.mark.integration
def test_page_files_go_at_exit_and_after_a_kill(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", _CHILD.format(tests=tests, folder=str(tmp_path), wait=False)],
                   check=True, capture_output=True, env=env, timeout=120)
    assert _pages_in(tmp_path) == []  # a normal exit removes them
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=tests, folder=str(tmp_path), wait=True)],
                             stdout=subprocess.PIPE, env=env)
    try:
        assert child.stdout.readline().strip() == b"ready"
        assert _pages_in(tmp_path)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        child.kill()
    assert _pages_in(tmp_path)  # a killed process cannot remove its files ...
    cfg = KVCacheConfig(method="h2o", budget=48, prompt_eviction="offload", page_dir=str(tmp_path))
    cache = EvictionCache(cfg)
    assert _pages_in(tmp_path) == [cache.pages.path]  # ... the next cache opened there does


def test_unwritable_or_missing_folder_fails_before_the_prompt(tmp_path):
    with pytest.raises(ValueError, match="page_dir=.* is not an existing folder"):
        KVCacheConfig(method="h2o", budget=48, prompt_eviction="offload", page_dir=str(tmp_path / "nope"))
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(str(ro), os.W_OK):
            pytest.skip("running as a user who can write anywhere")
        with pytest.raises(ValueError, match="page_dir=.* is not writable"):
            KVCacheConfig(method="h2o", budget=48, prompt_eviction="offload", page_dir=str(ro))
    finally:
        ro.chmod(0o700)


def test_a_full_disk_is_one_clear_error_and_loses_nothing(model, tmp_path, monkeypatch):
    caches = KVCacheBuilder.for_model(model, _config("h2o", "offload", tmp_path))
    real_open = open

    def full(path, mode="r", *a, **k):
        if "veloxquant-pages-" in str(path) and "a" in mode:
            raise OSError(28, "No space left on device")
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(RuntimeError, match="cannot write .* No space left on device"):
        greedy(model, random_prompt(100, seed=18), max_tokens=2, prompt_cache=caches, prefill_step_size=32)
    assert caches[0].pages.pending  # the rows it could not write are still held


@pytest.mark.parametrize("options", [{"kvzip_layers": "global"}, {"kvzip_normalize": "plus"},
                                     {"kv_bits": 8, "kv_group_size": 32}])
def test_kvzip_reconstruction_reads_the_pages_and_keeps_the_rows_end_keeps(options, model, tmp_path):
    prompt = random_prompt(150, seed=3)
    kept = {}
    for policy in ("end", "offload"):
        caches = KVCacheBuilder.for_model(model, _config("kvzip", policy, tmp_path, **options))
        returned = []  # (reading the rows in a model pass, new rows, rows handed to attention)
        for c in caches:
            def update_and_fetch(k, v, c=c, fn=c.update_and_fetch):
                out = fn(k, v)
                keys = out[0][0] if isinstance(out[0], tuple) else out[0]  # (quantized: the packed words)
                returned.append((c._reading, k.shape[2], keys.shape[2]))
                return out
            c.update_and_fetch = update_and_fetch
        greedy(model, prompt, max_tokens=1, prompt_cache=caches, prefill_step_size=32)
        assert all(c.method.passes == 1 for c in caches)
        assert caches[0].method.options.chunk < len(prompt)  # several chunks: each scores its rows, from the file
        kept[policy] = [np.sort(np.array(c.kept_positions()), -1) for c in caches]
        passes = [(s, rows) for reading, s, rows in returned if reading]
        assert passes
        if policy == "offload":  # the pass never holds the prompt: attention got its own rows alone
            assert all(rows == s for s, rows in passes)
    for a, b in zip(kept["end"], kept["offload"]):
        np.testing.assert_array_equal(a, b)


def test_offload_refuses_recall_and_cannot_batch(model, tmp_path):
    with pytest.raises(ValueError, match="does not take a recall tier"):
        KVCacheConfig(method="h2o", budget=64, prompt_eviction="offload", recall="memory")
    caches = KVCacheBuilder.for_model(model, _config("h2o", "offload", tmp_path))
    assert not hasattr(caches[0], "merge")  # mlx-lm's server serves such caches one request at a time


def test_batch_generate_refuses_offload_caches_and_serve_runs_them_one_at_a_time(model, tmp_path, caplog):
    from mlx_lm.generate import batch_generate

    from conftest import tiny_tokenizer
    from veloxquant_mlx.cli.serve import _model_provider_class, server_args

    config = _config("h2o", "offload", tmp_path)
    KVCacheBuilder.install(model, config)
    try:
        with pytest.raises(ValueError, match="does not yet support batching"):
            batch_generate(model, tiny_tokenizer(), [random_prompt(60, seed=1), random_prompt(40, seed=2)],
                           max_tokens=4)
    finally:
        KVCacheBuilder.uninstall(model)
    provider = _model_provider_class()(server_args(model="tiny"), model, tiny_tokenizer(), config)
    try:
        with caplog.at_level("INFO", logger="veloxquant_mlx.serve"):
            provider.load("default_model")
        assert not provider.is_batchable
        assert "prompt_eviction='offload' reads each sequence's prompt against its own page file" in caplog.text
    finally:
        KVCacheBuilder.uninstall(model)


def test_window_probabilities_a_block_at_a_time_equal_the_whole():
    from veloxquant_mlx.ops.attention import blocked_window_probs, window_attention_probs

    rng = np.random.default_rng(0)
    q = mx.array(rng.normal(size=(1, 6, 8, 16)).astype(np.float32))
    k = mx.array(rng.normal(size=(1, 2, 100, 16)).astype(np.float32))
    pos = mx.broadcast_to(mx.arange(100), (1, 2, 100))
    q_pos = mx.arange(92, 100)
    whole = window_attention_probs(q, k, q_pos, pos, 0.25)
    blocks = lambda: ((k[:, :, a:a + 32], pos[:, :, a:a + 32]) for a in range(0, 100, 32))
    for reduce in (lambda p: p.sum(axis=(2, 3)), lambda p: p.max(axis=3).sum(axis=2), lambda p: p):
        got = blocked_window_probs(q, q_pos, 0.25, blocks, reduce)
        assert np.abs(np.array(got) - np.array(reduce(whole))).max() <= 1e-6


@pytest.mark.parametrize("query_block", [None, 1, 3, 8])
def test_block_attention_in_query_spans_equals_dense_causal_attention(query_block):
    """A chunk of 8 queries (GQA 3) over two blocks of older rows (one with padding) and then 12 own rows whose
    last 8 are the queries' positions: the output and each row's attention mass equal one dense masked softmax,
    for any span of queries."""
    from veloxquant_mlx.ops.attention import BlockAttention

    rng = np.random.default_rng(1)
    B, Hq, H, S, D, n_own = 1, 6, 2, 8, 16, 12
    q = rng.normal(size=(B, Hq, S, D)).astype(np.float32)
    k = rng.normal(size=(B, H, 40 + n_own, D)).astype(np.float32)
    v = rng.normal(size=(B, H, 40 + n_own, D)).astype(np.float32)
    pad = np.ones((B, H, 1, 40), bool)
    pad[:, :, :, 25:30] = False  # padded rows of the second block
    att = BlockAttention(mx.array(q), H, 0.3, query_block=query_block)
    att.add(mx.array(k[:, :, :20]), mx.array(v[:, :, :20]))
    att.add(mx.array(k[:, :, 20:40]), mx.array(v[:, :, 20:40]), mx.array(pad[..., 20:40]))
    att.add_own(mx.array(k[:, :, 40:]), mx.array(v[:, :, 40:]))
    # dense reference: query i sees the unpadded older rows and own rows <= n_own - S + i
    vis = np.concatenate([np.broadcast_to(pad, (B, H, S, 40)),
                          np.broadcast_to(np.arange(n_own)[None] <= (n_own - S + np.arange(S))[:, None],
                                          (B, H, S, n_own))], axis=-1)
    kg, vg = np.repeat(k, Hq // H, axis=1), np.repeat(v, Hq // H, axis=1)
    logits = np.where(np.repeat(vis, Hq // H, axis=1), 0.3 * q @ kg.swapaxes(-1, -2), -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert np.abs(np.array(att.output()) - p @ vg).max() <= 1e-5
    mass = p.reshape(B, H, Hq // H, S, -1).sum(axis=(2, 3))
    got = np.concatenate([np.array(att.mass(mx.array(k[:, :, :40]), mx.array(pad))),
                          np.array(att.mass_own(mx.array(k[:, :, 40:])))], axis=-1)
    assert np.abs(got - mass).max() <= 1e-5


@pytest.mark.parametrize("method", sorted(set(METHODS) - {"nestedkv"}))
def test_the_prompts_end_never_reads_a_whole_layers_rows_back(method, model, tmp_path, monkeypatch):
    """At the paged prompt's end every method but NestedKV (whose key anomalies read every key at once)
    scores a block of rows at a time (View.window_attention) or from its per-row state, and the eviction
    reads back only the kept rows: the end's memory does not grow with the prompt."""
    from veloxquant_mlx.caches.pages import PromptPages

    def whole(self, which):
        raise AssertionError(f"{method} read every paged row's {which} back at once")

    monkeypatch.setattr(PromptPages, "read_part", whole)
    caches = KVCacheBuilder.for_model(model, _config(method, "offload", tmp_path))
    greedy(model, random_prompt(150, seed=19), max_tokens=3, prompt_cache=caches, prefill_step_size=32)
    assert all(c.evictions >= 1 for c in caches)
