"""``python -m veloxquant_mlx serve`` as a real subprocess, driven by the official ``openai`` client.

A tiny random llama (saved in mlx-lm format with a word-level tokenizer and a chat template) is
served with H2O at a budget that evicts during decode. Checks: concurrent answers equal stand-alone
generations with the same config, streaming, malformed requests (a fuzz run of them) get an HTTP 4xx
naming what is wrong and the server keeps serving, a client that drops a stream mid-way leaves the
server serving, and a second turn continues the first turn's (evicted) cache.
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from veloxquant_mlx import EvictionCache, KVCacheBuilder, KVCacheConfig

from conftest import VOCAB, make_tiny_model, tiny_tokenizer

openai = pytest.importorskip("openai")

CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
CONFIG = dict(method="h2o", budget=16, h2o_evict_every=4)
FLAGS = ["--method", "h2o", "--budget", "16", "--h2o-evict-every", "4"]
MAX_TOKENS = 10
STEP = 8


def save_tiny_model(path):
    model = make_tiny_model("llama")
    config = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
                  max_position_embeddings=4096, tie_word_embeddings=False)
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    hf = tiny_tokenizer()._tokenizer
    saved = hf.chat_template
    hf.chat_template = CHAT_TEMPLATE
    try:
        hf.save_pretrained(str(path))
    finally:
        hf.chat_template = saved


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_arg, flags, log_path, timeout=120):
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "veloxquant_mlx", "serve", "--model", str(model_arg), *flags,
         "--port", str(port), "--prefill-step-size", str(STEP), "--max-tokens", str(MAX_TOKENS)],
        stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_CACHE": str(Path(log_path).parent / "no-hf-cache")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{open(log_path).read()}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not come up:\n{open(log_path).read()}")


def stop_server(proc):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import mlx_lm

    root = tmp_path_factory.mktemp("serve")
    model_dir = root / "tiny"
    model_dir.mkdir()
    save_tiny_model(model_dir)
    proc, url = start_server(model_dir, FLAGS, root / "server.log")
    model, tokenizer = mlx_lm.load(str(model_dir))  # the same weights, for stand-alone references
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        yield {"url": url, "client": client, "model": model, "tokenizer": tokenizer,
               "log": root / "server.log", "proc": proc, "model_dir": model_dir}
    finally:
        stop_server(proc)


def words(n, seed):
    return " ".join(f"t{i}" for i in np.random.default_rng(seed).integers(1, VOCAB, size=n))


def chat(client, messages, **kw):
    return client.chat.completions.create(model="default_model", messages=messages, temperature=0.0,
                                          max_tokens=MAX_TOKENS, **kw)


def standalone(served, prompt_tokens, caches=None, max_tokens=MAX_TOKENS):
    """Greedy text and caches of one stand-alone generation with the served config."""
    from mlx_lm.generate import stream_generate

    model, tok = served["model"], served["tokenizer"]
    if caches is None:
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIG))
    text = "".join(r.text for r in stream_generate(model, tok, mx.array(prompt_tokens), max_tokens=max_tokens,
                                                   prompt_cache=caches, prefill_step_size=STEP))
    return text, caches


def template(served, messages):
    return served["tokenizer"].apply_chat_template(messages, add_generation_prompt=True)


@pytest.mark.integration
def test_concurrent_answers_equal_standalone_generations(served):
    conversations = [[{"role": "user", "content": words(n, seed)}] for n, seed in ((40, 1), (12, 2), (27, 3))]
    with ThreadPoolExecutor(len(conversations)) as pool:
        replies = list(pool.map(lambda m: chat(served["client"], m), conversations))
    for messages, reply in zip(conversations, replies):
        prompt = template(served, messages)
        text, caches = standalone(served, prompt)
        assert reply.choices[0].message.content == text
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.usage.completion_tokens == MAX_TOKENS
    assert caches[0].evictions > 0  # the budget really evicted (40 + 10 tokens > 16 + 4)
    log = served["log"].read_text()
    assert "continuous batching on" in log
    assert "KV cache: allocated" in log  # each finished request logs its allocated KV bytes


@pytest.mark.integration
def test_streaming(served):
    messages = [{"role": "user", "content": words(21, 4)}]
    chunks = list(chat(served["client"], messages, stream=True))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(deltas) == standalone(served, template(served, messages))[0]


@pytest.mark.integration
def test_malformed_requests_get_http_errors_and_the_server_keeps_serving(served):
    with pytest.raises(openai.BadRequestError):
        chat(served["client"], [{"role": "user", "content": "t1 t2"}], top_p=3.0)
    req = urllib.request.Request(served["url"] + "/v1/chat/completions", data=b"{not json",
                                 headers={"Content-Type": "application/json"}, method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    messages = [{"role": "user", "content": words(9, 5)}]
    assert chat(served["client"], messages).choices[0].message.content == \
        standalone(served, template(served, messages))[0]


@pytest.mark.integration
def test_client_disconnecting_mid_stream_leaves_the_server_serving(served):
    stream = served["client"].chat.completions.create(
        model="default_model", messages=[{"role": "user", "content": words(15, 6)}], temperature=0.0,
        max_tokens=4000, stream=True)
    first = next(iter(stream))
    assert first.choices
    stream.close()  # drop the connection while the server is still generating
    messages = [{"role": "user", "content": words(11, 7)}]
    assert chat(served["client"], messages).choices[0].message.content == \
        standalone(served, template(served, messages))[0]
    assert served["proc"].poll() is None
    with urllib.request.urlopen(served["url"] + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore:.*earlier generation")  # the stand-alone second turn, on purpose
def test_second_turn_continues_the_first_turns_cache(served):
    first = [{"role": "user", "content": words(30, 8)}]
    answer = chat(served["client"], first).choices[0].message.content
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": words(6, 9)}]
    reply = chat(served["client"], second)
    p1, p2 = template(served, first), template(served, second)
    # The server kept turn 1's cache (prompt + every generated token) and fed only the rest.
    assert reply.usage.prompt_tokens_details.cached_tokens == len(p1) + MAX_TOKENS
    # Stand-alone "true eviction" conversation: turn 2 continues turn 1's evicted cache.
    text1, caches = standalone(served, p1)
    assert text1 == answer and caches[0].offset == len(p1) + MAX_TOKENS
    assert caches[0].evictions > 0
    assert reply.choices[0].message.content == standalone(served, p2[caches[0].offset:], caches)[0]
    assert "prompt cache: reusing" in served["log"].read_text()


CONTEXT = 4096  # the tiny model's max_position_embeddings


def post(served, path, body, timeout=60):
    """(status, JSON body) of a POST to the server."""
    req = urllib.request.Request(served["url"] + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for_log(served, text, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if text in served["log"].read_text():
            return served["log"].read_text()
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in the server log:\n{served['log'].read_text()[-3000:]}")


def cpu_seconds(pid):
    """User + system CPU seconds of a process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def post_raw(served, path, data, headers=None, timeout=60):
    """(status, the "error" text or the body) of a POST of raw bytes; None for no answer."""
    import http.client

    conn = http.client.HTTPConnection(served["url"].split("//")[1], timeout=timeout)
    try:
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        text = r.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return None, repr(e)
    finally:
        conn.close()
    try:
        return r.status, json.loads(text)["error"]
    except (ValueError, KeyError, TypeError):
        return r.status, text


