"""Reading a GGUF's tensors and metadata: ``mx.load`` where it reads every tensor exactly, else the
``gguf`` package, dequantizing one tensor at a time as each is read."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import mlx.core as mx

from .gguf_meta import _meta

logger = logging.getLogger(__name__)

_GGUF_GROUP_SIZE = 32  # all block quantizations MLX reads use 32-wide blocks



class _DequantizedOnRead(Mapping):
    """A GGUF's tensors by name, each dequantized to float32 when it is read.

    The file stays memory-mapped; holding every float32 copy at once would need
    4 bytes a weight on top of the converted output (~14 GB for a 1.5B model).
    """

    def __init__(self, reader):
        self._tensors = {t.name: t for t in reader.tensors}

    def __getitem__(self, name: str) -> mx.array:
        import numpy as np
        from gguf.constants import GGMLQuantizationType as QT
        from gguf.quants import dequantize

        t = self._tensors[name]
        qtype = QT(int(t.tensor_type))
        if qtype == QT.BF16:  # numpy has no bfloat16: widen the raw bits to float32
            a = (np.asarray(t.data).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif qtype in (QT.F32, QT.F16):
            a = np.asarray(t.data, dtype=np.float32)
        else:
            a = dequantize(np.asarray(t.data), qtype).astype(np.float32)
        # GGUF lists dimensions innermost first; numpy/mlx order is the reverse
        return mx.array(a.reshape([int(n) for n in reversed(t.shape.tolist())]))

    def shape(self, name: str) -> Tuple[int, ...]:
        return tuple(int(n) for n in reversed(self._tensors[name].shape.tolist()))

    def __iter__(self):
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _gguf_reader(path: Path):
    """``gguf.GGUFReader`` over ``path`` (memory-mapped: reading it costs nothing), or None without gguf."""
    try:
        from gguf import GGUFReader
    except ImportError:
        return None
    return GGUFReader(str(path))


def tensor_shape(tensors: Mapping[str, mx.array], name: str) -> Optional[Tuple[int, ...]]:
    """The shape of a tensor (None when absent) without dequantizing it."""
    if name not in tensors:
        return None
    if isinstance(tensors, _DequantizedOnRead):
        return tensors.shape(name)
    return tuple(tensors[name].shape)


# Tensor types mx.load reads exactly. It turns the others into float16 itself: wrongly for Q4_K
# (mlx 0.32: 79 % relative error on Qwen2.5-Coder's blk.0.attn_q, and the model talks nonsense),
# or it fails (Q5_0).
_MLX_EXACT_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
# llama.cpp file types (general.file_type) named after those: all F32, F16, Q4_0, Q4_1, Q8_0, BF16
_MLX_EXACT_FILE_TYPES = {0, 1, 2, 3, 7, 32}


def read_gguf(path: Path) -> Tuple[Mapping[str, mx.array], Dict[str, Any]]:
    """``(tensors, metadata)`` of a GGUF: ``mx.load`` when every tensor is of a type it reads
    exactly, else the ``gguf`` package, dequantizing one tensor at a time as each is read.

    ``mx.load`` returns Q4_0/Q4_1/Q8_0 as packed triples (see :func:`_dequantize`).
    Without ``gguf`` installed the tensor types cannot be listed, so the file's declared
    ``general.file_type`` must be one of those types.
    """
    reader = _gguf_reader(path)
    if reader is not None:
        from gguf.constants import GGMLQuantizationType as QT

        other = sorted({QT(int(t.tensor_type)).name for t in reader.tensors} - _MLX_EXACT_TYPES)
        if other:
            logger.info("%s holds %s tensors; dequantizing them with the gguf package", path.name, other)
            return _DequantizedOnRead(reader), {k: f.contents() for k, f in reader.fields.items()}
        del reader
        return mx.load(str(path), return_metadata=True)
    fix = (f"{path.name} holds tensor types MLX cannot read exactly (e.g. Q4_K, Q5_0, Q6_K); "
           "fix: pip install gguf")
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except RuntimeError:
        raise ImportError(fix) from None
    file_type = _meta(meta, "general.file_type")
    if file_type is not None and int(file_type) not in _MLX_EXACT_FILE_TYPES:
        raise ImportError(fix)
    return tensors, meta


def _dequantize(tensors: Mapping[str, mx.array], base: str) -> mx.array:
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
