"""KVzip: query-agnostic compression by context reconstruction (its method, its pass and its scoring ops)."""

from .method import KVzip, KVzipOptions

__all__ = ["KVzip", "KVzipOptions"]
