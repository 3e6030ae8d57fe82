"""KVzip (method="kvzip"): the reconstruction pass through the real model, driven from plain
generate_step / batch_generate / a loaded prompt cache.

The contract matrix (tests/test_contract.py), batching (tests/test_batching.py) and the two-rank run
(tests/test_distributed.py) pick the method up from the registry; this file checks what is KVzip's
own: the pass's rows never enter the cache, the score follows the reconstruction's attention, a
follow-up turn scores only its new text, save/load then two questions, the CLI's compress.
"""

import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models import llama
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, _BaseCache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache
from veloxquant_mlx import EvictionCache
from veloxquant_mlx.methods.kvzip import KVzip
from veloxquant_mlx.model_pass import model_pass_installed, remove_model_pass

from conftest import VOCAB, greedy, make_tiny_model, random_prompt, tiny_tokenizer


def kvzip(budget=32, **kw):
    # Most tests check the per-layer, per-head contract exactly: uniform unless a test asks otherwise
    # (the default, the paper's head budget, is tested in test_default_head_budget_follows_the_total).
    kw.setdefault("allocation", "uniform")
    if "options" not in kw:
        kw.setdefault("kvzip_layers", "each")
    return KVCacheConfig("kvzip", budget=budget, n_sink=kw.pop("n_sink", 4), recent=kw.pop("recent", 4), **kw)


def build(model, config):
    return KVCacheBuilder.for_model(model, config, tokenizer=tiny_tokenizer())


def steps(model, prompt, caches, n, prefill=16):
    toks, lps = [], []
    for tok, lp in generate_step(mx.array(prompt), model, max_tokens=n, prompt_cache=caches,
                                 prefill_step_size=prefill):
        toks.append(int(tok))
        lps.append(np.array(lp.astype(mx.float32)))
    return toks, np.stack(lps)


def positions(cache):
    """Per head (batch row 0): the sorted real positions kept."""
    p = np.array(cache.kept_positions()[0])
    return [np.sort(h[h >= 0]) for h in p]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_budget_above_the_sequence_equals_kvcache(arch):
    model = make_tiny_model(arch)
    prompt = random_prompt(90, seed=2)
    ref = steps(model, prompt, None, 10)
    caches = build(model, kvzip(budget=512))
    got = steps(model, prompt, caches, 10)
    assert got[0] == ref[0]
    np.testing.assert_allclose(got[1], ref[1], atol=1e-5)
    assert all(c.evictions == 0 and c.method.passes == 0 and c.offset == 90 + 10 for c in caches)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compression_keeps_the_budget_and_only_real_rows(arch):
    model = make_tiny_model(arch)
    prompt = random_prompt(100, seed=3)
    full = [KVCache() for _ in model.layers]
    steps(model, prompt, full, 6)
    budgets = {}
    for budget in (24, 48):
        caches = build(model, kvzip(budget=budget, kvzip_chunk=40))  # 3 reconstruction chunks
        steps(model, prompt, caches, 6)
        for c, f in zip(caches, full):
            assert c.method.passes == 1 and c.evictions == 1 and c.method.scored == 100
            assert c.offset == 100 + 6  # the prompt and the decoded tokens fed back, nothing of the pass
            assert c.size() == budget + 6  # compressed at the prompt's last token, decode appended
            assert c.keys.shape[2] <= budget + c.store.decode_step  # allocation follows the budget
            for h, pos in enumerate(positions(c)):
                assert len(pos) == budget + 6 and len(set(pos)) == len(pos) and pos.max() < c.offset
                assert pos[:4].tolist() == [0, 1, 2, 3] and pos[-10:].tolist() == list(range(96, 106))
            # every kept row is the real token's row: its key equals the full cache's at that position
            # and its recorded id is the prompt's (the reconstruction's rows were never stored)
            kp = np.array(c.kept_positions()[0])
            ref_k = np.array(f.keys[0, :, :f.offset])
            got_k = np.array(c.keys[0, :, :c.size()])
            for h in range(kp.shape[0]):  # (the decoded rows differ: the two caches decode differently)
                np.testing.assert_allclose(got_k[h, :budget], ref_k[h, kp[h, :budget]], atol=1e-5)
            ids = np.array(c.stored("zip_ids")[0, 0]).astype(int)
            seq = prompt + [-1] * 10
            assert ids[:budget].tolist() == [seq[p] for p in kp[0][:budget]]
        budgets[budget] = sum(c.nbytes for c in caches)
    assert budgets[24] < budgets[48] < sum(c.nbytes for c in full)


