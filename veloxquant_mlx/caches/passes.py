"""After a forward: the compressions that waited for the method's model pass (``Needs.model_pass``).

A cache cannot call the model; the builder's model-pass wrapper can. A prompt-time compression whose
method asks for the pass (``Method.wants_pass``) marks its cache ``pass_due`` instead of evicting; after
the forward the wrapper hands each sequence's caches to :func:`run_model_pass`: the method's pass (KVzip's
reconstruction) gives per-row fields of the newest rows, one ranking across the layers gives each its
share where the method keeps shares (``Method.layer_shares``, ``caches.allocation.LayerShares``), and
every layer compresses to its own keep. A cache no wrapper drives runs the same function at once, without
the model (``driver`` None).
"""

from __future__ import annotations

import warnings

from .allocation import LayerShares

_warned: set = set()


def run_model_pass(driver, seq: list) -> None:
    """``seq``: one sequence's per-layer (cache, batch index or None) pairs; ``driver``: the glue's
    ModelPassDriver (None: no model at hand)."""
    due = [c for c, _ in seq if getattr(c, "pass_due", False)]
    if not due:
        return
    method = type(due[0].method)
    fields = method.model_pass(driver, seq) or [{}] * len(due)
    for c, f in zip(due, fields, strict=True):
        c.write_fields(f)
    field, shares = due[0].method.layer_shares, None
    if field is not None and driver is None:
        if method.name not in _warned:
            _warned.add(method.name)
            warnings.warn(f"{method.name} ranks rows across layers after the forward, which needs the caches built by "
                          "KVCacheBuilder (its model wrapper): each layer keeps its own budget", stacklevel=6)
    elif field is not None:
        shares = LayerShares(method.name).shares([c.view for c in due], field)
    for i, c in enumerate(due):
        c.compress(None if shares is None else shares[i])