def assert_serving(served):
    """The server is up, healthy, and answers a good request as a stand-alone generation does."""
    assert served["proc"].poll() is None
    with urllib.request.urlopen(served["url"] + "/health", timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    messages = [{"role": "user", "content": words(9, 15)}]
    assert chat(served["client"], messages).choices[0].message.content == \
        standalone(served, template(served, messages))[0]


@pytest.mark.integration
def test_issue_examples_get_400_about_the_request_and_the_server_keeps_serving(served):
    """Each of these killed mlx-lm's generation thread (an empty prompt, stop 5: every later request got
    404 "generation thread died", /health 503) or answered 404 / 400 with the server's own Python errors."""
    cases = [("/v1/completions", {"prompt": ""}, "prompt is empty"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t1"}], "stop": 5},
              "stop must be a string or an array of strings, got integer 5"),
             ("/v1/chat/completions", {"messages": []}, "messages is empty"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": 123}]},
              "messages[0].content must be a string or an array of text parts, got integer 123"),
             ("/v1/completions", {"prompt": 12345}, "prompt must be a non-empty string"),
             ("/v1/chat/completions", {"messages": "hi"}, "messages must be an array of message objects")]
    for path, body, text in cases:
        status, error = post_raw(served, path, json.dumps(body).encode())
        assert (status, text in error) == (400, True), (body, status, error)
    assert_serving(served)


@pytest.mark.integration
def test_edge_values_that_are_valid_are_served(served):
    """Well-formed values at the edges are answered, not refused: top_k past the vocabulary (mlx-lm's
    sampler raised in the generation thread; it keeps every token, as top_k 0 does), text parts,
    stream_options without include_usage (mlx-lm read it without a default), an integer xtc_probability."""
    base = {"model": "default_model", "messages": [{"role": "user", "content": words(5, 16)}], "max_tokens": 3}
    for extra in ({"temperature": 1.0, "top_k": 10 * VOCAB, "seed": 3},
                  {"temperature": 1.0, "top_k": 10 * VOCAB},
                  {"messages": [{"role": "user", "content": [{"type": "text", "text": words(5, 17)}]}]},
                  {"stream": True, "stream_options": {}},
                  {"xtc_probability": 0}):
        status, text = post_raw(served, "/v1/chat/completions", json.dumps({**base, **extra}).encode())
        assert status == 200, (extra, text)
        assert ("data: [DONE]" if extra.get("stream") else '"object": "chat.completion"') in text, text
    assert_serving(served)


@pytest.mark.integration
def test_fuzz_malformed_requests_get_4xx_about_the_request_then_a_good_one_succeeds(served):
    """A bounded fuzz run: every malformed body of the table (a bad value in each field mlx-lm reads, on
    both endpoints; raw bodies its parser chokes on; bad Content-Length), then pairs of bad fields drawn
    at random, each answered 4xx with a one-line message that names what is wrong with the request;
    then the server still answers a good request."""
    from test_serve_checks import BAD_FIELDS, CHAT, EMPTY_ONCE_TOKENIZED, GOOD_CHAT, INTERNAL, MALFORMED, RAW

    rng = np.random.default_rng(56)
    pairs = [(CHAT, {**GOOD_CHAT, f: v, g: w}, (f, g))
             for (f, v), (g, w) in ((BAD_FIELDS[i], BAD_FIELDS[j]) for i, j in rng.choice(len(BAD_FIELDS), (16, 2)))
             if f != g]
    cases = ([(p, json.dumps(b).encode(), {}, (w,)) for p, b, w in MALFORMED + EMPTY_ONCE_TOKENIZED]
             + [(p, data, {}, (w,)) for p, data, w in RAW]
             + [("/v1/chat/completions", b"{}", {"Content-Length": "-5"}, ("Content-Length",)),
                ("/v1/chat/completions", b"{}", {"Content-Length": str(10**12)}, ("Content-Length",))]
             + [(p, json.dumps(b).encode(), {}, w) for p, b, w in pairs])
    assert 100 <= len(cases) <= 120
    for path, data, headers, names in cases:
        status, error = post_raw(served, path, data, headers)
        assert status is not None and 400 <= status < 500, (path, data[:200], status, error)
        assert any(n in error for n in names), (data[:200], error)
        assert len(error.splitlines()) == 1 and not any(x in error for x in INTERNAL), error
    assert_serving(served)
    assert "generation thread died" not in served["log"].read_text()


@pytest.mark.integration
def test_prompt_past_the_context_gets_400_naming_it_and_the_server_keeps_serving(served):
    messages = [{"role": "user", "content": words(CONTEXT + 20, 10)}]
    status, body = post(served, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
    assert status == 400, body
    assert f"context is {CONTEXT:,} tokens" in body["error"] and f"{len(template(served, messages)):,}" in body["error"]
    ok = [{"role": "user", "content": words(9, 11)}]
    assert chat(served["client"], ok).choices[0].message.content == standalone(served, template(served, ok))[0]


@pytest.mark.integration
def test_max_tokens_is_capped_at_what_the_context_leaves(served):
    messages = [{"role": "user", "content": words(CONTEXT - 30, 12)}]
    room = CONTEXT - len(template(served, messages))
    assert 0 < room < 40
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=90)
    reply = client.completions.create(model="default_model", prompt=words(CONTEXT - 30, 12),
                                      max_tokens=99_999_999, temperature=0.0)
    assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= CONTEXT
    assert reply.choices[0].finish_reason == "length"
    assert "max_tokens 99999999 capped at" in served["log"].read_text()


@pytest.mark.integration
def test_a_client_that_leaves_stops_its_generation(served):
    """A non-streaming request whose client times out: the server stops generating for it at once
    (mlx_lm.server alone would run it to max_tokens, as nothing is written until the end)."""
    client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=0.5)
    with pytest.raises(openai.APITimeoutError):
        client.chat.completions.create(model="default_model", messages=[{"role": "user", "content": words(12, 13)}],
                                       max_tokens=3000, temperature=0.0)
    log = wait_for_log(served, "client disconnected: generation stopped after")
    line = next(x for x in log.splitlines() if "client disconnected: generation stopped after" in x)
    assert int(line.split("after ")[1].split(" of")[0]) < 3000
    time.sleep(0.5)
    before = cpu_seconds(served["proc"].pid)
    time.sleep(2.0)
    assert cpu_seconds(served["proc"].pid) - before < 0.5  # idle: nothing kept generating
    messages = [{"role": "user", "content": words(7, 14)}]
    assert chat(served["client"], messages).choices[0].message.content == \
        standalone(served, template(served, messages))[0]