# -- the score follows the reconstruction's attention ---------------------------------------------------
PLANT = 7  # token id of the planted row


def planted_model():
    """One llama layer where only a PLANT query finds a PLANT key (q.k = 16 on the low-frequency RoPE
    pair, about 0 elsewhere) and every other query avoids PLANT keys (q.k about -6): the prompt's own
    queries ignore the planted row, the reconstruction (which re-reads PLANT) attends to it."""
    mx.random.seed(0)
    D, H, G = 16, 2, 2
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=H * G, num_key_value_heads=H, rms_norm_eps=1e-5,
                           vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=False)
    model = llama.Model(args)
    rng = np.random.default_rng(0)
    u = np.zeros(64, np.float32)
    u[0] = 1.0
    w = np.zeros(64, np.float32)
    w[1] = 1.0
    emb = rng.normal(scale=0.3, size=(VOCAB, 64)).astype(np.float32)
    emb[:, :2] = 0.0
    emb += w  # every token shares direction w ...
    emb[PLANT] = u  # ... except PLANT, which is u alone
    attn = model.model.layers[0].self_attn
    wq = rng.normal(scale=0.01, size=(H * G * D, 64)).astype(np.float32)
    wk = rng.normal(scale=0.01, size=(H * D, 64)).astype(np.float32)
    wq[:, :2] = wk[:, :2] = 0.0
    low = D // 2 - 1  # first half of RoPE's lowest-frequency pair (rotates ~3e-4 rad per position)
    for g in range(H * G):
        wq[g * D + low] += u - w
    for h in range(H):
        wk[h * D + low] += u
    model.model.embed_tokens.weight = mx.array(emb)
    attn.q_proj.weight, attn.k_proj.weight = mx.array(wq), mx.array(wk)
    mx.eval(model.parameters())
    return model


def test_rows_the_reconstruction_attends_to_are_kept_and_ignored_rows_evicted():
    model = planted_model()
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(8, VOCAB, size=120)]
    prompt[50] = PLANT
    config = kvzip(budget=16, kvzip_chunk=48)
    caches = build(model, config)
    steps(model, prompt, caches, 2)
    (c,) = caches
    assert c.method.passes == 1
    assert all(50 in pos for pos in positions(c)), "the row the reconstruction attends to was evicted"
    s = np.array(c.stored("zip_score")[0])
    kp = np.array(c.kept_positions()[0])
    for h in range(s.shape[0]):
        at = int(np.where(kp[h] == 50)[0][0])
        assert s[h, at] > 0.3 and np.delete(s[h, :16], at).max() < 0.1  # max attention, not a mean

    # Without the reconstruction (a cache used directly: the prompt's last queries score instead)
    # the planted row is the one every prompt query ignores: it is evicted in every head.
    remove_model_pass(model)
    bare = [EvictionCache(config, 0, 1)]
    bare[0].tap_active = True
    steps(model, prompt, bare, 2)
    assert bare[0].method.passes == 0 and bare[0].evictions == 1
    assert all(50 not in pos for pos in positions(bare[0]))


