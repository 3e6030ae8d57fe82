"""KVzipCache: query-agnostic compression by context reconstruction (its cache and its scoring ops)."""

from .cache import KVzipCache, KVzipOptions

__all__ = ["KVzipCache", "KVzipOptions"]
