"""A task is one registered module: a task defined here runs through ``eval tasks --quick`` and gets
its own column in the report, without touching the harness, the CLI or the report code."""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx.evaluation.tasks import Instance, Turn, get_task, register_task, task_names, unregister_task

TINY = "tiny_echo"


def _tiny_generator(length, index, seed, n_facts):
    """A code hidden once in repeated filler; the question asks for it back."""
    code = str(40000 + 37 * index + seed)
    turn = Turn("What is the code?", "The code is", (code,), "number", 8)

    def make(n):
        units = ["The sky was grey."] * n
        units.insert(n // 2, f"The code is {code}.")
        return Instance(TINY, length, index, "Remember the code.\n\n", " ".join(units), (turn,))

    return make, 4 * length


def _score_any_order(turn, output):
    """This task's own scorer: right when the expected code occurs anywhere in the reply."""
    ok = turn.expected[0] in output
    return {"correct": ok, "recall": float(ok), "found": [turn.expected[0]] if ok else []}


def _columns(base, cell):
    return {f"{base} echo": cell["correct"]}


@pytest.fixture
def tiny_task():
    register_task(TINY, score=_score_any_order, columns=_columns)(_tiny_generator)
    yield get_task(TINY)
    unregister_task(TINY)


def test_registry_lists_the_built_in_tasks_in_report_order():
    assert task_names()[:7] == ("followup", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
                                "vt", "cwe")
    with pytest.raises(ValueError, match="already registered"):
        register_task("vt")(_tiny_generator)
    with pytest.raises(ValueError, match="unknown task 'nope'; known: followup, niah_single"):
        get_task("nope")


@pytest.mark.filterwarnings("ignore:.*receives a new prompt")
def test_a_task_registered_in_one_module_runs_through_eval_tasks(tmp_path, tiny_task):
    from lab.cli import main  # the package's eval tasks, then the lab's tasks report (tasks.md)
    from veloxquant_mlx.evaluation.results import ByteTokenizer

    inst, toks = tiny_task.build(ByteTokenizer(), 400, 0)
    assert len(toks) <= 400 and inst.answers_in_text and "40000" in inst.context
    out = tmp_path / "run"
    assert main(["eval", "tasks", "--quick", "--out-dir", str(out), "--no-progress", "--tasks", TINY,
                 "niah_single", "--lengths", "400", "--n-prompts", "2", "--methods", "full", "snapkv"]) == 0
    data = json.loads((out / "tasks.json").read_text())
    tiny = [c for c in data["cells"].values() if c["task"] == TINY]
    assert sorted((c["index"], c["method"]) for c in tiny) == [(0, "full"), (0, "snapkv"), (1, "full"), (1, "snapkv")]
    assert data["grid"]["tasks"] == [TINY, "niah_single"]
    for c in tiny:  # the task's own scorer judged every reply
        t = c["turns"][0]
        assert t["expected"] == [str(40000 + 37 * c["index"])]
        assert t["correct"] == (t["expected"][0] in t["output"]) == c["correct"]
    md = (out / "tasks.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| method |"))
    # the task's own report section, after the built-in tasks (registration order)
    assert header.index("niah_single 400") < header.index(f"{TINY} 400 echo")
    k = sum(c["correct"] for c in tiny if c["method"] == "snapkv")
    row = next(line for line in md.splitlines() if line.startswith("| snapkv |"))
    assert row.rstrip(" |").endswith(f"({k}/2)")


def test_an_unregistered_task_is_refused_by_the_cli(tmp_path, capsys):
    from veloxquant_mlx.cli import main

    assert main(["eval", "tasks", "--quick", "--out-dir", str(tmp_path), "--tasks", TINY]) != 0
    assert f"invalid choice: '{TINY}' (choose from 'followup', 'niah_single'" in capsys.readouterr().err
    assert not (tmp_path / "tasks.json").exists()