# -- follow-up turns ---------------------------------------------------------------------------------------
class _Rows(_BaseCache):
    """Reference: exactly the given rows at a logical offset, then appended (no eviction)."""

    def __init__(self, keys, values, offset):
        self.keys, self.values, self.offset = keys, values, offset

    def update_and_fetch(self, k, v):
        self.keys = mx.concatenate([self.keys, k], axis=2)
        self.values = mx.concatenate([self.values, v], axis=2)
        self.offset += k.shape[2]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        if return_array:
            return create_causal_mask(N, offset=self.keys.shape[2])
        return "causal" if N > 1 else None

    @property
    def state(self):
        return [self.keys, self.values]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_follow_up_turn_continues_the_compressed_cache(arch):
    model = make_tiny_model(arch)
    turn1, turn2 = random_prompt(100, seed=4), random_prompt(30, seed=5)
    caches = build(model, kvzip(budget=32, kvzip_chunk=40))
    steps(model, turn1, caches, 4)
    # What the compressed cache holds after turn 1, as plain rows at the logical offset.
    ref = [_Rows(c.keys[:, :, :c.size()], c.values[:, :, :c.size()], c.offset) for c in caches]
    scores1 = {h: dict(zip(p.tolist(), s.tolist())) for h, (p, s) in
               enumerate(zip(np.array(caches[0].kept_positions()[0]), np.array(caches[0].stored("zip_score")[0])))}
    for c in caches:
        c.continue_on_purpose()
    big = copy.deepcopy(caches)
    for c in big:  # a budget the second turn does not exceed: it only appends
        c.budget = 1000
    got = steps(model, turn2, big, 6)
    want = steps(model, turn2, ref, 6)
    assert got[0] == want[0]
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)

    steps(model, turn2, caches, 6)  # the real budget: the new turn is scored and compressed
    for c in caches:
        assert c.method.passes == 2 and c.evictions == 2 and c.method.scored == 100 + 4 + 30
        assert c.offset == 100 + 4 + 30 + 6 and c.size() == 32 + 6
    # Only the new text was reconstructed: the rows kept from turn 1 keep their turn-1 scores.
    kp = np.array(caches[0].kept_positions()[0])
    sc = np.array(caches[0].stored("zip_score")[0])
    old = [(h, p, s) for h in range(kp.shape[0]) for p, s in zip(kp[h], sc[h]) if p in scores1[h]]
    assert old and all(abs(scores1[h][p] - s) < 1e-6 for h, p, s in old)
    assert any(p >= 104 for p in kp[0])  # the new turn competes for the budget


def test_save_load_then_two_questions(tmp_path):
    model = make_tiny_model("llama")
    doc = random_prompt(120, seed=6)
    caches = build(model, kvzip(budget=32, kvzip_chunk=50))
    steps(model, doc, caches, 1)  # compresses at the document's last token
    mx.eval([c.state for c in caches])
    path = tmp_path / "doc.safetensors"
    save_prompt_cache(path, caches)
    questions = [random_prompt(12, seed=7), random_prompt(9, seed=8)]
    answers = []
    for q in questions:
        live = copy.deepcopy(caches)
        for c in live:
            c.continue_on_purpose()
        loaded = load_prompt_cache(path)
        for c in loaded:
            c.continue_on_purpose()
        assert [(c.offset, c.size(), c.method.scored, c.method.passes) for c in loaded] == \
               [(c.offset, c.size(), c.method.scored, c.method.passes) for c in caches]
        a, b = steps(model, q, live, 6), steps(model, q, loaded, 6)
        assert a[0] == b[0]
        np.testing.assert_allclose(a[1], b[1], atol=1e-6)
        assert all(c.method.passes == 2 for c in loaded)  # each question reconstructed its own text
        answers.append(b[0])
    assert answers[0] != answers[1]


