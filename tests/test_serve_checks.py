"""What ``serve`` refuses before serving: flags out of range."""

import subprocess
import sys

import pytest

from conftest import make_tiny_model, tiny_tokenizer


# -- flags -------------------------------------------------------------------------------------------
BAD_FLAGS = [("--prefill-step-size", "0"), ("--decode-concurrency", "0"), ("--prompt-concurrency", "-1"),
             ("--max-tokens", "0"), ("--prompt-cache-size", "-1"), ("--mlx-cache-limit", "-5"),
             ("--prompt-cache-bytes", "-1G"), ("--max-kv-bytes", "nan"), ("--chat-template-args", "[1]")]


@pytest.mark.parametrize("flag,value", BAD_FLAGS)
def test_serve_flag_out_of_range_is_a_one_line_error(flag, value, capsys):
    from veloxquant_mlx.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", f"{flag}={value}"])  # "=": argparse reads "-1G" as a flag
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and flag in err and value in err, err


@pytest.mark.parametrize("option,value", [("prefill_step_size", 0), ("decode_concurrency", 0),
                                          ("prompt_concurrency", -1), ("max_tokens", 0), ("prompt_cache_size", -1),
                                          ("mlx_cache_limit", -5), ("max_kv_bytes", -1), ("temp", float("nan")),
                                          ("top_k", 1.5), ("top_p", 2.0), ("chat_template_args", [1])])
def test_serve_refuses_bad_options_before_anything_starts(option, value, monkeypatch):
    from mlx_lm import server

    from veloxquant_mlx.cli.serve import serve

    started = []
    monkeypatch.setattr(server, "ResponseGenerator", lambda *a: started.append("generator"))
    monkeypatch.setattr(server, "_run_http_server", lambda *a, **k: started.append("http"))
    monkeypatch.setattr(server, "BatchGenerator", server.BatchGenerator)  # serve() swaps it: restore after
    flag = "--" + option.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{flag} must be "):
        serve(make_tiny_model("llama"), tiny_tokenizer(), None, **{option: value})
    assert started == []


@pytest.mark.integration
@pytest.mark.parametrize("flag,value", [("--prefill-step-size", "0"), ("--mlx-cache-limit", "-5")])
def test_serve_with_a_bad_flag_exits_before_serving(flag, value):
    """Before: `--prefill-step-size 0` served, then looped forever on the first request; `--mlx-cache-limit
    -5` said it was serving, then failed with a multi-line binding error."""
    r = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "serve", "--model", "no-such-model", flag, value,
                        "--port", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and flag in r.stderr, r.stderr
    assert "serving" not in r.stdout + r.stderr and "Traceback" not in r.stderr
