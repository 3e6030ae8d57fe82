"""Eviction caches under mx.distributed: two ranks on this machine (mlx.launch --backend ring -n 2).

One ``mlx.launch`` run (tests/distributed_worker.py) covers tensor parallel on tiny random llama and
qwen3 models (8 query / 4 KV heads: 2 KV heads per rank) and pipeline parallel on qwen2 (one layer
per rank), for every registry method and the Ada-KV variants, at a budget that evicts during the
prompt (``prompt_eviction="stream"``, 32-token chunks) and during decode. The single-process
reference runs on each rank with an unsplit copy of the same model; the tests compare.
Single-process pieces of veloxquant_mlx.caches.shard / veloxquant_mlx.distributed are tested at the bottom without a launch.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig, methods
from veloxquant_mlx.caches.shard import HeadShard
from veloxquant_mlx.methods.nexus.ops import shared_block_weights
from veloxquant_mlx.distributed import layer_span, resolve_group, shard_for_world
from veloxquant_mlx.methods.nexus.ops import nexus_weights
from veloxquant_mlx.registry import get_method

from conftest import make_tiny_model

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
PREFILL_ONLY = {m for m in methods() if get_method(m).prefill_only}
ADA = {m + "-ada" for m in methods() if get_method(m).supports_allocation("ada")}  # layer-wide budgets
# Selections known to read one head at a time (no traffic) or to combine heads (traffic); a method
# in neither is still checked against one process by every other test.
PER_HEAD = ("h2o", "snapkv", "pyramidkv", "morphkv", "streaming", "random", "nexus-per-head")
# kvzip defaults to Ada-KV head budgets (the paper's), which rank every rank's heads together
COMBINING = ("kvzip", "nexus", "nestedkv", "nexus-vectors", "nexus-topk", "nestedkv-end", "nexus-prior", *sorted(ADA))


def _launcher():
    exe = shutil.which("mlx.launch") or shutil.which("mlx.launch", path=os.path.dirname(sys.executable))
    return exe


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    exe = _launcher()
    if exe is None:
        pytest.skip("mlx.launch is not on PATH (it comes with the mlx package): cannot start two ranks")
    if not mx.distributed.is_available():
        pytest.skip("this MLX build has no distributed backend")
    out = tmp_path_factory.mktemp("distributed")
    port = random.randint(20000, 60000)  # other runs on this machine may hold the default ports
    cmd = [exe, "--backend", "ring", "-n", "2", "--starting-port", str(port), "--python", sys.executable,
           WORKER, str(out)]
    # the ranks import this checkout, whatever the environment's install of the package points at
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL, env=env)
    if proc.returncode != 0:
        pytest.fail(f"mlx.launch failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["size"] for r in res] == [2, 2]
    return res


def _cases(ranks, run):
    for r in ranks:
        for name, case in r["runs"][run].items():
            if name != "hot_path":
                yield r["rank"], name, case


RUNS = ["tensor/llama", "tensor/qwen3", "pipeline/qwen2"]


@pytest.mark.integration
@pytest.mark.parametrize("run", RUNS)
def test_tokens_and_kept_rows_equal_one_process(ranks, run):
    names = {name for _, name, _ in _cases(ranks, run)}
    if run.startswith("tensor"):
        assert set(methods()) <= names  # every registry method
    if run == "tensor/llama":
        assert ADA <= names
    bad = [(rank, name) for rank, name, c in _cases(ranks, run)
           if c["tokens"] != c["ref_tokens"] or c.get("kept_equal") is False]
    assert not bad, f"{run}: 2 ranks differ from one process for {bad}"
    for rank, name, c in _cases(ranks, run):  # both ranks generate the same tokens
        assert c["tokens"] == ranks[0]["runs"][run][name]["tokens"]


@pytest.mark.integration
def test_quantized_rows_two_ranks_equal_one_process(ranks):
    """4-bit kept rows (kv_bits=4, groups of 32): every method and the Ada variants keep exactly what one
    process keeps and generate the same tokens."""
    run = "tensor-q4/llama-hd32"
    names = {name for _, name, _ in _cases(ranks, run)}
    assert set(methods()) | {"nexus-ada", "h2o-ada", "nestedkv-end"} <= names
    bad = [(rank, name) for rank, name, c in _cases(ranks, run)
           if c["tokens"] != c["ref_tokens"] or not c["kept_equal"]]
    assert not bad, f"quantized rows: 2 ranks differ from one process for {bad}"
    for rank, name, c in _cases(ranks, run):
        assert c["max_logprob_diff"] <= 1e-3, (rank, name, c["max_logprob_diff"])
        assert max(c["evictions"]) >= 1 and not c["kept_all"], (rank, name)  # PyramidKV: layer 0 holds more


@pytest.mark.integration
def test_paged_prompt_on_two_ranks_keeps_what_one_process_keeps_holding_it_whole(ranks):
    """prompt_eviction="offload" on the split model (each rank pages its own heads) against one process
    under "end": the same tokens and, per rank, the same kept rows, for every method (KVzip's reconstruction
    pass and kvzap's ranking across layers and heads included)."""
    run = "tensor-offload/llama"
    names = {name for _, name, _ in _cases(ranks, run)}
    assert set(methods()) <= names
    bad = [(rank, name) for rank, name, c in _cases(ranks, run)
           if c["tokens"] != c["ref_tokens"] or not c["kept_equal"]]
    assert not bad, f"paged prompt: 2 ranks differ from one process under end for {bad}"
    for rank, name, c in _cases(ranks, run):
        assert not c["kept_all"], (rank, name)  # the budget evicted
        assert c["max_logprob_diff"] <= 1e-3, (rank, name, c["max_logprob_diff"])


@pytest.mark.integration
@pytest.mark.parametrize("run", RUNS)
def test_budget_evicts_during_prompt_and_decode(ranks, run):
    for rank, name, c in _cases(ranks, run):
        if c.get("evictions") is None or name == "nexus-no-eviction":
            continue
        assert c["evictions"] == c["ref_evictions"][:len(c["evictions"])] or run.startswith("pipeline")
        base = name.split("-")[0]
        if base not in PREFILL_ONLY:  # >= 1 in a prompt chunk (prompt_eviction="stream") + >= 1 in decode
            assert min(c["evictions"]) >= 2, (run, name, c["evictions"])
        if not (run.startswith("pipeline") and name == "pyramidkv"):  # see the pipeline test below
            assert not c["kept_all"], (run, name)


@pytest.mark.integration
def test_nothing_evicted_equals_kvcache(ranks):
    for run in ("tensor/llama", "tensor/qwen3"):
        for rank, name, c in _cases(ranks, run):
            if name != "nexus-no-eviction":
                continue
            full = ranks[rank]["runs"][run]["full"]
            assert c["evictions"] == [0, 0] and c["kept_all"]
            assert c["tokens"] == full["tokens"]
            assert c["logprob_diff_vs_kvcache"] == 0.0  # bit-identical to the split model with KVCache
            assert c["traffic"]["bytes"] == 0


@pytest.mark.integration
def test_a_rank_that_ignores_the_others_is_caught(ranks):
    """The same comparison on caches built with group=False (each rank selects from its own heads
    only): every head-combining selection then differs from one process's; per-head H2O does not."""
    run = "tensor/llama"
    naive = {}
    for rank, name, c in _cases(ranks, run):
        if "naive_kept_equal" in c:
            naive.setdefault(name, []).append(c["naive_kept_equal"])
    for name in ("nestedkv", "random", "h2o-ada", "nexus-topk"):
        assert not all(naive[name]), f"{name}: ignoring the other ranks went unnoticed"
    assert all(naive["h2o"])  # per-head: nothing to combine


@pytest.mark.integration
def test_traffic_only_where_heads_combine(ranks):
    for rank, name, c in _cases(ranks, "tensor/llama"):
        if name in PER_HEAD or name in ("full", "nexus-no-eviction"):
            assert c["traffic"]["bytes"] == 0, name
        elif name in COMBINING:
            assert c["traffic"]["bytes"] > 0 and c["traffic"]["collectives"] > 0, name
    for rank, name, c in _cases(ranks, "pipeline/qwen2"):
        assert c["traffic"]["bytes"] == 0


@pytest.mark.integration
def test_no_host_sync_in_the_sharded_hot_path(ranks):
    for r in ranks:
        for name, h in r["runs"]["tensor/llama"]["hot_path"].items():
            assert h["clean"], f"rank {r['rank']} {name}: host sync in update_and_fetch/observe_queries"
            assert min(h["evictions"]) >= 2
        assert r["runs"]["tensor/llama"]["hot_path"]["nexus"]["traffic"]["bytes"] > 0


@pytest.mark.integration
def test_layer_wide_top_k_over_two_ranks_equals_one_argsort(ranks):
    """Ada-KV's layer-wide ranking without gathering the scores: radix select + tie counts."""
    for r in ranks:
        assert r["runs"]["top_k"]["checked"] == 12 and r["runs"]["top_k"]["bad"] == []


@pytest.mark.integration
def test_batched_generation_on_the_split_model(ranks):
    """batch_generate (per-row caches copied into a BatchEvictionCache) on 2 ranks == each prompt
    generated alone by one process."""
    for r in ranks:
        b = r["runs"]["batched"]
        assert "error" not in b, b.get("error")
        assert set(b) == {"nexus", "h2o-ada", "kvzip-ada"}
        for name, v in b.items():
            assert v["batched"] == v["alone"], (r["rank"], name)


@pytest.mark.integration
def test_pipeline_ranks_keep_global_layer_numbers(ranks):
    got = {}
    for rank, name, c in _cases(ranks, "pipeline/qwen2"):
        if c.get("layer_idx") is not None:
            got.setdefault(name, set()).update(c["layer_idx"])
            assert len(c["layer_idx"]) == 1  # one layer per rank
    assert all(v == {0, 1} for v in got.values()), got
    # PyramidKV's budget follows the GLOBAL depth: layer 0 (budget 78 > 76 tokens) keeps everything,
    # layer 1 (budget 18) evicts; a rank numbering its one layer 0 of 1 would keep 48.
    pyr = {c["layer_idx"][0]: c for _, name, c in _cases(ranks, "pipeline/qwen2") if name == "pyramidkv"}
    assert pyr[0]["kept_all"] and pyr[0]["evictions"] == [0]
    assert not pyr[1]["kept_all"] and pyr[1]["evictions"][0] >= 1  # stream chunks + the end compression


# -- single process (no launch) -----------------------------------------------------------------------

class _FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


def test_global_draws_sliced_per_rank():
    key = mx.random.key(5)
    full = mx.random.uniform(shape=(3, 1, 4, 7), key=key)
    for r in range(2):
        got = HeadShard(_FakeGroup(r, 2)).uniform(key, (3, 1, 2, 7), axis=2)
        assert np.array_equal(np.array(got), np.array(full[:, :, 2 * r:2 * r + 2]))


def test_shared_weights_match_the_head_mean():
    """The all_sum route to Nexus's layer-shared weights (group of one) equals the single-process one
    up to float summation order."""
    s_hat = mx.softmax(mx.random.normal((1, 4, 2, 8, 5), key=mx.random.key(0)), axis=-1)
    want = nexus_weights(s_hat.mean(axis=(1, 2))[:, None], 3, 0.5, 1e-6)
    one = HeadShard(mx.distributed.init())
    assert one.size == 1
    for lam in (0.5, 0.0):
        want = nexus_weights(s_hat.mean(axis=(1, 2))[:, None], 3, lam, 1e-6)
        got = shared_block_weights(one, s_hat.sum(axis=(1, 2)), 8, 3, lam, 1e-6)
        assert got.shape == want.shape == (1, 1, 5)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-7)


