"""What the model's forward tells the caches: its token ids, and the caches that deferred work to after it.

A cache cannot call the model; the glue's model-pass wrapper (``veloxquant_mlx.model_pass``) can. Around
every forward it opens a frame (``feeding``): a cache reads the token ids it is fed (``input_ids``), and a
cache whose work needs the model (a reconstruction pass at the prompt's end, say) calls ``defer(self)``;
after the forward the wrapper calls ``type(cache).run_model_pass(forward, seq)`` once per sequence with
such a cache (``EvictionCache.run_model_pass`` documents the hook). A batch cache feeding one of its rows
narrows the frame to that row's slice of the input (``input_span``). One thread = one generation.
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx

_LOCAL = threading.local()


class Frame:
    __slots__ = ("ids", "due", "span")

    def __init__(self, ids):
        self.ids = ids  # (B, S) int token ids of this forward, or None (embeddings fed)
        self.due = []  # caches that deferred work to the model pass after this forward
        self.span = None  # (batch index, start, count) while a batch cache feeds one row


@contextlib.contextmanager
def feeding(ids):
    """The model wrapper's forward: caches may read ``ids`` and defer work to after it."""
    prev = getattr(_LOCAL, "frame", None)
    frame = _LOCAL.frame = Frame(ids)
    try:
        yield frame
    finally:
        _LOCAL.frame = prev


def current() -> Frame | None:
    return getattr(_LOCAL, "frame", None)


@contextlib.contextmanager
def input_span(i: int, start: int, count: int):
    """While a batch cache feeds row ``i`` the tokens ``start:start + count`` of this forward."""
    frame = current()
    if frame is None:
        yield
        return
    prev, frame.span = frame.span, (i, start, count)
    try:
        yield
    finally:
        frame.span = prev


def input_ids() -> mx.array | None:
    """(B, S) token ids the cache being fed now receives, or None (no wrapper, or embeddings fed)."""
    frame = current()
    if frame is None or frame.ids is None:
        return None
    if frame.span is None:
        return frame.ids
    i, a, n = frame.span
    return frame.ids[i:i + 1, a:a + n]


def defer(cache) -> bool:
    """Ask for ``type(cache).run_model_pass`` after this forward; False when no wrapper drives it."""
    frame = current()
    if frame is None:
        return False
    frame.due.append(cache)
    return True
