"""Real-model loaders (bundled SmolLM2-135M GGUF, Gemma 3 270M, Qwen2.5-Coder-1.5B, other llama/gemma3/qwen2
GGUFs) for mlx-lm."""

from .gguf_llama import (
    BUNDLED_GGUF_FILENAME,
    ModelNotAvailableError,
    convert_gguf,
    default_cache_dir,
    find_bundled_gguf,
    load_gemma3_270m,
    load_gguf_model,
    load_model,
    load_qwen_coder_1_5b,
)

__all__ = [
    "BUNDLED_GGUF_FILENAME",
    "ModelNotAvailableError",
    "convert_gguf",
    "default_cache_dir",
    "find_bundled_gguf",
    "load_gemma3_270m",
    "load_gguf_model",
    "load_model",
    "load_qwen_coder_1_5b",
]
