"""KVzip: query-agnostic compression by context reconstruction (its method, its pass and its scoring ops)."""

from .cache import KVzip, KVzipOptions

__all__ = ["KVzip", "KVzipOptions"]
