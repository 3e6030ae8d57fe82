"""The model-pass hook: work a cache defers to after the model's own forward, with the model at hand.

A cache cannot call the model; the builder can. ``install_model_pass(model)`` gives the model
instance a subclass whose ``__call__`` (what ``mlx_lm.generate`` / ``generate_step`` /
``BatchGenerator`` call) does, per forward:

1. opens a frame (``caches.forward.feeding``) holding the forward's token ids, which a cache may read
   (``caches.forward.input_ids``; a batch cache narrows it to each row's slice);
2. runs the original forward (lazily, as always); a cache whose work needs the model (a
   reconstruction pass at the prompt's end, say) defers it (``caches.forward.defer``);
3. after the forward, per sequence holding such a cache (a batch row's own caches, or the plain list),
   calls ``type(cache).run_model_pass(driver, seq)``: ``seq`` lists that sequence's per-layer
   (cache, batch index or None) pairs, ``driver`` gives the model's own forward, scratch copies of
   the other caches, the tokenizer and a per-model memo (:class:`ModelPassDriver`).

The glue names no method: what a pass does lives with the method that asks for it
(``EvictionCache.run_model_pass``). Reversible (``remove_model_pass``); the instance keeps its
class's name, module, parameters and ``isinstance`` checks.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from .caches.batch import BatchEvictionCache
from .caches.forward import feeding

_DRIVER = "_veloxquant_model_pass"
_SUBCLASSES: dict = {}


class ModelPassDriver:
    """What a cache's ``run_model_pass`` hook may use: the model, its original forward, scratch copies
    of layer caches, the tokenizer (None when not given) and a memo the hooks keep per model."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.memo: dict = {}
        self.model = self._base = None

    def bind(self, model, base) -> "ModelPassDriver":
        self.model, self._base = model, base
        return self

    def forward(self, inputs, cache):
        """The model's own forward (the wrapper's hooks do not run again inside it)."""
        return self._base.__call__(self.model, inputs, cache=cache)

    @staticmethod
    def scratch(c, i):
        """A copy of a layer cache the pass may advance (never the caller's own)."""
        if i is not None and hasattr(c, "extract"):
            return c.extract(i)
        return copy.deepcopy(c)


def install_model_pass(model, tokenizer=None) -> None:
    """Make ``model(...)`` open a forward frame and run the model passes caches defer. Idempotent; a
    tokenizer given later replaces the prompt (None keeps the one set before)."""
    cls = type(model)
    if not getattr(cls, "__veloxquant_pass__", False):
        sub = _SUBCLASSES.get(cls)
        if sub is None:
            def __call__(self, inputs, *args, **kwargs):
                return _forward(self, cls, inputs, args, kwargs)

            sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__, "__veloxquant_pass__": True,
                                                "__veloxquant_base__": cls})
            _SUBCLASSES[cls] = sub
        model.__class__ = sub
    if tokenizer is not None or _DRIVER not in model.__dict__:
        object.__setattr__(model, _DRIVER, ModelPassDriver(tokenizer))


def set_pass_tokenizer(model, tokenizer) -> None:
    """Remember the tokenizer the model passes use, for a later ``for_model`` that is given none (an
    evaluation harness loads the model and tokenizer once, then builds caches many times)."""
    object.__setattr__(model, _DRIVER, ModelPassDriver(tokenizer))


def remove_model_pass(model) -> bool:
    """Undo :func:`install_model_pass`. Returns True when it was installed."""
    cls = type(model)
    if not getattr(cls, "__veloxquant_pass__", False):
        return False
    model.__class__ = cls.__veloxquant_base__
    if _DRIVER in model.__dict__:
        object.__delattr__(model, _DRIVER)
    return True


def model_pass_installed(model) -> bool:
    return bool(getattr(type(model), "__veloxquant_pass__", False))


def _forward(model, base, inputs, args, kwargs):
    cache = kwargs.get("cache", args[0] if args else None)
    ids = inputs if (isinstance(inputs, mx.array) and inputs.ndim == 2
                     and mx.issubdtype(inputs.dtype, mx.integer)) else None
    with feeding(ids) as frame:
        out = base.__call__(model, inputs, *args, **kwargs)
    if frame.due and cache is not None:
        driver = model.__dict__.get(_DRIVER)
        if driver is None:
            driver = ModelPassDriver()
            object.__setattr__(model, _DRIVER, driver)
        driver.bind(model, base)
        try:
            for seq, kinds in _due_sequences(list(cache), frame.due):
                for kind in kinds:
                    kind.run_model_pass(driver, seq)
        finally:
            driver.bind(None, None)
    return out


def _due_sequences(cache: list, due: list) -> list:
    """Per sequence with a deferred pass: its per-layer caches (a batch row's own caches, or the plain
    list), each a (cache, batch index or None) pair, and the classes that deferred, in layer order."""
    due_ids = {id(c) for c in due}
    rows = set()
    plain = False
    for c in cache:
        if id(c) in due_ids:
            plain = True
        elif isinstance(c, BatchEvictionCache):
            rows.update(i for i, r in enumerate(c.rows) if id(r) in due_ids)
    seqs = [[(c, None) for c in cache]] if plain else []
    for i in sorted(rows):
        seqs.append([(c.rows[i] if isinstance(c, BatchEvictionCache) else c, i) for c in cache])
    return [(seq, list(dict.fromkeys(type(c) for c, _ in seq if id(c) in due_ids))) for seq in seqs]
