"""KVzap (method="kvzap"): rows scored from their hidden states by a fitted linear scorer.

The contract matrix, batching, save/load and the two-rank run pick the method up from the registry
(the tiny models get scorers from the real fit in conftest); this file checks what is KVzap's own: the
hidden-state tap, the score of every prompt and decode row, the selection by that score, the scorer
file's identity checks, and the ridge fit.
"""

import warnings

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import batch_generate, generate_step

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, load_prompt_cache, save_prompt_cache
from veloxquant_mlx.caches import PAD_POSITION
from veloxquant_mlx.evaluation.labels import method_specs
from veloxquant_mlx.evaluation.kvzap_fit import hidden_states, split_windows, windows
from veloxquant_mlx.methods.kvzap import (KVzap, find_scorer, load_scorer, model_identity,
                                          read_scorer_metadata, save_scorer)
from veloxquant_mlx.methods.kvzap.fit import keep_overlap, r2, ridge, spearman
from veloxquant_mlx.tap import hidden_tap_installed, remove_query_tap

from conftest import fit_tiny_scorer, forbid_host_sync, greedy, make_tiny_model, random_prompt, tiny_tokenizer


def kvzap(budget=32, **kw):
    """kvzap's per-layer, uniform-head split unless a test names another (the default is checked below)."""
    kw.setdefault("kvzap_layers", "each")
    kw.setdefault("allocation", "uniform")
    return KVCacheConfig("kvzap", budget=budget, n_sink=kw.pop("n_sink", 4), recent=kw.pop("recent", 4), **kw)


def feed(model, caches, prompt, decode=0, step=16):
    """The prompt as mlx_lm.generate feeds it (chunks, then the last token alone), then greedy decode."""
    toks = list(prompt)
    for i in range(0, len(prompt) - 1, step):
        model(mx.array([prompt[i:min(i + step, len(prompt) - 1)]]), cache=caches)
    logits = model(mx.array([prompt[-1:]]), cache=caches)
    for _ in range(decode):
        tok = int(mx.argmax(logits[:, -1], axis=-1).item())
        toks.append(tok)
        logits = model(mx.array([[tok]]), cache=caches)
    return toks


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama")


def predicted(model, path, tokens):
    """{layer: (H, n)} the scorer's prediction for every token, from a plain forward's hidden states."""
    weights = load_scorer(path)[0]
    xs = hidden_states(model, tokens, sorted(weights))
    return {i: (xs[i] @ np.array(w) + np.array(b)).T for i, (w, b) in weights.items()}


def test_hidden_tap_hands_each_attention_its_input(model):
    KVCacheBuilder.for_model(model, kvzap())
    assert hidden_tap_installed(model)
    ids = mx.array([random_prompt(12, seed=1)])
    x = hidden_states(model, ids[0].tolist(), [0, 1])
    h0 = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    assert np.allclose(x[0], np.array(h0[0]), atol=1e-5)
    remove_query_tap(model)
    assert not hidden_tap_installed(model)
    assert type(model.model.layers[0].self_attn).__name__ == "Attention"


def test_a_cache_whose_method_reads_no_hidden_states_holds_none_under_the_tap(model):
    # kvzap's caches install the hidden-state tap on the model; caches of another method built on the same
    # model afterwards must not keep every layer's input alive (that is a chunk x d_model array per layer)
    KVCacheBuilder.for_model(model, kvzap())
    assert hidden_tap_installed(model)
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="snapkv", budget=48, recent=4))
    feed(model, caches, random_prompt(40, seed=3), decode=2)
    assert all(c.attention_input is None for c in caches)
    zap = KVCacheBuilder.for_model(model, kvzap(budget=200))
    model(mx.array([random_prompt(8, seed=4)]), cache=zap)
    assert all(c.needs_hidden for c in zap)


def test_every_prompt_and_decode_row_carries_its_predicted_score(model):
    path = fit_tiny_scorer(model)
    caches = KVCacheBuilder.for_model(model, kvzap(budget=200))  # nothing evicted: every row stays
    toks = feed(model, caches, random_prompt(40, seed=2), decode=6)
    pred = predicted(model, path, toks)
    for i, c in enumerate(caches):
        assert c.offset == len(toks) and c.evictions == 0
        assert np.allclose(np.array(c.stored("zap_score"))[0], pred[i], atol=1e-4)