@pytest.mark.parametrize("normalize", ["none", "plus"])
def test_batch_generate_equals_each_prompt_alone(normalize):
    model = make_tiny_model("llama")
    prompts = [random_prompt(n, seed=s) for n, s in ((70, 1), (45, 2), (96, 3))]
    config = kvzip(budget=24, kvzip_chunk=32, kvzip_normalize=normalize)
    alone = []
    for p in prompts:
        caches = build(model, config)
        alone.append((greedy(model, p, 6, prompt_cache=caches, prefill_step_size=16)[0], caches))
    KVCacheBuilder.install(model, config, tokenizer=tiny_tokenizer())
    try:
        out = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=6, prefill_step_size=16,
                             return_prompt_caches=True, return_token_ids=True)
    finally:
        KVCacheBuilder.uninstall(model)
    assert not model_pass_installed(model)
    for (tokens, caches), got, got_caches in zip(alone, out.token_ids, out.caches):
        assert list(got) == tokens
        for a, b in zip(caches, got_caches):
            assert a.method.passes == b.method.passes == 1 and a.offset == b.offset
            assert all(np.array_equal(x, y) for x, y in zip(positions(a), positions(b)))


def test_model_wrapper_is_reversible_and_keeps_the_model():
    model = make_tiny_model("qwen3")
    cls = type(model)
    x = mx.array([random_prompt(20, seed=9)])
    before = model(x)
    build(model, kvzip())
    assert model_pass_installed(model) and isinstance(model, cls) and type(model).__name__ == cls.__name__
    assert mx.array_equal(model(x), before)
    KVCacheBuilder.uninstall(model)
    assert type(model) is cls
    assert isinstance(model, nn.Module)


def test_bad_kvzip_options_are_named():
    with pytest.raises(ValueError, match="chunk"):
        kvzip(kvzip_chunk=0)
    with pytest.raises(TypeError, match="kvzip_bogus"):
        kvzip(kvzip_bogus=1)


def test_cli_compress_once_then_ask_twice(tmp_path, capsys):
    from test_distributed import _save_model

    from veloxquant_mlx.cli import main

    _save_model(tmp_path / "model")
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"t{i}" for i in np.random.default_rng(3).integers(0, VOCAB, size=90)))
    out = tmp_path / "doc.safetensors"
    common = ["--model", str(tmp_path / "model"), "--ignore-chat-template"]
    assert main(["compress", *common, "--prompt-file", str(doc), "--out", str(out), "--budget", "24",
                 "--kvzip-chunk", "32", "--prefill-step-size", "16"]) == 0
    assert "Compressed 90 tokens with kvzip (budget 24/head)" in capsys.readouterr().out
    loaded = load_prompt_cache(out)
    assert all(c.offset == 90 and c.method.passes == 1 for c in loaded)
    kept = [sum(len(h) for h in positions(c)) for c in loaded]  # the paper's budget: one ranking
    H = loaded[0].positions.shape[1]
    assert abs(sum(kept) - len(loaded) * H * 24) <= len(loaded) * H  # per-layer rounding

    def ask(q):
        assert main(["generate", *common, "--prompt-cache", str(out), "--prompt", q, "--max-tokens", "8"]) == 0
        return capsys.readouterr().out.split("==========")[0].strip().splitlines()[-1]

    a, b = "t5 t9 t11 t40", "t77 t3 t100"
    first = ask(a)
    assert ask(a) == first  # a fresh copy of the file every time: the same answer
    assert ask(b) != first
    assert load_prompt_cache(out)[0].offset == 90  # the file itself never changes


def test_sliding_layers_of_gemma3_are_not_touched_by_the_pass():
    """Gemma 3: eviction caches on the global layers only; the pass runs the sliding layers on copies,
    so their RotatingKVCache holds exactly what a plain prefill leaves."""
    from mlx.utils import tree_map
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import RotatingKVCache

    mx.random.seed(0)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=6, intermediate_size=96,
        num_attention_heads=2, head_dim=32, num_key_value_heads=1, vocab_size=VOCAB,
        sliding_window=16, sliding_window_pattern=3, query_pre_attn_scalar=32)
    model = gemma3_text.Model(args)
    model.update(tree_map(lambda p: p * 4.0, model.parameters()))
    mx.eval(model.parameters())
    x = mx.array([random_prompt(80, seed=11)])
    plain = model.make_cache()
    caches = build(model, kvzip(budget=24, kvzip_chunk=32))
    for cs in (plain, caches):
        for s in range(0, 79, 16):
            model(x[:, s:min(s + 16, 79)], cache=cs)
        model(x[:, 79:], cache=cs)
        mx.eval([c.state for c in cs])
    for i, (a, b) in enumerate(zip(plain, caches)):
        if isinstance(b, RotatingKVCache):
            assert a.offset == b.offset == 80
            assert all(mx.array_equal(p, q) for p, q in zip(a.state, b.state)), i
        else:
            assert isinstance(b.method, KVzip) and b.method.passes == 1 and b.size() == 24 and b.offset == 80
    KVCacheBuilder.uninstall(model)


