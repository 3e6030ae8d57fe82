"""The deprecated way to write a method, kept working for one release: an ``EvictionCache`` subclass that
overrides ``scores(self)`` (reading ``self.stored(...)``, ``self.observed_window()``). Registering such a
subclass registers the :class:`Subclassed` method that stands for it; new methods implement
``caches.method.Method`` (docs/add_a_method.md)."""

from __future__ import annotations

import copy
import inspect
import warnings
import weakref

from .allocation import AdaRows, Uniform
from .method import Method, Needs

# Class attributes of a subclass that its method declares in the new protocol.
_DECLARED = ("Options", "prefill_only", "config_defaults", "supports_kv_bits", "attention_mass_field",
             "compresses_in_model_pass", "model_pass_note")


class Subclassed(Method):
    """The method of an ``EvictionCache`` subclass: its hooks are the subclass's own."""

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
        return cls.cache_class.default_recent(budget, options)

    @classmethod
    def check_config(cls, config):
        cls.cache_class.check_config(config)

    @classmethod
    def attach(cls, model, methods):
        cls.cache_class.attach_model(model, [m.cache for m in methods])

    @classmethod
    def model_pass(cls, driver, seq):
        cls.cache_class.run_model_pass(driver, seq)


def method_of_subclass(cls, base):
    """The :class:`Subclassed` method standing for ``cls``, a subclass of ``base`` (EvictionCache); warns when
    it is not one of this package's."""
    if not cls.__module__.startswith("veloxquant_mlx."):
        warnings.warn(f"{cls.__name__} subclasses EvictionCache, which is deprecated and will stop working in the "
                      "next release: write the method as a veloxquant_mlx.Method (docs/add_a_method.md)",
                      DeprecationWarning, stacklevel=3)
    attrs = {name: inspect.getattr_static(cls, name) for name in _DECLARED}
    needs = Needs(queries=cls.needs_queries, hidden_states=cls.needs_hidden_states, model_pass=cls.needs_model_pass)
    return type(cls.__name__, (Subclassed,), {**attrs, "cache_class": cls, "needs": needs,
                                              "allocations": _allocations(cls, base), "__module__": cls.__module__,
                                              "__doc__": cls.__doc__})


def _allocations(cls, base) -> dict:
    """What the subclass supports: Ada-KV where it declares it, or keeps the base selection over its scores."""
    if cls.supports_ada is not None:
        ada = cls.supports_ada
    else:
        ada = cls.select_rows is base.select_rows and cls.scores is not base.scores
    return {"uniform": Uniform, "ada": AdaRows} if ada else {"uniform": Uniform}