@pytest.mark.integration
def test_models_lists_the_served_model(served):
    """GET /v1/models on a machine without a Hugging Face cache (the fixture points HF_HUB_CACHE at a
    missing folder): mlx_lm.server's scan raised CacheNotFound and sent an empty 200."""
    with urllib.request.urlopen(served["url"] + "/v1/models", timeout=10) as r:
        body = json.loads(r.read())
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [str(served["model_dir"])]
    assert [m.id for m in served["client"].models.list()] == [str(served["model_dir"])]
    assert "Traceback" not in served["log"].read_text()


def rss_bytes(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow  # ~15 s alone on 2 cores
@pytest.mark.integration
def test_mixed_load_with_clients_leaving_early_stops_their_generations_and_rss_stays_bounded(served):
    """16 clients at once on loopback: 8 ask for 10 tokens after prompts of 20-1,500 tokens and wait; 8
    ask for 3,000 tokens and leave: after a 0.3-0.9 s timeout, or after two chunks of a stream. Every waiting client is answered, every leaving
    client's generation stops (one log line each, and the server idles at once), and the RSS after
    the load is within 25 % of the RSS after a warm-up round."""
    rng = np.random.default_rng(20)
    stayers = [[{"role": "user", "content": words(int(n), 100 + i)}]
               for i, n in enumerate(rng.integers(20, 1500, size=8))]
    leavers = [([{"role": "user", "content": words(int(n), 200 + i)}], float(t))
               for i, (n, t) in enumerate(zip(rng.integers(10, 300, size=8), rng.uniform(0.3, 1.5, size=8)))]

    def stay(messages):
        return chat(served["client"], messages).choices[0].message.content

    def leave(job):
        messages, after = job
        client = openai.OpenAI(base_url=served["url"] + "/v1", api_key="unused", max_retries=0, timeout=after)
        streaming = after > 0.9  # these read two chunks, then close the stream
        try:
            reply = client.chat.completions.create(model="default_model", messages=messages, max_tokens=3000,
                                                   temperature=0.0, stream=streaming)
        except openai.APITimeoutError:
            return "left"
        if not streaming:
            return "answered"
        chunks = iter(reply)
        next(chunks), next(chunks)
        reply.close()
        return "left"

    with ThreadPoolExecutor(16) as pool:  # warm-up: the same load once, so the RSS baseline holds its buffers
        list(pool.map(stay, stayers))
    time.sleep(1.0)
    baseline = rss_bytes(served["proc"].pid)
    gone_before = served["log"].read_text().count("client disconnected: generation stopped")
    done_before = served["log"].read_text().count("request done:")
    t0 = time.time()
    with ThreadPoolExecutor(16) as pool:
        left = pool.map(leave, leavers)
        answers = list(pool.map(stay, stayers))
        left = list(left)
    assert time.time() - t0 < 240
    assert all(answers) and left == ["left"] * 8, left
    time.sleep(1.0)
    before = cpu_seconds(served["proc"].pid)
    time.sleep(2.0)
    assert cpu_seconds(served["proc"].pid) - before < 0.5  # nothing keeps generating for a gone client
    log = served["log"].read_text()
    # A client that left before the listen backlog took its connection never reached the server, so
    # not every leaver logs; none ran to its end (only the 8 waiting clients' requests finished).
    assert log.count("client disconnected: generation stopped") - gone_before >= 4, log[-4000:]
    assert log.count("request done:") - done_before == 8, log[-4000:]
    assert rss_bytes(served["proc"].pid) <= 1.25 * baseline, (rss_bytes(served["proc"].pid), baseline)
    messages = [{"role": "user", "content": words(8, 300)}]
    assert chat(served["client"], messages).choices[0].message.content == \
        standalone(served, template(served, messages))[0]


@pytest.mark.parametrize("port", ["70000", "99999", "0", "-1", "http"])
def test_port_out_of_range_is_a_one_line_error(port, capsys):
    from veloxquant_mlx.cli import main

    assert main(["serve", "--port", port]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--port" in err and "1-65535" in err


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.integration
def test_bundled_model_serves_with_nexus(tmp_path):
    from veloxquant_mlx.models import load_model

    proc, url = start_server("bundled", ["--method", "nexus", "--budget", "128"], tmp_path / "server.log",
                             timeout=300)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": "Name three colours of the rainbow. " * 20}]
        reply = chat(client, messages)
        model, tok = load_model()
        served = {"model": model, "tokenizer": tok}
        from mlx_lm.generate import stream_generate

        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="nexus", budget=128))
        text = "".join(r.text for r in stream_generate(model, tok, mx.array(template(served, messages)),
                                                       max_tokens=MAX_TOKENS, prompt_cache=caches,
                                                       prefill_step_size=STEP))
        assert reply.choices[0].message.content == text
    finally:
        stop_server(proc)


