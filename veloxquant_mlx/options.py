"""Method options: :func:`option` declares a validated dataclass field once (type, range,
choices, doc); :func:`validate_options` checks an options dataclass against it. No package imports:
method files, the config and the CLI all read the same metadata from here.
"""

from __future__ import annotations

import dataclasses
import math


def option(default, *, kind=None, low=None, high=None, low_open=False, choices=None, allow_none=False,
           doc="", small=None):
    """A validated dataclass field.

    kind: int / float / bool / str / tuple; low/high: inclusive bounds (``low_open`` makes low
    exclusive); choices: allowed values; allow_none: ``None`` is valid (e.g. n=None means n=inf);
    small: the value for tiny shapes (budget 32 tokens, prompts of ~40: the tests and the behaviour
    fingerprint), where the default does not fit or would never evict (see :func:`small_options`).
    """
    if kind is None:
        kind = type(default) if default is not None else float
    meta = dict(kind=kind, low=low, high=high, low_open=low_open, choices=choices,
                allow_none=allow_none, doc=doc, small=small)
    if isinstance(default, (list, dict)):
        raise TypeError("option defaults must be immutable")
    return dataclasses.field(default=default, metadata=meta)


def check_value(owner: str, name: str, value, meta: dict):
    kind = meta["kind"]
    if value is None:
        if meta["allow_none"]:
            return value
        raise ValueError(f"{owner}.{name} must not be None")
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{owner}.{name} must be an int, got {type(value).__name__} {value!r}")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ValueError(f"{owner}.{name} must be finite, got {value!r}")
        value = float(value)
    elif kind is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{owner}.{name} must be a bool, got {type(value).__name__} {value!r}")
    elif kind is str:
        if not isinstance(value, str):
            raise TypeError(f"{owner}.{name} must be a string, got {type(value).__name__} {value!r}")
    elif kind is tuple:
        if not isinstance(value, (tuple, list)):
            raise TypeError(f"{owner}.{name} must be a tuple, got {type(value).__name__} {value!r}")
        value = tuple(value)
    if meta["choices"] is not None and value not in meta["choices"]:
        raise ValueError(f"{owner}.{name} must be one of {list(meta['choices'])}, got {value!r}")
    low, high = meta["low"], meta["high"]
    if low is not None and (value <= low if meta["low_open"] else value < low):
        op = ">" if meta["low_open"] else ">="
        raise ValueError(f"{owner}.{name} must be {op} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{owner}.{name} must be <= {high}, got {value!r}")
    return value


def parse_value(text: str, kind, allow_none: bool = False):
    """A value of ``kind`` from its text (the grammar of method specs and CLI flags): ints, floats,
    ``true`` / ``false``, strings, tuples as ``(a,b,c)`` or ``a,b,c``; ``none`` (or ``inf``: n=None means
    n=inf) is None when ``allow_none``. Raises ValueError saying what was expected."""
    text = text.strip()
    if allow_none and text.lower() in ("none", "inf"):
        return None
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
    elif kind is str:
        return text
    elif kind is tuple:
        try:
            return tuple(float(x) for x in text.strip("()").split(","))
        except ValueError:
            pass
    else:
        try:
            return kind(text)
        except ValueError:
            pass
    what = {bool: "true or false", int: "an int", float: "a number", tuple: "numbers like (0.4,0.4,0.2)"}
    raise ValueError(f"expected {what.get(kind, kind.__name__)}{' or none' if allow_none else ''}, got {text!r}")


