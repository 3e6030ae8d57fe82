"""GGUF metadata values as Python objects (``mx.load`` returns them as arrays, strings or lists)."""

from __future__ import annotations

from typing import Any, Dict

import mlx.core as mx


def _py(value: Any) -> Any:
    """Convert an ``mx.load`` metadata value (mx.array / str / list) to Python."""
    if isinstance(value, mx.array):
        value = value.tolist()
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
    return value


def _meta(meta: Dict[str, Any], key: str, default: Any = None) -> Any:
    return _py(meta[key]) if key in meta else default