# -- in-process pieces (no HTTP) -------------------------------------------------------------------
def test_prompt_cache_reuses_prefixes_and_recomputes_exact_hits():
    from veloxquant_mlx.cli.serve_memory import prompt_cache_class

    model = make_tiny_model("llama")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIG))
    tokens = list(range(1, 30))
    model(mx.array(tokens)[None], cache=caches)
    model(mx.array([[7]]), cache=caches)  # a decode step: the cache now warns on a new prompt
    store = prompt_cache_class()(4)
    store.insert_cache("m", tokens + [7], caches)
    got, rest = store.fetch_nearest_cache("m", tokens + [7, 9, 9])
    assert rest == [9, 9] and got is not caches and got[0].offset == 30
    assert not got[0].prompt.saw_decode  # continuing a stored conversation is on purpose
    # an exact hit would leave nothing to feed and eviction caches cannot rewind: computed afresh
    assert store.fetch_nearest_cache("m", tokens + [7]) == (None, tokens + [7])
    # a longer stored conversation is never rewound (not trimmable)
    assert store.fetch_nearest_cache("m", tokens[:10]) == (None, tokens[:10])


@pytest.mark.parametrize("config", [KVCacheConfig(**CONFIG), None])
def test_model_provider_serves_our_caches_batched(config):
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from veloxquant_mlx.caches.batch import BatchEvictionCache
    from veloxquant_mlx.cli.serve import _model_provider_class, server_args

    model = make_tiny_model("llama")
    provider = _model_provider_class()(server_args(model="tiny"), model, tiny_tokenizer(), config)
    try:
        assert provider.load("any-name-a-client-sends") == (model, tiny_tokenizer())
        assert provider.is_batchable
        caches = make_prompt_cache(model)
        want = KVCache if config is None else EvictionCache
        assert isinstance(caches[0], want)
        if config is not None:
            assert isinstance(caches[0].merge(caches[:1]), BatchEvictionCache)
        with pytest.raises(ValueError, match="draft"):
            provider.load("default_model", None, "some/draft-model")
    finally:
        KVCacheBuilder.uninstall(model)