def test_the_pass_forces_no_host_sync():
    from conftest import forbid_host_sync

    model = make_tiny_model("llama")
    caches = build(model, kvzip(budget=24, kvzip_chunk=32))
    x = mx.array([random_prompt(100, seed=12)])
    with forbid_host_sync():
        for s in range(0, 99, 32):
            model(x[:, s:min(s + 32, 99)], cache=caches)
        out = model(x[:, 99:], cache=caches)  # the prompt's end: the reconstruction pass and evictions
        for t in range(3):
            out = model(x[:, t:t + 1], cache=caches)
    mx.eval(out, [c.state for c in caches])
    assert all(c.method.passes == 1 and c.size() == 24 + 3 for c in caches)


def test_global_layer_budget_moves_rows_between_layers_and_keeps_the_total(monkeypatch):
    model = make_tiny_model("llama", layers=4)
    prompt = random_prompt(100, seed=13)
    seen = []
    original = EvictionCache.compress

    def spy(self, budget=None):  # the scores every layer holds when the shares are decided
        seen.append((np.array(self.stored("zip_score")[0]), np.array(self.stored("positions")[0]), budget))
        return original(self, budget)

    monkeypatch.setattr(EvictionCache, "compress", spy)
    each = build(model, kvzip(budget=32, kvzip_chunk=40))
    steps(model, prompt, each, 1)
    assert [c.size() for c in each] == [33] * 4 and [b for _, _, b in seen] == [None] * 4
    seen.clear()
    glob = build(model, kvzip(budget=32, kvzip_chunk=40, kvzip_layers="global"))
    steps(model, prompt, glob, 1)
    sizes = [c.size() - 1 for c in glob]  # minus the one decoded row
    assert len(set(sizes)) > 1 and abs(sum(sizes) - 4 * 32) <= 2  # shares differ, the total is kept
    # One ranking over every layer's candidate rows (not sinks, not the recent window): layer l's share
    # is n_sink + recent + its winners / heads.
    cand = [np.where((p >= 4) & (p < 100 - 4), s, -np.inf) for s, p, _ in seen]
    flat = np.concatenate([c.ravel() for c in cand])
    thr = np.sort(flat)[::-1][4 * 2 * (32 - 8) - 1]
    want = [8 + int(round((c >= thr).sum() / 2)) for c in cand]
    assert [b for _, _, b in seen] == want == sizes
    # the shares are compression targets: every layer's budget stays the configured one, and the
    # compression state is closed again
    assert all(c.budget == 32 and c.schedule.keep() == 32 and not c.schedule.compressing for c in glob)


def test_default_head_budget_follows_the_total():
    """The default (paper Sec. 3): one ranking over every layer's and head's rows, no floor. The
    layers' shares differ, the total is layers x heads x budget, and one head holds at most 2 x its
    layer's share (our cap, max_head_factor=2.0)."""
    model = make_tiny_model("llama")
    prompt = random_prompt(120, seed=4)
    caches = build(model, KVCacheConfig("kvzip", budget=24, n_sink=4, recent=4))
    steps(model, prompt, caches, 1)
    per_head = [[len(h) for h in positions(c)] for c in caches]
    H = len(per_head[0])
    assert abs(sum(map(sum, per_head)) - len(caches) * H * 24) <= len(caches) * H
    assert len({sum(h) for h in per_head}) > 1 or len({n for h in per_head for n in h}) > 1  # not uniform
    for h in per_head:
        assert max(h) <= max(int(2.0 * sum(h) / H), 24) + 1