def test_prompt_end_keeps_the_top_scored_rows_and_decode_evicts(model):
    path = fit_tiny_scorer(model)
    prompt = random_prompt(70, seed=3)
    caches = KVCacheBuilder.for_model(model, kvzap(budget=24))
    feed(model, caches, prompt)
    pred = predicted(model, path, prompt)
    for i, c in enumerate(caches):
        assert c.evictions == 1 and c.size() <= 24 + c.slack + 1
        pos = np.array(c.stored("positions"))[0]
        for h in range(pos.shape[0]):
            free = np.arange(4, len(prompt) - 4)  # not a sink, not in the recent window
            best = free[np.argsort(-pred[i][h, free], kind="stable")[:24 - 8]]
            kept = sorted(set(pos[h].tolist()) - set(range(4)) - set(range(len(prompt) - 4, len(prompt))))
            assert kept == sorted(best.tolist()), (i, h)
    caches = KVCacheBuilder.for_model(model, kvzap(budget=24))
    feed(model, caches, prompt, decode=60)
    assert all(c.evictions >= 2 and c.size() <= c.schedule.threshold() for c in caches)


def test_scoring_forces_no_host_sync(model):
    caches = KVCacheBuilder.for_model(model, kvzap(budget=24))
    prompt = mx.array([random_prompt(70, seed=4)])
    with forbid_host_sync():
        for s in range(0, 69, 16):
            model(prompt[:, s:min(s + 16, 69)], cache=caches)
        out = model(prompt[:, 69:], cache=caches)
        for _ in range(40):
            out = model(mx.argmax(out[:, -1:], axis=-1), cache=caches)
    assert caches[0].evictions >= 2


def test_scorer_of_another_model_is_a_clear_error(model, tmp_path):
    other = make_tiny_model("llama", seed=7)  # same shapes, other weights
    path = fit_tiny_scorer(other)
    assert model_identity(other) != model_identity(model)
    with pytest.raises(ValueError, match=r"fitted for llama L=2 d=64 .*not this model \(llama L=2 d=64"):
        KVCacheBuilder.for_model(model, kvzap(kvzap_scorer=str(path)))
    bigger = make_tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match="L=3"):
        KVCacheBuilder.for_model(bigger, kvzap(kvzap_scorer=str(fit_tiny_scorer(model))))