def test_model_provider_serves_quantized_rows_batched():
    """--kv-bits on serve: our caches store 4-bit rows and still batch (mlx-lm's server alone would
    serve kv_bits requests one at a time); the merged batch takes mlx-lm's quantized attention."""
    from mlx_lm.models.cache import make_prompt_cache

    from veloxquant_mlx.cli.serve import _model_provider_class, server_args
    from test_quantized import make_model

    model = make_model("llama")
    config = KVCacheConfig(method="nexus", budget=48, kv_bits=4, nexus_block_size=4, nexus_window=8)
    provider = _model_provider_class()(server_args(model="tiny"), model, tiny_tokenizer(), config)
    try:
        provider.load("default_model")
        assert provider.is_batchable
        caches = make_prompt_cache(model)
        assert caches[0].bits == 4 and caches[0].merge(caches[:1]).bits == 4
    finally:
        KVCacheBuilder.uninstall(model)


def test_serve_kv_bits_flags(monkeypatch):
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli import serve as serve_mod

    seen = {}
    monkeypatch.setattr(serve_mod, "serve", lambda model, tok, config, model_name, **o: seen.update(config=config, **o))
    monkeypatch.setattr(serve_mod, "load_model_for_cli", lambda spec: (None, None))
    monkeypatch.setattr(serve_mod.distributed, "setup_cli", lambda model: None)
    args = build_parser().parse_args(["serve", "--method", "h2o", "--budget", "64", "--kv-bits", "4",
                                      "--kv-group-size", "32"])
    assert serve_mod.cmd_serve(args) == 0
    assert (seen["config"].kv_bits, seen["config"].kv_group_size) == (4, 32)
    assert "kv_bits" not in seen  # not handed to mlx-lm's server: requests stay batchable
    args = build_parser().parse_args(["serve", "--method", "full", "--kv-bits", "8"])
    assert serve_mod.cmd_serve(args) == 0
    assert seen["config"] is None and seen["kv_bits"] == 8  # full cache: mlx-lm's own QuantizedKVCache


