"""Eviction caches. Importing this package registers every method file in it (one file per method)."""

import importlib
import pkgutil

from .base import PAD_POSITION, EvictionCache

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["EvictionCache", "PAD_POSITION"]
