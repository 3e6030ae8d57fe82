"""Method registry: name -> method class (``caches.method.Method``: each carries its Options dataclass).

Importing the package fills it: ``veloxquant_mlx.methods`` imports every method file, whose ``@register``
line adds its class. This module imports nothing of the package.
"""

from __future__ import annotations

_METHODS: dict = {}

# The label of "no eviction" (mlx-lm's own KVCache) in the CLI, serve and the evaluation; never a method.
FULL = "full"


def register(name: str):
    """Class decorator: ``@register("nexus")`` makes ``KVCacheConfig(method="nexus")`` build this class."""

    def wrap(cls):
        method = getattr(cls, "method_class", None) or cls  # a deprecated EvictionCache subclass: its method
        if name in _METHODS and _METHODS[name] is not method:
            raise ValueError(f"method {name!r} is already registered to {_METHODS[name].__name__}")
        method.name = name
        _METHODS[name] = method
        return cls

    return wrap


def get_method(name: str):
    if not isinstance(name, str):
        raise TypeError(f"method must be a string, got {type(name).__name__}")
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(
            f"unknown method {name!r}; known methods: {', '.join(sorted(_METHODS))}"
        ) from None


def methods() -> dict:
    """All registered methods, name -> one-line description."""
    return {name: (cls.__doc__ or "").strip().splitlines()[0] for name, cls in sorted(_METHODS.items())}