def test_serve_takes_a_method_spec(monkeypatch):
    from veloxquant_mlx.cli import build_parser
    from veloxquant_mlx.cli import serve as serve_mod
    from veloxquant_mlx.cli.args import CLIError

    seen = []
    monkeypatch.setattr(serve_mod, "serve",
                        lambda model, tok, config, model_name, **o: seen.append(dict(config=config, **o)))
    monkeypatch.setattr(serve_mod, "load_model_for_cli", lambda spec: (None, None))
    monkeypatch.setattr(serve_mod.distributed, "setup_cli", lambda model: None)
    args = build_parser().parse_args(["serve", "--method", "h2o:budget=64,kv_bits=4,allocation=ada", "--port", str(free_port())])
    assert serve_mod.cmd_serve(args) == 0
    # the command line's quantization groups are mlx-lm's 64 (KVCacheConfig's own default for 4 bits is 32)
    assert seen[-1]["config"] == KVCacheConfig.parse("h2o:budget=64,kv_bits=4,kv_group_size=64,allocation=ada")
    assert "kv_bits" not in seen[-1]  # our caches quantize their rows: requests stay batchable
    args = build_parser().parse_args(["serve", "--method", "full:kv_bits=8", "--port", str(free_port())])
    assert serve_mod.cmd_serve(args) == 0
    assert seen[-1]["config"] is None and (seen[-1]["kv_bits"], seen[-1]["kv_group_size"]) == (8, 64)
    args = build_parser().parse_args(["serve", "--method", "h2o:bugdet=64", "--port", str(free_port())])
    with pytest.raises(CLIError, match="unknown key 'bugdet'; valid keys for h2o"):
        serve_mod.cmd_serve(args)


def test_serve_help_prints(capsys):
    from veloxquant_mlx.cli import main

    assert main(["serve", "--help"]) == 0  # main returns argparse's exit code instead of raising it
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--max-kv-bytes" in out and "10% of the model's weights" in out and "default 256" in out


def test_serve_flags():
    from veloxquant_mlx.cli import build_parser, main
    from veloxquant_mlx.cli.serve import _size, server_args

    args = build_parser().parse_args(["serve", "--method", "h2o", "--budget", "64", "--h2o-evict-every", "8",
                                      "--port", "9999", "--decode-concurrency", "4",
                                      "--prompt-cache-bytes", "2G", "--prompt-eviction", "stream"])
    assert (args.port, args.decode_concurrency, args.prompt_cache_bytes) == (9999, 4, 2 * 10**9)
    assert _size("512M") == 512 * 10**6 and _size("10") == 10
    args = build_parser().parse_args(["serve", "--max-kv-bytes", "300M", "--mlx-cache-limit", "1G"])
    assert (args.max_kv_bytes, args.mlx_cache_limit, args.prefill_step_size) == (300 * 10**6, 10**9, 256)
    assert server_args(port=1).kv_bits is None  # mlx-lm reads it: requests stay batchable
    with pytest.raises(TypeError, match="unknown server options"):
        server_args(kv_bitz=4)
    assert main(["serve", "--density", "0.2"]) == 2  # a server does not know prompt lengths
    assert main(["serve", "--method", "h2o", "--nexus-window", "4"]) == 2  # option of another method


# -- fail fast, honest bytes, bounded memory --------------------------------------------------------
@pytest.mark.integration
def test_taken_port_is_one_line_error_before_loading():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "serve", "--method", "nexus", "--budget",
                            "410", "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: Address already in use "
        "(another process is using it; pick another --port)"]
    assert "Traceback" not in r.stdout + r.stderr
    assert time.time() - t0 < 60  # checked before the model loads; nothing left running


