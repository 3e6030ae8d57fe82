"""Task generators, prompt rendering, scoring and the tasks harness / report (no real model)."""

import collections
import dataclasses
import re

import pytest

from veloxquant_mlx.evaluation.results import ByteTokenizer
from veloxquant_mlx.evaluation.task_prompts import continuation, render_first, render_text, reply_text, score
from veloxquant_mlx.evaluation.tasks import TASKS, Turn, build, cwe_vocabulary


class WordTokenizer:
    """One token per word / punctuation / whitespace run (ids assigned on first sight), with a tiny
    chat template, so lengths behave like a real tokenizer's and the template path is exercised."""

    has_chat_template = True
    eos_token_id = 0

    def __init__(self):
        self.vocab, self.inv = {"<eos>": 0}, ["<eos>"]

    def encode(self, text, add_special_tokens=True):
        ids = []
        for piece in re.findall(r"<eos>|\w+|[^\w\s]|\s+", text):
            if piece not in self.vocab:
                self.vocab[piece] = len(self.inv)
                self.inv.append(piece)
            ids.append(self.vocab[piece])
        return ids

    def decode(self, ids):
        return "".join(self.inv[i] for i in ids)

    def apply_chat_template(self, msgs, tokenize=False, add_generation_prompt=True):
        text = "".join(f"[{m['role']}]\n{m['content']}<eos>\n" for m in msgs)
        return text + ("[assistant]\n" if add_generation_prompt else "")


@pytest.fixture(scope="module")
def tok():
    return WordTokenizer()


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [1024, 2048, 4096])
def test_length_hits_target_and_answer_in_text(tok, task, length):
    inst, toks = build(tok, task, length, index=3)
    assert len(toks) <= length
    assert len(toks) >= 0.9 * length, (task, length, len(toks))  # within one filler unit (a sentence)
    assert toks == render_first(tok, inst)
    assert inst.answers_in_text
    for t in inst.turns:
        for w in t.wrong[:50]:
            assert w not in t.expected


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_from_seed(tok, task):
    a = build(tok, task, 1024, index=1, seed=5)
    b = build(tok, task, 1024, index=1, seed=5)
    assert a == b
    c = build(tok, task, 1024, index=2, seed=5)
    d = build(tok, task, 1024, index=1, seed=6)
    assert a[0].turns != c[0].turns and a[0].turns != d[0].turns


def test_byte_tokenizer_without_template():
    inst, toks = build(ByteTokenizer(), "niah_single", 1024, 0)
    text = bytes(toks).decode()
    assert len(toks) <= 1024 and text.endswith(inst.turns[0].reply_prefix)
    assert inst.turns[0].question in text and inst.turns[0].expected[0] in text


def test_needle_values_unique_and_placed(tok):
    inst, _ = build(tok, "niah_multikey", 2048, 0)
    (t,) = inst.turns
    assert inst.context.count(t.expected[0]) == 1 and len(t.wrong) == 3
    for v in t.wrong:  # the distractor keys' values are in the text too
        assert inst.context.count(v) == 1
    mv, _ = build(tok, "niah_multivalue", 2048, 0)
    assert len(mv.turns[0].expected) == 4 and len(set(mv.turns[0].expected)) == 4
    key = re.search(r"numbers for (\S+) ", mv.turns[0].question).group(1)
    assert mv.context.count(f"for {key} is") == 4


def test_followup_turns_ask_different_facts(tok):
    for n in (2, 3, 4):
        inst, _ = build(tok, "followup", 2048, 0, n_facts=n)
        assert len(inst.turns) == n
        assert len({t.expected[0] for t in inst.turns}) == n
        for t in inst.turns:
            assert set(t.wrong) == {u.expected[0] for u in inst.turns} - {t.expected[0]}
    with pytest.raises(ValueError, match="2-4"):
        build(tok, "followup", 2048, 0, n_facts=5)