def test_evaluation_labels():
    from veloxquant_mlx.evaluation.results import make_caches, method_specs

    specs = {s.name: s for s in method_specs(["kvzip", "kvzip-ada", "kvzip-each", "kvzip-paper", "kvzip-plus"])}
    assert (specs["kvzip"].method, specs["kvzip"].prefill_only) == ("kvzip", True)
    assert specs["kvzip-ada"].allocation == "ada" and specs["kvzip-each"].opts == {"layers": "each"}
    model = make_tiny_model("llama")
    config = {n: make_caches(model, specs[n], 16)[0].config for n in ("kvzip", "kvzip-each", "kvzip-paper",
                                                                       "kvzip-plus")}
    fields = {n: (c.allocation, c.floor_alpha, c.max_head_factor, c.options.layers) for n, c in config.items()}
    assert config["kvzip"].options.normalize == "none" and config["kvzip-plus"].options.normalize == "plus"
    assert fields["kvzip-plus"] == fields["kvzip"]  # KVzip+ changes the score only
    # the default is the paper's head budget (one ranking, no floor) with our per-head cap; -paper drops the cap
    assert fields["kvzip"] == ("ada", 0.0, 2.0, "global")
    assert fields["kvzip-paper"] == ("ada", 0.0, None, "global")
    assert fields["kvzip-each"][0] == "uniform" and fields["kvzip-each"][3] == "each"


def test_method_default_head_budget():
    """kvzip defaults to the paper's head budgets; every other method keeps uniform; explicit values win."""
    assert KVCacheConfig("kvzip", budget=64).allocation == "ada"
    assert KVCacheConfig("snapkv", budget=64).allocation == "uniform"
    assert KVCacheConfig("snapkv", budget=64).max_head_factor == 1.1
    c = KVCacheConfig("kvzip", budget=64, allocation="uniform", max_head_factor=None, floor_alpha=0.2)
    assert (c.allocation, c.max_head_factor, c.floor_alpha) == ("uniform", None, 0.2)
    assert KVCacheConfig.from_dict(KVCacheConfig("kvzip", budget=64).to_dict()).max_head_factor == 2.0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_reconstruction_pass_equals_separate(arch, monkeypatch):
    """The one-pass reconstruction (the scoring softmax also gives the layer's output) keeps the same
    rows and gives the same tokens as scoring beside mlx-lm's attention, and skips that attention."""
    from veloxquant_mlx import tap

    model = make_tiny_model(arch)
    prompt = random_prompt(100, seed=6)
    calls = []
    original = tap._ORIGINAL_SDPA
    runs = {}
    for mode in ("fused", "separate"):
        calls.clear()
        caches = build(model, KVCacheConfig("kvzip", budget=24, n_sink=4, recent=4, kvzip_pass_attention=mode,
                                            kvzip_q_block=40))
        # counted after the tap is installed (it recognizes mlx-lm's own function)
        monkeypatch.setattr(tap, "_ORIGINAL_SDPA", lambda *a, **k: calls.append(a[0].shape[2]) or original(*a, **k))
        runs[mode] = (steps(model, prompt, caches, 6), [positions(c) for c in caches],
                      [np.array(c.stored("zip_score")) for c in caches], max(calls))
        monkeypatch.setattr(tap, "_ORIGINAL_SDPA", original)
    (tok_f, lp_f), pos_f, sc_f, widest_f = runs["fused"]
    (tok_s, lp_s), pos_s, sc_s, widest_s = runs["separate"]
    assert widest_s > 100 and widest_f < 100  # the pass's own (>100-query) attention ran only when separate
    assert tok_f == tok_s
    np.testing.assert_allclose(lp_f, lp_s, atol=1e-4)
    for a, b in zip(pos_f, pos_s):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for a, b in zip(sc_f, sc_s):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