def test_missing_or_bad_scorer_says_how_to_fit_one(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VELOXQUANT_KVZAP_PATH", str(tmp_path))
    with pytest.raises(ValueError, match="fit-kvzap --model NAME --out FILE"):
        KVCacheBuilder.for_model(model, kvzap())
    bogus = tmp_path / "x.safetensors"
    mx.save_safetensors(str(bogus), {"a": mx.zeros(2)})
    with pytest.raises(ValueError, match="is not a kvzap scorer"):
        KVCacheBuilder.for_model(model, kvzap(kvzap_scorer=str(bogus)))
    with pytest.raises(ValueError, match="is not a file"):
        KVCacheBuilder.for_model(model, kvzap(kvzap_scorer=str(tmp_path / "none.safetensors")))


def test_scorer_is_found_by_identity_and_spelled_in_a_spec(model):
    path = fit_tiny_scorer(model)
    assert find_scorer(model_identity(model)) == path
    cfg = KVCacheConfig.parse(f"kvzap:scorer={path}", budget=32)
    assert cfg.options.scorer == str(path) and cfg == KVCacheConfig("kvzap", budget=32, kvzap_scorer=str(path))
    assert KVCacheConfig.parse(str(cfg)) == cfg  # the spec round-trips a path
    meta = read_scorer_metadata(path)
    assert meta["identity"] == model_identity(model) and meta["layers"] == [0, 1]
    assert {"commit", "command", "date", "text", "tokens"} <= set(meta["provenance"])
    assert {"r2", "spearman", "keep_overlap_0.2"} <= set(meta["quality"]["mean"])


def test_save_load_carries_the_scorer_and_refuses_a_changed_one(model, tmp_path):
    src = fit_tiny_scorer(model)
    path = tmp_path / "s.safetensors"
    path.write_bytes(src.read_bytes())
    a = KVCacheBuilder.for_model(model, kvzap(kvzap_scorer=str(path)))
    feed(model, a, random_prompt(50, seed=5), decode=3)
    save_prompt_cache(tmp_path / "c.safetensors", a)
    b = load_prompt_cache(tmp_path / "c.safetensors")
    assert (b[0].method.scorer, b[0].method.sha256) == (a[0].method.scorer, a[0].method.sha256)
    weights, meta, _ = load_scorer(path)
    w = {i: (np.array(x) + 1.0, np.array(y)) for i, (x, y) in weights.items()}
    save_scorer(path, w, meta["identity"], meta["fit"], meta["provenance"], meta["quality"])
    with pytest.raises(ValueError, match="changed since this cache was saved"):
        load_prompt_cache(tmp_path / "c.safetensors")


class Shard:  # the HeadShard layout of rank 1 of 2 (caches.shard), without a process group
    size, rank = 2, 1

    def total_heads(self, n):
        return 2 * n

    def local(self, x, n, axis=1):
        return mx.take(x, mx.arange(n, 2 * n), axis=axis)


def test_tensor_parallel_slices_the_scorer_columns(model):
    caches = KVCacheBuilder.for_model(model, kvzap(budget=200))
    c = caches[0]
    c.dist = Shard()
    w, b = c.method._layer_weights(1, c.view.shard)
    assert np.array_equal(np.array(w), np.array(c.method._weights[0])[:, 1:]) and np.array_equal(np.array(b), np.array(c.method._weights[1])[1:])


def test_generate_step_runs_kvzap(model):
    caches = KVCacheBuilder.for_model(model, kvzap(budget=24, kvzap_evict_every=4))
    out = [t for t, _ in zip((int(t) for t, _ in generate_step(mx.array(random_prompt(60, seed=6)), model,
                                                                prompt_cache=caches)), range(30))]
    assert len(out) == 30 and caches[0].evictions >= 2


def test_ridge_recovers_a_planted_linear_map():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 12))
    w, b = rng.normal(size=(12, 3)), rng.normal(size=3)
    y = x @ w + b + 0.01 * rng.normal(size=(2000, 3))
    fw, fb = ridge(x, y, 1e-6)
    assert np.allclose(fw, w, atol=0.01) and np.allclose(fb, b, atol=0.01)
    assert r2(x @ fw + fb, y) > 0.999 and r2(np.zeros_like(y) + y.mean(axis=0), y) == pytest.approx(0.0)
    assert spearman(y[:, 0], y[:, 0]) == pytest.approx(1.0) and spearman(-y[:, 0], y[:, 0]) == pytest.approx(-1.0)
    assert keep_overlap(y[:, 0], y[:, 0], 0.2) == 1.0 and keep_overlap(-y[:, 0], y[:, 0], 0.2) == 0.0


def test_fit_windows_split_train_validation_held_out():
    wins = windows(list(range(100)), 10, 8)
    assert len(wins) == 8 and wins[1] == list(range(10, 20))
    tr, va, te = split_windows(wins)
    assert (len(tr), len(va), len(te)) == (6, 1, 1) and te[0] == list(range(70, 80))
    with pytest.raises(Exception, match="at least 3"):
        split_windows(wins[:2])


def test_default_recent_is_the_papers_window_capped_at_half_the_budget():
    assert KVCacheConfig("kvzap", budget=1000).recent == 128
    assert KVCacheConfig("kvzap", budget=100).recent == 50
    assert KVzap.needs.hidden_states and not KVzap.prefill_only