def test_radix_top_k_equals_stable_argsort_rank():
    """HeadShard.top_k_mask (group of one) == argsort ranking, ties to the lower flattened index."""
    d, rng = HeadShard(mx.distributed.init()), np.random.default_rng(0)
    for trial in range(40):
        B, H, R = 2, int(rng.integers(1, 5)), int(rng.integers(1, 30))
        s = (rng.integers(-5, 5, size=(B, H, R)) * rng.choice([1.0, 0.37, 1e-3])).astype(np.float32)
        if trial % 3 == 0:
            s = rng.normal(size=(B, H, R)).astype(np.float32)
        s[0, 0, :2] = -0.0
        mem = rng.random((B, H, R)) < 0.7
        S = mx.where(mx.array(mem), mx.array(s), -mx.inf)
        rank = mx.argsort(mx.argsort(-S.reshape(B, H * R), axis=-1), axis=-1).reshape(B, H, R)
        for k in (int(rng.integers(0, H * R + 3)), mx.array(rng.integers(0, H * R + 2, size=(B,)).astype(np.int32))):
            want = (rank < (k if isinstance(k, int) else k[:, None, None])) & mx.array(mem)
            assert np.array_equal(np.array(d.top_k_mask(mx.array(s), mx.array(mem), k)), np.array(want)), trial


