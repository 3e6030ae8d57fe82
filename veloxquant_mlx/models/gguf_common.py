"""GGUF machinery shared by the architecture converters (gguf_llama, gguf_gemma3, gguf_qwen2).

Converting tensors (read by gguf_read) to mlx-lm names and dtypes, the config fields and
tensor names every architecture shares, writing an mlx-lm model folder (its tokenizer:
gguf_tokenizer), and the conversion cache: a folder per (source, dtype) written atomically
and validated by a fingerprint marker.  The chunk packages a GGUF ships in are in gguf_packages.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import mlx.core as mx

from .gguf_meta import _meta
from .gguf_packages import ModelNotAvailableError, _locate_in_package, assemble_chunks  # noqa: F401 (re-exported)
from .gguf_read import _dequantize, read_gguf, tensor_shape  # noqa: F401 (read_gguf re-exported)
from .gguf_tokenizer import _write_tokenizer

logger = logging.getLogger(__name__)

# Bump when the conversion output changes so stale cache folders are rebuilt.
CONVERTER_VERSION = 2
_MARKER_FILE = "veloxquant_conversion.json"
_CACHE_ENV = "VELOXQUANT_CACHE_DIR"

_DTYPES = {
    "float32": mx.float32,
    "fp32": mx.float32,
    "float16": mx.float16,
    "fp16": mx.float16,
    "half": mx.float16,
    "bfloat16": mx.bfloat16,
    "bf16": mx.bfloat16,
}


def hf_tensor_name(gguf_name: str, global_names: Dict[str, str], block_names: Dict[str, str],
                   suffixes: Tuple[str, ...] = ("weight", "bias")) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.attn_q.weight``) to its mlx-lm/HF name through an
    architecture's name tables; None for a tensor with no counterpart."""
    base, _, suffix = gguf_name.rpartition(".")
    if suffix not in suffixes:
        return None
    if base in global_names:
        return f"{global_names[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block_names:
        return f"model.layers.{parts[1]}.{block_names[parts[2]]}.{suffix}"
    return None


def convert_tensors(tensors: Mapping[str, mx.array], hf_name: Callable[[str], Optional[str]],
                    fix: Callable[[str, mx.array], mx.array], dtype: mx.Dtype) -> Dict[str, mx.array]:
    """Every GGUF tensor that ``hf_name`` maps, dequantized to float32, passed through
    ``fix(gguf_name, value)`` (the architecture's llama.cpp storage conventions), cast to ``dtype``
    and evaluated one at a time (the float32 copies never all exist at once)."""
    out: Dict[str, mx.array] = {}
    skipped: List[str] = []
    for name in sorted(tensors):
        if name.endswith((".scales", ".biases")):
            continue  # consumed together with their ".weight"
        hf = hf_name(name)
        if hf is None:
            skipped.append(name)
            continue
        if name.endswith(".weight"):
            value = _dequantize(tensors, name[: -len(".weight")])
        else:
            value = tensors[name].astype(mx.float32)
        value = fix(name, value).astype(dtype)
        mx.eval(value)
        out[hf] = value
    if skipped:
        logger.info("ignored GGUF tensors without an mlx-lm counterpart: %s", skipped)
    return out


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


# ----------------------------------------------------------------------------
# What every architecture shares: tensor names and config fields
# ----------------------------------------------------------------------------

# The llama-style block tensors (llama, qwen2); an architecture adds its own to these.
BLOCK_NAMES = {
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
GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def base_config(meta: Dict[str, Any], tensors: Mapping[str, mx.array], arch: str, dtype_name: str, *,
                eps: float, rope_theta: float, context: int) -> Dict[str, Any]:
    """The config fields every architecture reads the same way from ``<arch>.*`` metadata;
    ``eps``/``rope_theta``/``context`` are the architecture's defaults for absent keys."""
    p = f"{arch}."
    hidden = int(_meta(meta, p + "embedding_length"))
    n_heads = int(_meta(meta, p + "attention.head_count"))
    emb = tensor_shape(tensors, "token_embd.weight")
    tokens = _meta(meta, "tokenizer.ggml.tokens") or []
    return {
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, p + "feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_meta(meta, p + "attention.head_count_kv", n_heads)),
        "head_dim": int(_meta(meta, p + "attention.key_length", hidden // n_heads)),
        "rms_norm_eps": float(_meta(meta, p + "attention.layer_norm_rms_epsilon", eps)),
        "rope_theta": float(_meta(meta, p + "rope.freq_base", rope_theta)),
        # the model's own context limit; tokenizer_config's model_max_length repeats it
        "max_position_embeddings": int(_meta(meta, p + "context_length", context)),
        # the embedding matrix is authoritative (padded vocabularies)
        "vocab_size": int(emb[0]) if emb else int(_meta(meta, p + "vocab_size") or len(tokens)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype_name,
    }


def linear_rope_scaling(meta: Dict[str, Any], arch: str, key: str = "type") -> Optional[dict]:
    """``{key: "linear", "factor": f}`` when the GGUF scales RoPE linearly, else None; any other
    scaling type is not converted, and said so."""
    kind = _meta(meta, f"{arch}.rope.scaling.type")
    factor = _meta(meta, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor and float(factor) != 1.0:
        return {key: "linear", "factor": float(factor)}
    if kind not in (None, "none", "linear"):
        warnings.warn(f"GGUF rope scaling type {kind!r} is not converted; ignoring it")
    return None


def add_eos(config: Dict[str, Any], meta: Dict[str, Any], token: str) -> None:
    """Make ``token`` (an end-of-turn or end-of-text token) a further EOS when the vocabulary has it."""
    tokens = _meta(meta, "tokenizer.ggml.tokens") or []
    if token not in tokens or "eos_token_id" not in config:
        return
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    extra = tokens.index(token)
    if extra not in eos:
        config["eos_token_id"] = eos + [extra]


def _special_token_ids(meta: Dict[str, Any], config: dict) -> None:
    """Set ``bos_token_id``/``eos_token_id`` in ``config``; an end-of-turn token becomes a second EOS."""
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = _meta(meta, f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[key] = int(value)
    eot = _meta(meta, "tokenizer.ggml.eot_token_id")
    if eot is not None and "eos_token_id" in config and int(eot) != config["eos_token_id"]:
        config["eos_token_id"] = [config["eos_token_id"], int(eot)]


def write_model_folder(
    out_dir: Path, config: dict, weights: Dict[str, mx.array], meta: Dict[str, Any]
) -> Path:
    """Write an mlx-lm model folder: weights, config, generation config and tokenizer."""
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _write_tokenizer(meta, config, out_dir)
    return out_dir


# ----------------------------------------------------------------------------
# Conversion cache
# ----------------------------------------------------------------------------


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


def ensure_converted(
    gguf_path: Path, root: Path, dtype_name: str, convert: Callable[..., Path]
) -> Path:
    """``<root>/<stem>-<dtype>``, converted with ``convert(src, out, dtype=...)`` unless a valid one exists."""
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
        convert(gguf_path, tmp, dtype=dtype_name)
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
