"""veloxquant-mlx: KV-cache eviction for mlx-lm, with memory pinned at a fixed budget."""

import sys as _sys


def _started_as_the_cli() -> bool:
    """Whether this import is the start of ``python -m veloxquant_mlx`` or of the ``veloxquant-mlx`` script
    (while ``-m`` imports the package, ``sys.argv[0]`` is ``"-m"``; ``sys.orig_argv`` names the module)."""
    argv0 = _sys.argv[0] if _sys.argv else ""
    if argv0.replace("\\", "/").rsplit("/", 1)[-1] in ("veloxquant-mlx", "veloxquant-mlx.exe"):
        return True
    orig = list(getattr(_sys, "orig_argv", ()))
    return argv0 == "-m" and "-m" in orig and orig[orig.index("-m") + 1:][:1] == [__name__]


# The imports take seconds (mlx-lm, transformers). A Ctrl-C meanwhile ends the command line as it does
# later, with one "interrupted" line and status 130; a library import keeps Python's KeyboardInterrupt.
try:
    from .builder import KVCacheBuilder, load_prompt_cache
    from .caches import EvictionCache, Method, Needs, View, continue_on_purpose
    from .config import KVCacheConfig
    from . import methods as _methods  # noqa: F401 (registers every method)
    from .prompt_cache import save_prompt_cache
    from .registry import methods, register
    from .tap import install_query_tap, remove_query_tap
    from .platform.slow_blas import warn_if_slow_blas as _warn_if_slow_blas
except KeyboardInterrupt:
    if not _started_as_the_cli():
        raise
    print("interrupted", file=_sys.stderr)
    raise SystemExit(130) from None

_warn_if_slow_blas()  # once per process, on a Linux CPU without OpenBLAS preloaded: the one-line fix

__version__ = "0.1.0"

__all__ = [
    "KVCacheBuilder", "KVCacheConfig", "EvictionCache", "Method", "Needs", "View", "methods", "register",
    "continue_on_purpose",
    "install_query_tap", "remove_query_tap", "save_prompt_cache", "load_prompt_cache",
]
