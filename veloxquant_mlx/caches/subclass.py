"""The deprecated way to write a method, kept working for one release: an ``EvictionCache`` subclass that
overrides ``scores(self)`` (reading ``self.stored(...)``, ``self.observed_window()``), declaring
``Options``, ``query_window``, ``needs_queries``, ``prefill_only``, ``supports_ada`` and ``default_recent`` as
class attributes. Registering such a subclass registers the :class:`Subclassed` method that stands for it;
new methods implement ``caches.method.Method`` (docs/add_a_method.md)."""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref

from ..options import NoOptions
from .allocation import AdaRows, Uniform
from .method import Method, Needs


class Subclassed(Method):
    """The method of an ``EvictionCache`` subclass: its scores are the subclass's ``scores()``."""

    cache_class = None  # the subclass (set per subclass by :func:`method_of_subclass`)

    def __init__(self, config, layer=0, n_layers=1, cache=None):
        super().__init__(config, layer, n_layers)
        self.cache = weakref.proxy(cache)  # (the cache holds its method: no cycle)
        self._of = id(cache)

    def __deepcopy__(self, memo):
        new = copy.copy(self)
        new.cache, new._of = weakref.proxy(memo[self._of]), id(memo[self._of])
        return new

    def scores(self, view):
        return self.cache.scores()

    @classmethod
    def default_recent(cls, budget, options):
        own = getattr(cls.cache_class, "default_recent", None)
        return own(budget, options) if own is not None else Method.default_recent(budget, options)


def method_of_subclass(cls):
    """The :class:`Subclassed` method standing for the EvictionCache subclass ``cls``; warns when it is not one
    of this package's."""
    if not cls.__module__.startswith("veloxquant_mlx."):
        warnings.warn(f"{cls.__name__} subclasses EvictionCache, which is deprecated and will stop working in the "
                      "next release: write the method as a veloxquant_mlx.Method (docs/add_a_method.md)",
                      DeprecationWarning, stacklevel=3)

    def declared(name, default):
        v = inspect.getattr_static(cls, name, default)
        return v if isinstance(v, type(default)) or name == "Options" else default

    ada = declared("supports_ada", True)
    window = declared("query_window", 0)
    return type(cls.__name__, (Subclassed,), {
        "cache_class": cls, "__module__": cls.__module__, "__doc__": cls.__doc__,
        "Options": getattr(cls, "Options", NoOptions), "prefill_only": declared("prefill_only", False),
        "needs": Needs(queries=declared("needs_queries", True), window=window),
        "allocations": {"uniform": Uniform, "ada": AdaRows} if ada else {"uniform": Uniform}})
