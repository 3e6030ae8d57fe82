"""The eviction methods: one module, or one folder when a method brings its own ops, per method.
Importing this package registers every method in it (each method's ``@register`` line)."""

import importlib
import pkgutil

for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")