def test_ada_keep_through_a_shard_of_one_equals_ada_keep():
    from veloxquant_mlx.caches import PAD_POSITION
    from veloxquant_mlx.ops.allocation import ada_keep

    d, rng = HeadShard(mx.distributed.init()), np.random.default_rng(1)
    for trial in range(10):
        B, H, R = 2, 4, 60
        s = (rng.integers(0, 6, size=(B, H, R)) * 0.5).astype(np.float32)  # many ties
        pos = np.tile(np.arange(R, dtype=np.int32), (B, H, 1))
        pos[rng.random((B, H, R)) < 0.3] = PAD_POSITION  # ragged storage
        args = (mx.array(s), mx.array(pos), R, 32, 2, 4, 0.2, PAD_POSITION)
        want, got = ada_keep(*args), ada_keep(*args, layer=d)
        assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(want, got)), trial


def test_single_process_builds_no_shard():
    model = make_tiny_model("llama")
    cfg = KVCacheConfig("nexus", budget=64, nexus_block_size=8, nexus_window=8)
    assert resolve_group(model, None) is None and resolve_group(model, False) is None
    assert resolve_group(model, mx.distributed.init()) is None  # a group of one is no group
    caches = KVCacheBuilder.for_model(model, cfg)
    assert all(c.dist is None for c in caches)
    assert [c.layer_idx for c in caches] == [0, 1] and layer_span(model, 2) == (0, 2)
    assert shard_for_world(model) == "single process"
    KVCacheBuilder.uninstall(model)