# -- KVzip+ (normalize="plus") ------------------------------------------------------------------------------
def _plus_reference(q, ctx, own, scale, inv_h, o_w, values):
    """numpy: max over query heads g and queries t of softmax(q k / sqrt)[g, t, i] / ||h_t|| * ||W_o^g v_i||."""
    B, Hq, S, D = q.shape
    H = ctx.shape[1]
    G = Hq // H
    out = np.zeros((B, H, ctx.shape[2]))
    for h in range(H):
        for g in range(G):
            qq = q[0, h * G + g].astype(np.float64) * scale
            lc, lo = qq @ ctx[0, h].T, qq @ own[0, h].T
            lo = np.where(np.tril(np.ones((S, S), bool)), lo, -np.inf)
            m = np.maximum(lc.max(-1, keepdims=True), lo.max(-1, keepdims=True))
            z = np.exp(lc - m).sum(-1, keepdims=True) + np.exp(lo - m).sum(-1, keepdims=True)
            p = np.exp(lc - m) / z * inv_h[0][:, None]
            w = o_w[:, (h * G + g) * D:(h * G + g + 1) * D]
            wov = np.linalg.norm(values[0, h] @ w.T, axis=-1)
            out[0, h] = np.maximum(out[0, h], p.max(0) * wov)
    return out


def test_kvzip_plus_score_matches_the_formula():
    """KVzip+ (KVzap, arXiv 2601.07891): the probability over the query's hidden norm, times ||W_o^g v||, max over
    queries and the group; the fused one-pass path gives the same scores."""
    from veloxquant_mlx.methods.kvzip.ops import reconstruction_attend, reconstruction_scores, value_output_norms

    rng = np.random.default_rng(0)
    B, H, G, S, C, D, hidden = 1, 2, 3, 10, 14, 8, 20
    q = rng.normal(size=(B, H * G, S, D)).astype(np.float32)
    ctx, vals = (rng.normal(size=(B, H, C, D)).astype(np.float32) for _ in range(2))
    own, own_v = (rng.normal(size=(B, H, S, D)).astype(np.float32) for _ in range(2))
    o_w = rng.normal(size=(hidden, H * G * D)).astype(np.float32)
    inv_h = (1.0 / rng.uniform(0.5, 3.0, size=(B, S))).astype(np.float32)
    want = _plus_reference(q, ctx, own, D ** -0.5, inv_h, o_w, vals)
    wov = value_output_norms(mx.array(vals), mx.array(o_w), H * G)
    ref_wov = np.stack([np.linalg.norm(vals[0, h] @ o_w[:, (h * G + g) * D:(h * G + g + 1) * D].T, axis=-1)
                        for h in range(H) for g in range(G)]).reshape(1, H, G, C)
    np.testing.assert_allclose(np.array(wov), ref_wov, rtol=1e-4)
    plus = (mx.array(inv_h), wov)
    got = reconstruction_scores(mx.array(q), mx.array(ctx), mx.array(own), D ** -0.5, q_block=4, plus=plus)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4)
    _, fused = reconstruction_attend(mx.array(q), mx.array(ctx), mx.array(own), mx.array(vals), mx.array(own_v),
                                     D ** -0.5, q_block=3, plus=plus)
    np.testing.assert_allclose(np.array(fused), want, rtol=1e-4)
    plain = reconstruction_scores(mx.array(q), mx.array(ctx), mx.array(own), D ** -0.5)
    assert not np.allclose(np.array(plain), want)  # the weighting changes the score