def format_value(value) -> str:
    """The text :func:`parse_value` reads back as ``value``."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(repr(float(v)) for v in value) + ")"
    return repr(value) if isinstance(value, float) else str(value)


def validate_options(opts) -> None:
    """Check every field of an options dataclass against its :func:`option` metadata (in place)."""
    owner = type(opts).__name__
    for f in dataclasses.fields(opts):
        if "kind" in f.metadata:
            object.__setattr__(opts, f.name, check_value(owner, f.name, getattr(opts, f.name), f.metadata))
    check = getattr(opts, "check", None)
    if check is not None:
        check()


def small_options(options_cls) -> dict:
    """``{field: small value}`` of an options dataclass: the options that make a method evict on
    tiny shapes (budget 32). Tests build every registered method with these, so a new method only
    declares ``small=`` on its own options."""
    return {f.name: f.metadata["small"] for f in dataclasses.fields(options_cls)
            if f.metadata.get("small") is not None}


@dataclasses.dataclass
class NoOptions:
    """Methods without tunable options."""


RECALL_TIERS = ("memory", "disk")
RECALL_BITS = (2, 4, 8)


def check_recall(recall, page, bits, folder, pages, window) -> tuple:
    """Validate the cold-tier fields of a KVCacheConfig (recall, recall_page, recall_bits, recall_dir,
    recall_pages, recall_window). A ``recall_dir`` is tried for writing here, before any cache exists,
    so a read-only folder fails before a single row is evicted."""
    import os

    if recall is not None and recall not in RECALL_TIERS:
        raise ValueError(f"recall={recall!r} is not supported: use None, 'memory' or 'disk'")
    int_meta = dict(kind=int, high=None, low_open=False, choices=None, allow_none=False)
    page = check_value("KVCacheConfig", "recall_page", page, {**int_meta, "low": 1, "high": 1024})
    pages = check_value("KVCacheConfig", "recall_pages", pages, {**int_meta, "low": 1})
    window = check_value("KVCacheConfig", "recall_window", window, {**int_meta, "low": 1})
    if isinstance(bits, bool) or bits not in RECALL_BITS:
        raise ValueError(f"recall_bits={bits!r} is not supported: use one of {list(RECALL_BITS)}")
    if folder is not None and recall != "disk":
        raise ValueError(f"recall_dir={os.fspath(folder)!r} is only used by recall='disk' (recall={recall!r})")
    return recall, page, bits, writable_folder("recall_dir", folder), pages, window


def writable_folder(name: str, folder):
    """``folder`` (None, or a path) as a string, refused in one line unless it exists and takes a file."""
    import os
    import tempfile

    if folder is None:
        return None
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"{name} must be a path, got {type(folder).__name__}")
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise ValueError(f"{name}={folder!r} is not an existing folder")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise ValueError(f"{name}={folder!r} is not writable: {e.strerror or e}") from None
    return folder


def check_pages(prompt_eviction, folder, block, recall, method, cls) -> tuple:
    """Validate the paged prompt's fields (``page_dir``, ``page_block``). The folder is tried for writing
    here, before any cache exists, so a read-only folder fails before the prompt starts."""
    import os

    block = check_value("KVCacheConfig", "page_block", block,
                        dict(kind=int, low=1, high=None, low_open=False, choices=None, allow_none=False))
    if prompt_eviction != "offload":
        if folder is not None:
            raise ValueError(f"page_dir={os.fspath(folder)!r} is only used by prompt_eviction='offload'")
        return folder, block
    if recall is not None:
        raise ValueError(f"prompt_eviction='offload' keeps every row in its page file, which a follow-up input "
                         f"re-selects from: it does not take a recall tier (recall={recall!r})")
    return writable_folder("page_dir", folder), block


def check_recall_hold(recall, hold, method, cls):
    """``recall_hold``: a bool, with a cold tier, for a method whose compression runs in the cache (a
    compression deferred to a model pass, KVzip's, would run over the next input's rows too)."""
    if not isinstance(hold, bool):
        raise TypeError(f"recall_hold must be True or False, got {hold!r}")
    if hold and recall is None:
        raise ValueError("recall_hold=True needs a cold tier: recall='memory' or 'disk'")
    if hold and cls.compresses_in_model_pass:
        raise ValueError(f"recall_hold=True is not supported by {method!r}: its compression runs in a model "
                         "pass after the forward")
    return hold


def check_recall_every(recall, every):
    """``recall_every``: None, or recall every N decode steps. Only the ``"memory"`` tier recalls
    without a host sync, so only it may recall inside a decode step."""
    if every is None:
        return None
    every = check_value("KVCacheConfig", "recall_every", every,
                        dict(kind=int, low=1, high=None, low_open=False, choices=None, allow_none=False))
    if recall != "memory":
        raise ValueError(f"recall_every={every} needs recall='memory' (recall={recall!r}): a decode step "
                         "must not read the disk tier's file")
    return every


def evict_every(default: int = 32):
    """The ``evict_every`` option of a decode-bounded method: rows allowed above the budget before one
    eviction step (amortized; the papers evict every step, 1)."""
    return option(default, low=1, small=4, doc="rows allowed above the budget before one eviction step")