def test_attach_gives_loaded_caches_their_shard():
    from veloxquant_mlx.distributed import attach, traffic

    cfg = KVCacheConfig("random", budget=32)
    caches = [EvictionCache(cfg, layer_idx=i, n_layers=2) for i in range(2)]
    attach(caches, _FakeGroup(1, 2))
    assert all(isinstance(c.dist, HeadShard) and (c.dist.rank, c.dist.size) == (1, 2) for c in caches)
    assert traffic(caches) == {"bytes": 0, "collectives": 0}
    attach(caches, None)
    assert all(c.dist is None for c in caches)


def test_pipeline_layer_span_is_global():
    class Inner:
        pipeline_size, start_idx = 2, 3
        layers = [None] * 5

    class Args:
        num_hidden_layers = 8

    class Model:
        model, args = Inner(), Args()

    assert layer_span(Model(), 2) == (3, 8)


# -- the command line under mlx.launch ---------------------------------------------------------------

def _save_model(path):
    """The worker's tiny llama (4 KV heads) in mlx-lm format with the word-level tokenizer."""
    from mlx.utils import tree_flatten

    from conftest import tiny_tokenizer
    from distributed_worker import make_model

    model = make_model("llama")
    a = model.args
    config = dict(model_type="llama", hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers,
                  intermediate_size=a.intermediate_size, num_attention_heads=a.num_attention_heads,
                  num_key_value_heads=a.num_key_value_heads, rms_norm_eps=a.rms_norm_eps,
                  vocab_size=a.vocab_size, max_position_embeddings=4096, tie_word_embeddings=False)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    tiny_tokenizer()._tokenizer.save_pretrained(str(path))


