"""veloxquant-mlx: KV-cache eviction for mlx-lm, with memory pinned at a fixed budget."""

from .builder import KVCacheBuilder, load_prompt_cache
from .caches import EvictionCache, Method, Needs, View
from .config import KVCacheConfig
from . import methods as _methods  # noqa: F401 (registers every method)
from .prompt_cache import save_prompt_cache
from .registry import methods, register
from .tap import install_query_tap, remove_query_tap
from .platform.slow_blas import warn_if_slow_blas as _warn_if_slow_blas

_warn_if_slow_blas()  # once per process, on a Linux CPU without OpenBLAS preloaded: the one-line fix

__version__ = "0.1.0"

__all__ = [
    "KVCacheBuilder", "KVCacheConfig", "EvictionCache", "Method", "Needs", "View", "methods", "register",
    "install_query_tap", "remove_query_tap", "save_prompt_cache", "load_prompt_cache",
]
