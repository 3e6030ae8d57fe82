"""The model-pass hook: compressions that wait for the model, run after the model's own forward.

A cache cannot call the model; the builder can. ``install_model_pass(model)`` gives the model
instance a subclass whose ``__call__`` (what ``mlx_lm.generate`` / ``generate_step`` /
``BatchGenerator`` call) does, per forward:

1. hands every eviction cache whose method reads them the forward's token ids (``cache.input_ids``; a batch
   cache slices them per row), and tells every one that a deferred compression will run (``pass_driven``);
2. runs the original forward (lazily, as always); a prompt-time compression whose method needs the model
   marks its cache ``pass_due`` instead of evicting;
3. after the forward, per sequence holding such a cache (a batch row's own caches, or the plain list),
   runs ``caches.passes.run_model_pass(driver, seq)``: the method's pass, the cross-layer shares, each
   layer's compression. ``seq`` lists that sequence's per-layer (cache, batch index or None) pairs, ``driver``
   gives the model's own forward, scratch copies of the other caches, the tokenizer and a per-model memo
   (:class:`ModelPassDriver`).

The glue names no method: what a pass does lives with the method that asks for it (``Method.model_pass``).
Reversible (``remove_model_pass``); the instance keeps its class's name, module, parameters and
``isinstance`` checks.
"""

from __future__ import annotations

import copy

import mlx.core as mx

from .caches.batch import BatchEvictionCache
from .caches.passes import run_model_pass

_DRIVER = "_veloxquant_model_pass"
_SUBCLASSES: dict = {}


class ModelPassDriver:
    """What a method's ``model_pass`` may use: the model, its original forward, scratch copies
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
    ours = [c for c in cache or () if hasattr(c, "pass_driven")]
    for c in ours:  # (attribute writes, not calls: this runs on every forward)
        c.pass_driven = True
        if c.needs_ids:
            c.input_ids = ids
    due = False
    try:
        out = base.__call__(model, inputs, *args, **kwargs)
    finally:
        for c in ours:
            c.pass_driven = False
            due = due or c.pass_due
    seqs = _due_sequences(cache) if due else ()
    if seqs:
        driver = model.__dict__.get(_DRIVER)
        if driver is None:
            driver = ModelPassDriver()
            object.__setattr__(model, _DRIVER, driver)
        driver.bind(model, base)
        try:
            for seq in seqs:
                run_model_pass(driver, seq)
        finally:
            driver.bind(None, None)
    return out


def _due_sequences(cache) -> list:
    """Per sequence whose compression waits for the pass: its per-layer caches (a batch row's own caches,
    or the plain list), each a (cache, batch index or None) pair, in layer order."""
    plain, rows = False, set()
    for c in cache:  # (a loop, not a generator: it runs on every forward)
        if isinstance(c, BatchEvictionCache):
            rows.update(i for i, r in enumerate(c.rows) if r.pass_due)
        elif getattr(c, "pass_due", False):
            plain = True
    seqs = [[(c, None) for c in cache]] if plain else []
    for i in sorted(rows):
        seqs.append([(c.rows[i] if isinstance(c, BatchEvictionCache) else c, i) for c in cache])
    return seqs