def test_port_taken_after_the_check_stops_the_generation_thread(monkeypatch):
    import errno

    from mlx_lm import server

    from veloxquant_mlx.cli.args import CLIError
    from veloxquant_mlx.cli.serve import serve

    started = []

    class Generator:
        def __init__(self, provider, prompt_cache):
            started.append(self)
            self.stopped = False

        def stop_and_join(self):
            self.stopped = True

    def bind_fails(host, port, generator, handler_class):
        raise OSError(errno.EADDRINUSE, "Address already in use")

    monkeypatch.setattr(server, "ResponseGenerator", Generator)
    monkeypatch.setattr(server, "_run_http_server", bind_fails)
    monkeypatch.setattr(server, "BatchGenerator", server.BatchGenerator)  # serve() swaps it: restore after
    model = make_tiny_model("llama")
    with pytest.raises(CLIError, match="cannot listen on 127.0.0.1:1: Address already in use"):
        serve(model, tiny_tokenizer(), None, port=1)
    assert started and started[0].stopped  # else the non-daemon thread would keep the process alive


def test_request_log_line_has_generates_words_and_baseline():
    """serve's per-request KV line is generate's, like against like: the allocated bytes against what
    mlx-lm's KVCache allocates for the tokens seen, the kept rows against every token's K/V (kv_report)."""
    from veloxquant_mlx.caches.accounting import kv_report
    from veloxquant_mlx.cli.args import kv_summary
    from veloxquant_mlx.cli.serve_memory import request_log_line

    model = make_tiny_model("llama")
    for n in (3, 300):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="nexus", budget=128))
        model(mx.array(np.arange(1, n + 1) % VOCAB)[None], cache=caches)
        kv = kv_report(caches)
        line = request_log_line(n, caches)
        assert line == f"request done: {n} tokens in its cache; {kv_summary(kv)}"
        ratio = float(line.split("= ")[1].split("x")[0])
        assert ratio == pytest.approx(sum(c.nbytes for c in caches) / kv["kvcache_bytes"], abs=0.01)
        assert "of the full cache's" in line and "mlx-lm's KVCache" in line


def test_prompt_cache_bounds_bytes_at_our_caches_nbytes():
    from veloxquant_mlx.cli.serve_memory import prompt_cache_class

    model = make_tiny_model("llama")
    stored = []
    for seed in range(3):
        caches = KVCacheBuilder.for_model(model, KVCacheConfig(**CONFIG))
        model(mx.array(np.random.default_rng(seed).integers(1, VOCAB, 40))[None], cache=caches)
        stored.append(caches)
    one = sum(c.nbytes for c in stored[0])
    assert one > 0
    store = prompt_cache_class()(10, int(2.5 * one))
    for i, caches in enumerate(stored):
        store.insert_cache("m", [i + 1] * 40, caches)
    assert len(store) == 2 and store.nbytes == 2 * one  # the oldest went: the bound holds
    assert stored[0] == [] and len(stored[1]) == 2  # an evicted entry's caches are let go at once
    assert store.fetch_nearest_cache("m", [1] * 40 + [5])[0] is None


def _batch_run(model, prompts, max_kv_bytes, config):
    from mlx_lm.generate import BatchGenerator

    from veloxquant_mlx.cli.serve_memory import batch_generator_class, prompt_cache_class, peak_bytes, row_bytes

    token_bytes = row_bytes(model)
    store = prompt_cache_class()(4)
    if max_kv_bytes is None:
        gen = BatchGenerator(model, prefill_step_size=STEP)
    else:
        cls = batch_generator_class(max_kv_bytes, lambda held, new: peak_bytes(config, token_bytes, held, new),
                                     store)
        gen = cls(model, prefill_step_size=STEP)
    uids = gen.insert(prompts, max_tokens=[6] * len(prompts))
    out = {u: [] for u in uids}
    most = 0
    while not all(len(v) == 6 for v in out.values()):
        _, responses = gen.next()
        most = max(most, len(gen._prompt_batch) + len(gen._generation_batch))
        for r in responses:
            out[r.uid].append(r.token)
    assert max_kv_bytes is None or store.idle()
    return [out[u] for u in uids], most


@pytest.mark.parametrize("config", [None, KVCacheConfig(**CONFIG)])
def test_max_kv_bytes_bounds_the_running_rows(config):
    from veloxquant_mlx.cli.serve_memory import row_bytes

    model = make_tiny_model("llama")
    if config is not None:
        KVCacheBuilder.install(model, config)
    try:
        prompts = [np.random.default_rng(s).integers(1, VOCAB, n).tolist() for s, n in ((1, 30), (2, 12), (3, 21))]
        free, most_free = _batch_run(model, prompts, None, config)
        assert most_free == 3
        one_at_a_time, most = _batch_run(model, prompts, 0, config)
        assert most == 1 and one_at_a_time == free  # each admitted alone, same greedy tokens
        two, most = _batch_run(model, prompts, (30 + 12 + 12) * row_bytes(model), config)
        assert most == 2 and two == free
    finally:
        if config is not None:
            KVCacheBuilder.uninstall(model)