def test_cli_generate_under_mlx_launch(tmp_path):
    exe = _launcher()
    if exe is None:
        pytest.skip("mlx.launch is not on PATH (it comes with the mlx package): cannot start two ranks")
    _save_model(tmp_path / "model")
    prompt = " ".join(f"t{i}" for i in np.random.default_rng(3).integers(0, 128, size=70))
    args = ["-m", "veloxquant_mlx", "generate", "--model", str(tmp_path / "model"), "--prompt", prompt,
            "--ignore-chat-template", "--max-tokens", "12", "--prefill-step-size", "32", "--method", "nexus",
            "--budget", "48", "--nexus-block-size", "8", "--nexus-window", "8", "--prompt-eviction", "stream"]
    one = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([exe, "--backend", "ring", "-n", "2", "--starting-port", str(random.randint(20000, 60000)),
                          "--python", sys.executable, *args], capture_output=True, text=True, timeout=300,
                         stdin=subprocess.DEVNULL)
    assert two.returncode == 0, two.stdout + two.stderr
    assert two.stdout.count("distributed: tensor parallel over 2 ranks") == 1  # rank 0 alone prints
    assert two.stdout.count("==========") == 1
    text = lambda out: out.split("==========")[0].strip().splitlines()[-1]  # noqa: E731
    assert text(two.stdout) == text(one.stdout) and len(text(one.stdout).split()) >= 6


def test_serve_under_mlx_launch(tmp_path):
    """`python -m veloxquant_mlx serve` on 2 ranks: rank 0 answers HTTP, both ranks generate; the
    answer equals one process's generation with the same cache config."""
    import time
    import urllib.request

    import mlx_lm
    from mlx_lm.generate import stream_generate

    exe = _launcher()
    if exe is None:
        pytest.skip("mlx.launch is not on PATH (it comes with the mlx package): cannot start two ranks")
    _save_model(tmp_path / "model")
    flags = ["--method", "nexus", "--budget", "48", "--nexus-block-size", "8", "--nexus-window", "8",
             "--prompt-eviction", "stream", "--prefill-step-size", "32"]
    port = random.randint(20000, 40000)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([exe, "--backend", "ring", "-n", "2", "--starting-port", str(port + 1000),
                             "--python", sys.executable, "-m", "veloxquant_mlx", "serve", "--model",
                             str(tmp_path / "model"), "--port", str(port), *flags],
                            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    prompt = " ".join(f"t{i}" for i in np.random.default_rng(4).integers(1, 128, size=70))
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                assert time.time() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": 10, "temperature": 0.0})
        req = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=240) as r:
            served = json.loads(r.read())["choices"][0]["text"]
    finally:  # the launcher and both ranks: the process group this test started
        import signal

        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    model, tok = mlx_lm.load(str(tmp_path / "model"))
    cfg = KVCacheConfig("nexus", budget=48, nexus_block_size=8, nexus_window=8, prompt_eviction="stream")
    caches = KVCacheBuilder.for_model(model, cfg)
    alone = "".join(r.text for r in stream_generate(model, tok, mx.array(tok.encode(prompt)), max_tokens=10,
                                                    prompt_cache=caches, prefill_step_size=32))
    KVCacheBuilder.uninstall(model)
    assert caches[0].evictions >= 2
    assert served == alone and len(served.split()) >= 5
