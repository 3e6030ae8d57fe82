"""Real-model loaders (bundled SmolLM2-135M GGUF, Gemma 3 270M, other llama/gemma3 GGUFs) for mlx-lm."""

from .gguf_llama import (
    BUNDLED_GGUF_FILENAME,
    ModelNotAvailableError,
    convert_gguf,
    default_cache_dir,
    find_bundled_gguf,
    load_gemma3_270m,
    load_gguf_model,
    load_model,
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
]
