"""What ``serve`` refuses before serving: malformed request bodies (checked field by field, in process),
flags out of range, and a generation thread that dies (the process exits instead of lingering).

``MALFORMED`` is the table of bad requests that tests/test_serve.py also sends to a live server.
"""

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from veloxquant_mlx.cli.serve_checks import BadRequest, check_request

from conftest import VOCAB, make_tiny_model, tiny_tokenizer

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
GOOD_CHAT = {"model": "default_model", "messages": [{"role": "user", "content": "t1 t2 t3"}], "max_tokens": 3}
GOOD_TEXT = {"model": "default_model", "prompt": "t1 t2 t3", "max_tokens": 3}
ABSENT = object()

# Fields every completion request may carry: (field, a bad value). Each is sent on both endpoints.
BAD_FIELDS = [
    ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", "5"), ("max_tokens", 1.5), ("max_tokens", None),
    ("max_tokens", True), ("max_completion_tokens", 0), ("temperature", -0.1), ("temperature", "hot"),
    ("temperature", None), ("top_p", 1.5), ("top_p", [1]), ("top_k", -1), ("top_k", 2.5), ("min_p", 2),
    ("repetition_penalty", -1), ("repetition_context_size", -1), ("presence_penalty", "x"),
    ("frequency_penalty", [1]), ("xtc_probability", 2), ("xtc_threshold", 0.9), ("logprobs", "yes"),
    ("top_logprobs", 100), ("top_logprobs", "x"), ("n", 2), ("n", "1"), ("seed", -1), ("seed", 2**64),
    ("stream", "yes"), ("stream", None), ("stream_options", 5), ("stream_options", {"include_usage": "yes"}),
    ("stop", 5), ("stop", [5]), ("stop", {"a": 1}), ("logit_bias", 5), ("logit_bias", {"x": 1}),
    ("logit_bias", {"99999999": 1}), ("logit_bias", {"-1": 1}), ("logit_bias", {"5": "x"}), ("model", 5),
    ("draft_model", "other/model"), ("adapters", "some/adapter"), ("chat_template_kwargs", 5),
]
_CHAT = [
    ("messages", ABSENT), ("messages", None), ("messages", "hi"), ("messages", []), ("messages", [5]),
    ("messages", [{"content": "t1"}]), ("messages", [{"role": "wizard", "content": "t1"}]),
    ("messages", [{"role": "user", "content": 123}]), ("messages", [{"role": "user"}]),
    ("messages", [{"role": "user", "content": [5]}]),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/a.png"}}]}]),
    ("messages", [{"role": "user", "content": [{"type": "text", "text": 5}]}]),
    ("messages", [{"role": "user", "content": "t1", "name": 5}]),
    ("messages", [{"role": "assistant", "tool_calls": 5}, {"role": "user", "content": "t1"}]),
    ("messages", [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{no"}}]},
                  {"role": "user", "content": "t1"}]),
    ("tools", 5), ("tools", [5]), ("role_mapping", 5), ("role_mapping", {"user": 5}),
]
_TEXT = [("prompt", ABSENT), ("prompt", ""), ("prompt", None), ("prompt", 12345), ("prompt", ["t1", "t2"]),
         ("prompt", [1, 2]), ("prompt", {"a": 1})]


def _with(body, field, value):
    body = dict(body)
    if value is ABSENT:
        body.pop(field)
    else:
        body[field] = value
    return body


# (path, body, a word the refusal must contain): every one answered 4xx by a live server.
MALFORMED = ([(CHAT, _with(GOOD_CHAT, f, v), f) for f, v in BAD_FIELDS + _CHAT]
             + [(TEXT, _with(GOOD_TEXT, f, v), f) for f, v in BAD_FIELDS[::3] + _TEXT])
# Bodies whose fields are all well typed, refused once the prompt is built (tokenized to nothing).
EMPTY_ONCE_TOKENIZED = [(TEXT, _with(GOOD_TEXT, "prompt", " "), "prompt"),
                        (CHAT, _with(GOOD_CHAT, "messages", [{"role": "user", "content": ""}]), "prompt")]
# Raw bodies mlx-lm's parser refuses or chokes on: (path, bytes, a word the refusal must contain).
RAW = [(CHAT, b"{not json", "JSON"), (CHAT, b"\xff\xfe{}", "UTF-8"), (TEXT, b"[1, 2]", "JSON"),
       (CHAT, b"null", "JSON"), (CHAT, b"[" * 100_000, "JSON"),
       (CHAT, b'{"messages": [{"role": "user", "content": "t1"}], "temperature": NaN}', "temperature"),
       (TEXT, b'{"prompt": "t1", "top_p": Infinity}', "top_p")]
# What a refusal must never read like: Python's own errors about the server's code.
INTERNAL = ("object has no attribute", "not iterable", "can only concatenate", "unhashable", "Traceback",
            "NoneType", "generation thread")


def _ids(cases):
    return [f"{path.rsplit('/', 1)[1]}-{word}-{i}" for i, (path, _, word) in enumerate(cases)]


@pytest.mark.parametrize("path,body,word", MALFORMED, ids=_ids(MALFORMED))
def test_check_request_refuses_malformed_bodies_naming_the_field(path, body, word):
    with pytest.raises(BadRequest) as err:
        check_request(path, body, VOCAB)
    text = str(err.value)
    assert word in text and len(text.splitlines()) == 1 and not any(x in text for x in INTERNAL), text


@pytest.mark.parametrize("path,body", [
    (CHAT, GOOD_CHAT), (TEXT, GOOD_TEXT),
    (CHAT, _with(GOOD_CHAT, "messages", [
        {"role": "system", "content": "t1"}, {"role": "user", "content": [{"type": "text", "text": "t2"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "content": "t3", "tool_call_id": "a"}, {"role": "user", "content": "t4"}])),
    (CHAT, {**GOOD_CHAT, "stop": "t5", "temperature": 0, "top_p": 1, "top_k": 10_000, "min_p": 0.0, "n": 1,
            "seed": 2**64 - 1, "logit_bias": {"3": -100, "127": 2.5}, "logprobs": True, "top_logprobs": -1,
            "stream": True, "stream_options": {}, "xtc_probability": 0, "xtc_threshold": 0.5,
            "max_completion_tokens": None, "chat_template_kwargs": {"x": 1}, "tools": [], "role_mapping": None}),
    (TEXT, {**GOOD_TEXT, "stop": ["t5", ""], "max_tokens": 10**9, "presence_penalty": -2, "draft_model": "default_model"}),
])
def test_check_request_accepts_valid_bodies(path, body):
    check_request(path, body, VOCAB)


def test_check_request_leaves_other_paths_and_unknown_fields_alone():
    check_request("/v1/embeddings", {"input": 5}, VOCAB)  # mlx-lm answers 404 for the path itself
    check_request(CHAT, {**GOOD_CHAT, "user": 5, "response_format": "x"}, VOCAB)  # fields mlx-lm never reads


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


# -- a generation thread that dies takes the process down -----------------------------------------------
class _Provider:
    """Just what mlx-lm's generation loop reads of a model provider before its first request."""

    def __init__(self, fail):
        self.fail, self.cli_args = fail, None

    def load_default(self):
        if self.fail:
            raise RuntimeError("the model could not be loaded")

    def reset(self):
        pass


@pytest.mark.parametrize("fail", [True, False])
def test_generation_thread_death_exits_the_process(fail, monkeypatch, caplog):
    from veloxquant_mlx.cli import serve_requests

    exits = []
    monkeypatch.setattr(serve_requests.os, "_exit", exits.append)
    with caplog.at_level(logging.CRITICAL, logger="veloxquant_mlx.serve"):
        generator = serve_requests.response_generator_class()(_Provider(fail), prompt_cache=None)
        if fail:
            generator.join()
        else:
            time.sleep(0.3)
            generator.stop_and_join()  # asked to stop (the server shuts down): no exit
    assert exits == ([serve_requests.GENERATION_DIED] if fail else [])
    assert ("generation thread died: exiting with status 70" in caplog.text) == fail


DIES_AT_FIRST_STEP = """
import sys
from mlx_lm.generate import BatchGenerator
from veloxquant_mlx.cli import main

def step(self, *args, **kwargs):
    raise RuntimeError("a batch step that fails")

BatchGenerator.next = step  # the generation thread's first step raises
sys.exit(main(["serve", "--model", sys.argv[1], "--method", "h2o", "--budget", "16", "--port", sys.argv[2]]))
"""


@pytest.mark.integration
def test_a_server_whose_generation_thread_dies_exits_non_zero(tmp_path):
    """mlx-lm's server would stay up with its generation thread dead, answering every request with an
    error and /health with 503, so no supervisor would restart it."""
    from test_serve import free_port, save_tiny_model

    save_tiny_model(tmp_path)
    port = free_port()
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DIES_AT_FIRST_STEP, str(tmp_path), str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, log.read_text()
            try:
                urllib.request.urlopen(url + "/health", timeout=2).close()
                break
            except OSError:
                time.sleep(0.3)
        req = urllib.request.Request(url + CHAT, data=json.dumps(GOOD_CHAT).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60).close()
        except (urllib.error.URLError, ConnectionError):
            pass  # the process may be gone before it answers
        assert proc.wait(60) == 70, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert "a batch step that fails" in text and "generation thread died: exiting with status 70" in text