@pytest.mark.parametrize("pass_attention", ["fused", "separate"])
def test_kvzip_plus_reads_each_global_layers_attention_input_on_a_hybrid_model(monkeypatch, pass_attention):
    """On a sliding-window hybrid (tiny Gemma 3), normalize="plus" hooks only the global layers' attention
    modules for the pass, hands each cache its own layer's input and W_o, and restores the classes."""
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import RotatingKVCache

    from veloxquant_mlx.methods.kvzip import method as kz

    model = make_tiny_model("gemma3", layers=6, heads=2, kv_heads=1, sliding_window=16, sliding_window_pattern=3,
                            query_pre_attn_scalar=50)
    seen, hidden = [], []
    real_scores, real_attend = kz.reconstruction_scores, kz.reconstruction_attend
    monkeypatch.setattr(KVzip, "observe_hidden", lambda self, h, w, _f=KVzip.observe_hidden:
                        (hidden.append((self.layer, np.array(h), np.array(w))), _f(self, h, w))[1])

    def spy_scores(q, ctx, own, scale, n_lead=0, q_block=512, plus=None):
        seen.append((np.array(q), np.array(ctx), np.array(own), scale, plus))
        return real_scores(q, ctx, own, scale, n_lead, q_block, plus)

    def spy_attend(q, ctx, own, cv, ov, scale, q_block=512, plus=None):
        seen.append((np.array(q), np.array(ctx), np.array(own), scale, plus))
        return real_attend(q, ctx, own, cv, ov, scale, q_block, plus)

    monkeypatch.setattr(kz, "reconstruction_scores", spy_scores)
    monkeypatch.setattr(kz, "reconstruction_attend", spy_attend)
    before = {}
    real_compress = EvictionCache.compress
    monkeypatch.setattr(EvictionCache, "compress", lambda self, b=None: (
        before.__setitem__(self.layer_idx, np.array(self.stored("zip_score")[0, :, :60])), real_compress(self, b))[1])
    prompt = random_prompt(60, seed=21)
    full = model.make_cache()  # the rows the kvzip caches hold before they evict
    mx.eval(model(mx.array([prompt]), cache=full))
    caches = build(model, kvzip(budget=24, kvzip_normalize="plus", kvzip_pass_attention=pass_attention))
    zips = [c for c in caches if isinstance(getattr(c, "method", None), KVzip)]
    assert [i for i, c in enumerate(caches) if isinstance(c, RotatingKVCache)] == [0, 1, 3, 4]
    steps(model, prompt, caches, 2)
    assert [i for i, _, _ in hidden] == [2, 5] and len(seen) == 2
    assert all(type(layer.self_attn) is gemma3_text.Attention for layer in model.layers)  # hooks removed
    for (i, h, w), (q, ctx, own, scale, plus), z in zip(hidden, seen, zips):
        assert scale == 50 ** -0.5  # the model's own softmax scale (query_pre_attn_scalar), not head_dim's
        np.testing.assert_array_equal(w, np.array(model.layers[i].self_attn.o_proj.weight))
        inv_h = 1.0 / np.linalg.norm(h.astype(np.float64), axis=-1)
        np.testing.assert_allclose(np.array(plus[0]), inv_h, rtol=1e-4)
        values = np.array(full[i].values[:, :, :60])
        want = _plus_reference(q, ctx, own, scale, inv_h, w, values)
        np.testing.assert_allclose(before[i], want[0], rtol=2e-3, atol=1e-7)
        assert z.method.passes == 1 and z.size() == 24 + 2


def test_kvzip_plus_without_an_attention_output_projection_is_a_clear_error():
    from types import SimpleNamespace

    from veloxquant_mlx.methods.kvzip.model_pass import _hidden_hooks

    cache = EvictionCache(kvzip(budget=24, kvzip_normalize="plus"), 0, 1)
    model = SimpleNamespace(layers=[SimpleNamespace(mixer=nn.Linear(4, 4))])  # no self_attn.o_proj
    with pytest.raises(ValueError, match="no attention module with o_proj"):
        with _hidden_hooks(model, [(cache, None)], {id(cache)}):
            pass
    with pytest.raises(ValueError, match="aligned with the cache list"):
        with _hidden_hooks(model, [(cache, None), (cache, None)], {id(cache)}):
            pass