def test_fit_command_refuses_bad_input_before_loading_a_model(tmp_path, capsys):
    from veloxquant_mlx.cli import main

    assert main(["fit-kvzap", "--out", str(tmp_path / "no" / "such" / "f.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["fit-kvzap", "--out", str(tmp_path / "f.safetensors"), "--texts", "2"]) == 2
    assert "--texts must be >= 3" in capsys.readouterr().err


def test_the_evaluations_shared_prefill_hands_kvzap_its_hidden_states(model):
    from veloxquant_mlx.evaluation.retrieval import shared_prefill_generate

    prompt = random_prompt(70, seed=8)
    out = shared_prefill_generate(model, prompt, {"kvzap": KVCacheBuilder.for_model(model, kvzap(budget=24))}, 6)
    alone = KVCacheBuilder.for_model(model, kvzap(budget=24))
    toks = feed(model, alone, prompt, decode=6)
    assert "error" not in out["kvzap"] and out["kvzap"]["tokens"][:6] == toks[len(prompt):]


def test_fitting_leaves_the_model_as_it_came():
    from veloxquant_mlx.model_pass import model_pass_installed
    from veloxquant_mlx.tap import query_tap_installed

    m = make_tiny_model("llama", seed=11)  # conftest fits its scorer
    assert not model_pass_installed(m) and not hidden_tap_installed(m) and not query_tap_installed(m)


def test_global_layers_rank_every_layers_predictions_once_and_keep_the_total(monkeypatch):
    from veloxquant_mlx.model_pass import ModelPassDriver

    def no_pass(*a, **k):
        raise AssertionError("kvzap ran an extra model forward")

    model = make_tiny_model("llama", layers=4)
    path = fit_tiny_scorer(model)  # (the fit itself runs KVzip+'s passes)
    monkeypatch.setattr(ModelPassDriver, "forward", no_pass)  # the ranking runs after the forward, no pass
    n, budget, L = 90, 24, 4
    prompt = random_prompt(n, seed=21)
    caches = KVCacheBuilder.for_model(model, kvzap(budget=budget, kvzap_layers="global"))
    feed(model, caches, prompt)
    pred = predicted(model, path, prompt)
    H = caches[0].keys.shape[1]
    free = np.arange(4, n - 4)  # not a sink, not in the recent window
    flat = np.concatenate([pred[i][:, free].ravel() for i in range(L)])
    thr = np.sort(flat)[::-1][L * H * (budget - 8) - 1]
    want = [8 + int(round((pred[i][:, free] >= thr).sum() / H)) for i in range(L)]
    shares = [c.schedule.share for c in caches]
    assert shares == want and len(set(shares)) > 1 and abs(sum(shares) - L * budget) <= L // 2
    for i, c in enumerate(caches):  # each layer keeps its share: its heads' top predictions
        pos = np.array(c.stored("positions"))[0]
        assert c.size() == shares[i] and c.schedule.keep() == shares[i] and c.budget == budget
        for h in range(H):
            best = free[np.argsort(-pred[i][h, free], kind="stable")[:shares[i] - 8]]
            kept = sorted(set(pos[h].tolist()) - set(range(4)) - set(range(n - 4, n)))
            assert kept == sorted(best.tolist()), (i, h)
    each = KVCacheBuilder.for_model(model, kvzap(budget=budget))
    feed(model, each, prompt)
    assert [c.size() for c in each] == [budget] * L and all(c.schedule.share is None for c in each)


def test_global_layers_hold_their_shares_through_decode_save_and_load(model, tmp_path):
    fit_tiny_scorer(model)
    caches = KVCacheBuilder.for_model(model, kvzap(budget=24, kvzap_layers="global"))
    feed(model, caches, random_prompt(80, seed=22), decode=50)
    shares = [c.schedule.share for c in caches]
    assert all(s is not None for s in shares)
    for c, s in zip(caches, shares):  # decode evicts each layer back to its own share, not the budget
        assert c.evictions >= 2 and c.size() <= s + c.slack and c.schedule.threshold() == s + c.slack
        assert c.positions.shape[2] == s + c.slack + 1  # and its buffers hold that share, not the budget
    save_prompt_cache(tmp_path / "g.safetensors", caches)
    assert [c.schedule.share for c in load_prompt_cache(tmp_path / "g.safetensors")] == shares


def test_default_is_one_ranking_across_layers_with_ada_heads(model):
    cfg = KVCacheConfig("kvzap", budget=24, n_sink=4, recent=4)
    assert (cfg.options.layers, cfg.allocation, cfg.floor_alpha, cfg.max_head_factor) == ("auto", "ada", 0.0, 2.0)
    assert str(cfg) == "kvzap:budget=24,recent=4"
    each = method_specs(["kvzap-each"])[0].config(24)  # the label of the per-layer uniform split
    assert each == KVCacheConfig("kvzap", budget=24, kvzap_layers="each", allocation="uniform")
    fit_tiny_scorer(model)
    L = len(model.layers)
    caches = KVCacheBuilder.for_model(model, cfg)
    feed(model, caches, random_prompt(90, seed=23), decode=40)
    shares = [c.schedule.share for c in caches]
    assert all(s is not None for s in shares) and abs(sum(shares) - L * 24) <= L // 2
    for c, s in zip(caches, shares):  # Ada heads: ragged per head, the layer's total at its share
        real = np.array(c.stored("positions"))[0] != PAD_POSITION
        assert c.evictions >= 2 and real.sum() <= real.shape[0] * (s + c.slack)
    with pytest.raises(ValueError, match=r"allocation='ada' \(kvzap's default\)"):
        KVCacheConfig("kvzap", budget=24, recall="memory")
    stream = KVCacheBuilder.for_model(model, cfg.replace(prompt_eviction="stream"))  # auto: one ranking there too
    feed(model, stream, random_prompt(90, seed=23))
    assert all(c.method.layer_shares and c.schedule.share is not None for c in stream)
    assert KVCacheConfig("kvzap", budget=24, recall="memory", allocation="uniform").recall == "memory"


@pytest.mark.parametrize("allocation", ["uniform", "ada"])
def test_streaming_ranks_every_chunk_across_layers_and_keeps_the_whole_prompts_top_rows(allocation):
    """prompt_eviction="stream": after every chunk's forward one ranking of all layers' rows (the total
    stays layers x heads x budget while the prompt streams in). A row's score is fixed when it arrives,
    so the first layer, whose hidden states do not depend on what was evicted, ends with exactly the
    whole prompt's top rows at its share: nothing it evicted early would have been kept at the end."""
    model = make_tiny_model("llama", layers=4)
    path = fit_tiny_scorer(model)
    n, budget, step, L = 201, 24, 16, 4
    prompt = random_prompt(n, seed=5)
    cfg = KVCacheConfig("kvzap", budget=budget, n_sink=4, recent=4, allocation=allocation,
                        prompt_eviction="stream", max_head_factor=100.0)
    caches = KVCacheBuilder.for_model(model, cfg)
    H, totals = None, []
    for i in range(0, n - 1, step):
        model(mx.array([prompt[i:min(i + step, n - 1)]]), cache=caches)
        H = caches[0].keys.shape[1]
        totals.append(sum(int((np.array(c.stored("positions")) != PAD_POSITION).sum()) for c in caches))
    slack = caches[0].slack  # ranked once the prompt passes budget + slack, then after every chunk
    assert max(totals) <= L * H * (budget + slack) and all(abs(t - L * H * budget) <= L * H for t in totals[4:])
    shares = [c.schedule.share for c in caches]
    assert all(c.evictions >= 5 for c in caches) and len(set(shares)) > 1
    pred = predicted(model, path, prompt[:-1])[0]  # layer 0: the embeddings' scores, as streamed
    free = np.arange(4, n - 1 - 4)
    pos = np.array(caches[0].stored("positions"))[0]
    kept = [set(pos[h].tolist()) - {PAD_POSITION} - set(range(4)) - set(range(n - 5, n)) for h in range(H)]
    k = H * (shares[0] - 8)
    if allocation == "uniform":
        want = [set(free[np.argsort(-pred[h, free], kind="stable")[:shares[0] - 8]].tolist()) for h in range(H)]
    else:  # one ranking of the layer's (row, head) pairs
        thr = np.sort(pred[:, free].ravel())[::-1][k - 1]
        want = [set(free[pred[h, free] >= thr].tolist()) for h in range(H)]
    assert kept == want


def test_global_layers_with_a_cold_tier_lose_nothing_and_keep_their_shares(model, tmp_path):
    from test_recall import assert_nothing_lost

    fit_tiny_scorer(model)
    cfg = KVCacheConfig("kvzap", budget=24, n_sink=4, recent=4, allocation="uniform", recall="disk",
                        recall_dir=str(tmp_path), recall_page=8)
    caches = KVCacheBuilder.for_model(model, cfg)
    feed(model, caches, random_prompt(90, seed=24))
    shares = [c.schedule.share for c in caches]
    assert all(s is not None for s in shares) and len(set(shares)) > 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the follow-up on a used cache is meant)
        feed(model, caches, random_prompt(20, seed=25), decode=10)  # it recalls, then ranks the layers again
    for c in caches:
        assert c.cold.recalls >= 1 and c.schedule.share is not None and c.size() <= c.schedule.share + c.slack
        assert_nothing_lost(c)


def test_default_batch_generate_equals_each_prompt_alone(model):
    """The default's ranking runs per sequence of a batch (each row's layers ranked on their own)."""
    fit_tiny_scorer(model)
    prompts = [random_prompt(n, seed=s) for n, s in ((70, 1), (45, 2), (96, 3))]
    config = KVCacheConfig("kvzap", budget=24, n_sink=4, recent=4)  # layers auto -> global, Ada heads
    alone = []
    for p in prompts:
        caches = KVCacheBuilder.for_model(model, config)
        alone.append((greedy(model, p, 6, prompt_cache=caches, prefill_step_size=16)[0], caches))
    KVCacheBuilder.install(model, config)
    try:
        out = batch_generate(model, tiny_tokenizer(), prompts, max_tokens=6, prefill_step_size=16,
                             return_prompt_caches=True, return_token_ids=True)
    finally:
        KVCacheBuilder.uninstall(model)
    assert any(c.schedule.share not in (None, 24) for _, caches in alone for c in caches)
    for (tokens, caches), got, got_caches in zip(alone, out.token_ids, out.caches):
        assert list(got) == tokens
        for a, b in zip(caches, got_caches):
            assert a.schedule.share == b.schedule.share and a.offset == b.offset
            assert np.array_equal(np.array(a.kept_positions()), np.array(b.kept_positions()))


def test_mlp_fit_learns_what_a_linear_map_cannot():
    from veloxquant_mlx.methods.kvzap.fit import fit_layers, fit_mlp_layers, mlp_predict

    rng = np.random.default_rng(1)

    def texts(n, k):
        out = []
        for _ in range(k):
            x = rng.normal(size=(n, 8))
            y = np.stack([np.abs(x[:, 0]) + x[:, 1], np.maximum(x[:, 2], 0) * 2.0], axis=1)  # not linear
            out.append((x, y))
        return {0: out}

    train, val, test = texts(400, 6), texts(200, 1), texts(300, 2)
    _, lin, _ = fit_layers(train, val, test)
    weights, q, epochs = fit_mlp_layers(train, val, test, hidden=32, epochs=30, lr=5e-3, batch=64)
    assert q[0]["r2"] > 0.95 > lin[0]["r2"] + 0.1 and 1 <= epochs[0] <= 30
    w1, b1, w, b = weights[0]
    assert w1.shape == (8, 32) and w.shape == (32, 2)
    x, y = test[0][0]
    assert np.mean((mlp_predict(x, *weights[0]) - y) ** 2) < 0.05 * y.var()


def test_an_mlp_scorer_scores_rows_in_the_cache_and_a_refit_reuses_the_collected_windows(tmp_path, monkeypatch):
    from veloxquant_mlx.evaluation import kvzap_fit as collect
    from veloxquant_mlx.methods.kvzap.fit import mlp_predict
    from conftest import tiny_tokenizer

    m = make_tiny_model("llama", seed=12)
    wins = [np.random.default_rng(s).integers(0, int(m.args.vocab_size), size=40).tolist() for s in range(5)]
    path = tmp_path / "mlp.safetensors"
    meta = collect.fit_scorer(m, tiny_tokenizer(), wins, path, "random ids", data_dir=tmp_path / "data",
                              kind="mlp", mlp={"hidden": 16, "epochs": 3})
    assert meta["fit"]["kind"] == "mlp" and meta["fit"]["hidden"] == 16 and len(list((tmp_path / "data").glob("*.npz"))) == 5

    def no_pass(*a, **k):
        raise AssertionError("the refit ran the model again")

    monkeypatch.setattr(collect, "kvzip_plus_rows", no_pass)
    collect.fit_scorer(m, tiny_tokenizer(), wins, tmp_path / "lin.safetensors", "random ids", data_dir=tmp_path / "data")
    caches = KVCacheBuilder.for_model(m, kvzap(budget=200, kvzap_scorer=str(path)))
    toks = feed(m, caches, random_prompt(30, seed=9), decode=4)
    weights = load_scorer(path)[0]
    xs = hidden_states(m, toks, sorted(weights))
    for i, c in enumerate(caches):
        assert len(weights[i]) == 4
        assert np.allclose(np.array(c.stored("zap_score"))[0], mlp_predict(xs[i], *weights[i]).T, atol=1e-4)
    c = KVCacheBuilder.for_model(m, kvzap(budget=200, kvzap_scorer=str(path)))[0]
    c.dist = Shard()  # tensor parallel: the MLP's first layer is whole, its output columns this rank's
    w1, b1, w, b = c.method._layer_weights(1, c.view.shard)
    assert np.array_equal(np.array(w1), np.array(weights[0][0])) and np.array_equal(np.array(b1), np.array(weights[0][1]))
    assert np.array_equal(np.array(w), np.array(weights[0][2])[:, 1:]) and np.array_equal(np.array(b), np.array(weights[0][3])[1:])
    with pytest.raises(ValueError, match=r"\(W, b\) or \(W1, b1, W, b\)"):
        save_scorer(tmp_path / "bad.safetensors", {0: weights[0][:3]}, {}, {}, {}, {})