def test_vt_chain_resolves_to_value(tok):
    inst, _ = build(tok, "vt", 2048, 0)
    t = inst.turns[0]
    value = re.search(r"value (\d+)", t.question).group(1)
    binding = dict(re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", inst.context))

    def resolve(n):
        v = binding[n]
        return resolve(v[4:]) if v.startswith("VAR ") else v

    assert {n for n in binding if resolve(n) == value} == set(t.expected)
    assert all(resolve(n) != value for n in t.wrong)


def test_cwe_expected_are_most_frequent(tok):
    inst, _ = build(tok, "cwe", 2048, 0)
    words = re.findall(r"\d+\. (\w+)", inst.context)
    counts = collections.Counter(words)
    top = {w for w, _ in counts.most_common(10)}
    assert top == set(inst.turns[0].expected)
    assert min(counts[w] for w in top) > max(c for w, c in counts.items() if w not in top)
    assert len(cwe_vocabulary()) > 500


def test_score_number_rejects_wrong():
    t = Turn("q", "p", ("12345",), "number", 8, ("54321",))
    assert score(t, " 12345.")["correct"]
    assert not score(t, " 1234.")["correct"]
    assert not score(t, " 123456")["correct"]
    assert not score(t, " 54321, or 12345")["correct"]  # the first number counts
    assert not score(t, " I do not know")["correct"]


def test_score_sets_need_all_and_no_wrong():
    t = Turn("q", "p", ("111", "222", "333"), "numbers", 40, ("999",))
    assert score(t, " 333, 111 and 222.")["correct"]
    r = score(t, " 111 and 222.")
    assert not r["correct"] and r["recall"] == pytest.approx(2 / 3, abs=1e-4)
    assert not score(t, " 111, 222, 333, 999")["correct"]
    w = Turn("q", "p", ("ABCDE", "FGHIJ"), "words", 20, ("KLMNO",))
    assert score(w, " ABCDE, FGHIJ")["correct"]
    assert not score(w, " ABCDE, FGHIJ, KLMNO")["correct"]
    assert not score(w, " ABCDE")["correct"]
    c = Turn("q", "p", ("apple", "pear"), "words", 20, ("plum",))
    assert score(c, " Apple, pear.")["correct"] and not score(c, " apple, plum")["correct"]


@pytest.mark.parametrize("tk", [WordTokenizer(), ByteTokenizer()])
@pytest.mark.parametrize("ends_with_eos", [False, True])
def test_continuation_extends_the_cached_tokens(tk, ends_with_eos):
    """prompt + reply tokens except the last + continuation == the re-rendered conversation."""
    inst, toks = build(tk, "followup", 1024, 0)
    out = tk.encode(" 12345.") + ([tk.eos_token_id] if ends_with_eos and tk.eos_token_id is not None else [])
    eos = (tk.eos_token_id,) if tk.eos_token_id is not None else ()
    reply = reply_text(tk, inst, 0, out, eos)
    assert reply == inst.turns[0].reply_prefix + " 12345."
    cont = continuation(tk, inst, [reply], out[-1], eos)
    whole = toks + out[:-1] + cont
    assert tk.decode(whole) == render_text(tk, inst, [reply])
    assert tk.decode(cont).endswith(inst.turns[1].reply_prefix)


def _tiny():
    from veloxquant_mlx.evaluation.results import tiny_model

    return tiny_model()


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_shared_prefill_equals_plain_path():
    """One shared prefill per prompt gives every method the tokens its own prefill gives, on every turn."""
    from veloxquant_mlx.evaluation.results import load_eval_model, make_caches, method_specs
    from veloxquant_mlx.evaluation.task_eval import needs_own_prefill, run_prompt

    model, tk, _ = load_eval_model(quick=True)  # (the tiny model; kvzip learns its repeat prompt here)
    inst, toks = build(tk, "followup", 700, 0, n_facts=2)
    inst = dataclasses.replace(inst, turns=tuple(dataclasses.replace(t, max_new_tokens=4) for t in inst.turns))
    specs = method_specs(["full", "nexus", "snapkv", "nestedkv", "kvzip"])
    res = {}
    for shared in (True, False):
        named = {s.name: (make_caches(model, s, 140), needs_own_prefill(s)) for s in specs}
        res[shared] = run_prompt(model, tk, inst, toks, named, shared)
    assert needs_own_prefill(specs[-1]) and not res[True]["kvzip"]["shared_prefill"]  # kvzip: plain path
    assert res[True]["kvzip"]["kv_bytes_after_prompt"] < res[True]["full"]["kv_bytes_after_prompt"]
    for s in specs:
        assert "turns" in res[True][s.name], res[True][s.name]
        assert res[True][s.name]["shared_prefill"] == (s.name != "kvzip") and not res[False][s.name]["shared_prefill"]
        assert [t["output"] for t in res[True][s.name]["turns"]] == [t["output"] for t in res[False][s.name]["turns"]]
        assert len(res[True][s.name]["turns"]) == 2 and res[True][s.name]["turns"][1]["fed_tokens"] > 1
    assert res[True]["nexus"]["kv_bytes_after_prompt"] < res[True]["full"]["kv_bytes_after_prompt"]


def test_number_stop():
    from veloxquant_mlx.evaluation.task_eval import number_done

    assert not number_done(" 123") and number_done(" 123.") and not number_done(" The")


def _task_run(tmp_path, name, *extra):
    import json

    from veloxquant_mlx.cli import main

    out = tmp_path / name
    argv = ["eval", "tasks", "--quick", "--out-dir", str(out), "--no-progress",
            "--tasks", "niah_single", "followup", "--lengths", "700", "--n-prompts", "1", "--n-facts", "2",
            "--methods", "full", "rotating", "nexus", "snapkv", "--densities", "0.2",
            "--budgets", "300", "--question", "in", "out", *extra]
    assert main(argv) == 0
    return json.loads((out / "tasks.json").read_text())["cells"]


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_shared_prefill_cell_equals_the_cell_run_alone(tmp_path, monkeypatch):
    """Every cell of a shared-prefill run (fan-out of two methods per pass, the full cache as the pass's
    own cache, the prompt in 256-token chunks) has the tokens and KV bytes of the same cell run alone:
    mlx-lm's RotatingKVCache, a fixed budget, and the question left out of what is compressed included
    (4-bit rows: below)."""
    from veloxquant_mlx.evaluation import task_run

    monkeypatch.setattr(task_run, "PREFILL_STEP", 256)  # a long prompt's chunked prefill, on a short one
    shared = _task_run(tmp_path, "shared", "--fanout", "2")
    alone = _task_run(tmp_path, "alone", "--no-shared-prefill")
    # 2 tasks x 2 question variants x (the full cache + 3 rows x 2 budgets)
    assert set(shared) == set(alone) and len(shared) == 2 * 2 * (1 + 3 * 2)
    for cid, c in shared.items():
        a = alone[cid]
        assert "turns" in c and "turns" in a, (cid, c.get("error"), a.get("error"))
        assert [t["output"] for t in c["turns"]] == [t["output"] for t in a["turns"]], cid
        assert c["kv_bytes_after_prompt"] == a["kv_bytes_after_prompt"], cid
        assert c["shared_prefill"] == (c["method"] in ("full", "nexus", "snapkv")) and not a["shared_prefill"]
    fixed = [c for c in shared.values() if c.get("budget_tokens") == 300]
    assert fixed and all(c["budget"] == 300 for c in fixed)
    out = [c for c in shared.values() if c.get("question") == "out"]
    assert out and all(c["question_tokens"] > 5 and c["kv_bytes_after_context"] > 0 for c in out)
    # the question left out is a different computation: some cache holds other bytes after the prompt
    pair = {(c["task"], c["method"], c.get("budget_tokens"), c["density"]): c for c in shared.values()
            if c.get("question") != "out"}
    assert any(c["kv_bytes_after_prompt"] != pair[(c["task"], c["method"], c.get("budget_tokens"),
                                                   c["density"])]["kv_bytes_after_prompt"] for c in out)
    # rotating holds budget rows, the full cache every row
    rot = next(c for c in shared.values() if c["method"] == "rotating" and c.get("budget_tokens") == 300)
    full = next(c for c in shared.values() if c["method"] == "full" and c["task"] == rot["task"]
                and c.get("question") == rot.get("question"))
    assert rot["kv_bytes_after_prompt"] < 0.6 * full["kv_bytes_after_prompt"]


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_quantized_rows_equal_alone_with_the_question_left_out():
    """mlx-lm's QuantizedKVCache (full-4bit) and 4-bit eviction rows take their own prefill inside a
    shared run and equal the run alone (tokens, bytes), with the question inside and left out."""
    from conftest import make_tiny_model

    from veloxquant_mlx.evaluation.results import ByteTokenizer, make_caches, method_specs
    from veloxquant_mlx.evaluation.task_eval import needs_own_prefill, run_prompt
    from veloxquant_mlx.evaluation.task_prompts import split_question

    model = make_tiny_model("llama", heads=2, kv_heads=1, hidden_size=128, vocab_size=256)  # head_dim 64
    tk = ByteTokenizer()
    inst, toks = build(tk, "niah_single", 600, 0)
    specs = method_specs(["full", "full-4bit", "nexus-4bit", "nexus", "rotating"])
    assert [needs_own_prefill(s) for s in specs] == [False, True, True, False, True]
    for ctx, q in ((toks, None), split_question(tk, inst)):
        res = {}
        for shared in (True, False):
            named = {s.name: (make_caches(model, s, 120), needs_own_prefill(s)) for s in specs}
            res[shared] = run_prompt(model, tk, inst, ctx, named, shared, question_tokens=q, fanout=1)
        for s in specs:
            a, b = res[True][s.name], res[False][s.name]
            assert "turns" in a and "turns" in b, (s.name, a.get("error"), b.get("error"))
            assert a["turns"][0]["output"] == b["turns"][0]["output"]
            assert a["kv_bytes_after_prompt"] == b["kv_bytes_after_prompt"]
        assert res[True]["full-4bit"]["kv_bytes_after_prompt"] < 0.5 * res[True]["full"]["kv_bytes_after_prompt"]
    assert split_question(tk, inst)[0] + split_question(tk, inst)[1] == toks  # bytes: the cut loses nothing


def test_lengths_over_the_models_context_are_refused():
    from conftest import make_tiny_model

    from veloxquant_mlx.evaluation.outputs import check_lengths, model_context

    model = make_tiny_model("llama")  # max_position_embeddings 4096
    assert model_context(model) == 4096
    check_lengths(model, [1024, 4096 - 256])
    with pytest.raises(ValueError, match="exceed the model's context of 4096 tokens .at most 3840"):
        check_lengths(model, [2048, 4096])
    check_lengths(type("M", (), {"args": None})(), [10 ** 6])  # a model that does not say: no check


def test_haystack_reaches_32k_and_short_prompts_keep_their_filler(tok):
    from veloxquant_mlx.evaluation.tasks import long_filler, prose_sentences

    first = prose_sentences(5)
    assert long_filler(5)[:len(first)] == first and len(long_filler(5)) == 3 * len(first)
    n_words = len(" ".join(first).split())
    inst, toks = build(tok, "niah_single", int(1.5 * n_words), 0)  # past one pass of the prose
    assert len(toks) > n_words and inst.answers_in_text