def test_release_memory_empties_mlx_cache():
    from veloxquant_mlx.cli.serve_memory import release_memory

    a = mx.ones((1024, 1024))
    mx.eval(a)
    del a
    assert mx.get_cache_memory() > 0
    release_memory()
    assert mx.get_cache_memory() == 0


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.integration
def test_bundled_model_under_concurrent_mixed_load_answers_all_and_hands_memory_back(tmp_path):
    """16 clients at once on loopback, prompts of 45-1,500 tokens, 16 new tokens each: every request is
    answered, and the server's RSS a few seconds after the load is within 25 % of its idle figure."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark_scripts"))
    import bench_serving as bench

    args = bench.load_parse_args(["--timeout", "900", "--settle", "3"])
    srv = bench.Server("nexus", "--method nexus --budget 410", args, tmp_path)
    try:
        srv.wait_up(args.start_timeout)
        fit = bench.calibrate(srv, args.timeout)
        time.sleep(args.settle)
        idle = srv.rss()
        row = bench.run_level(srv, bench.requests_for(16, args, fit, level_seed=1), args)
    finally:
        srv.stop()
    assert row["errors"] == [] and row["answered"] == 16, row
    assert sum(row["answer_tokens"]) >= 8 * 16  # most answers run the full 16 tokens (some end early)
    assert min(row["prompt_tokens"]) <= 60 and max(row["prompt_tokens"]) >= 1400  # mixed lengths
    assert row["rss_after"] <= 1.25 * idle, (row["rss_after"], idle)


def test_serve_wires_the_memory_bounds(monkeypatch):
    from mlx_lm import server

    from veloxquant_mlx.cli import serve_memory
    from veloxquant_mlx.cli.serve import PROMPT_CACHE_SHARE, serve

    seen = {}

    class Generator:
        def __init__(self, provider, prompt_cache):
            seen.update(args=provider.cli_args, store=prompt_cache, batch=server.BatchGenerator)

    limits = []
    monkeypatch.setattr(server, "ResponseGenerator", Generator)
    monkeypatch.setattr(server, "_run_http_server", lambda host, port, generator, handler_class: None)
    monkeypatch.setattr(server, "BatchGenerator", server.BatchGenerator)
    monkeypatch.setattr(mx, "set_cache_limit", limits.append)
    model = make_tiny_model("llama")
    serve(model, tiny_tokenizer(), None, max_kv_bytes=10**6, mlx_cache_limit=123)
    assert seen["store"].max_bytes == int(PROMPT_CACHE_SHARE * serve_memory.weight_bytes(model))
    assert seen["args"].prompt_cache_bytes is None  # mlx-lm must not trim the store to bound minus batch
    assert seen["batch"].__name__ == "BoundedBatchGenerator" and limits == [123]
    serve(model, tiny_tokenizer(), None, prompt_cache_bytes=5000)
    assert seen["store"].max_bytes == 5000


@pytest.mark.integration
def test_offload_serves_one_request_at_a_time_and_its_page_files_follow_the_prompt_cache(served, tmp_path):
    """prompt_eviction="offload": each request's caches page its prompt to files of their own; the server's
    prompt cache keeps at most --prompt-cache-size conversations (and their files) for reuse; a stopped
    server leaves no file behind."""
    pages = tmp_path / "pages"
    pages.mkdir()
    flags = [*FLAGS, "--prompt-eviction", "offload", "--page-dir", str(pages), "--prompt-cache-size", "1"]
    proc, url = start_server(served["model_dir"], flags, tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        n_layers = 2
        for seed in (21, 22, 23):
            messages = [{"role": "user", "content": words(40, seed)}]
            got = chat(client, messages).choices[0].message.content
            caches = KVCacheBuilder.for_model(served["model"], KVCacheConfig(**CONFIG, prompt_eviction="offload",
                                                                             page_dir=str(tmp_path)))
            assert got == standalone(served, template(served, messages), caches)[0]
            assert len(list(pages.glob("veloxquant-pages-*"))) <= 2 * n_layers  # the cached one, a copy at most
        assert "sequential requests" in (tmp_path / "server.log").read_text()
    finally:
        stop_server(proc)
    assert list(pages.glob("veloxquant-pages-*")) == []
