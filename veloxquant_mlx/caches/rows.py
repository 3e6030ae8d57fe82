"""RowStore: one layer's kept rows in buffers with exact headroom.

Keys and values (quantized in mlx-lm's layout where ``config.kv_bits``: ``caches.quant``), each row's
absolute position per (batch row, KV head), and the per-row fields a method declares. Every buffer change
builds a NEW contiguous array (``with_headroom`` or one gather that includes the headroom), so a buffer
never pins a larger one and the allocated bytes follow the kept rows. Prompt text held until the prompt
ends grows in steps like mlx-lm's KVCache; ragged per-head storage (heads keeping different counts) pads
with ``PAD_POSITION`` rows, cut to the widest head by the allocation.

The headroom holds the positions its rows will get (``prefilled``: row ``rows + j`` is appended at
``offset + j`` until storage is rebuilt), so a one-token append writes only its keys and values.
"""

from __future__ import annotations

import mlx.core as mx

from ..ops import gather_rows
from ..ops.select import PAD_POSITION, gather_rows_of
from .quant import (buf_dtype, buf_nbytes, buf_parts, buf_shape, bytes_per_row, check_group, dequantize_rows,
                    from_parts, quantize_rows, row_dim, rows_map, rows_zip)

__all__ = ["PAD_POSITION", "RowStore", "with_headroom"]


def with_headroom(rows, extra: int, fill=0) -> mx.array:
    """A NEW contiguous buffer: ``rows`` (an array, or a list of arrays joined along axis 2) followed by
    ``extra`` rows of ``fill`` along axis 2, in one copy (a buffer is never a view that pins a larger array)."""
    parts = list(rows) if isinstance(rows, list) else [rows]  # a list joins (not the caller's); a tuple never
    if extra > 0:
        shape = list(parts[0].shape)
        shape[2] = extra
        parts.append(mx.full(shape, fill, parts[0].dtype) if fill else mx.zeros(shape, parts[0].dtype))
    return mx.concatenate(parts, axis=2) if len(parts) > 1 else mx.contiguous(parts[0])


def _joined(old, prev: int, new, extra: int, fill=0) -> mx.array:
    """A NEW buffer: the first ``prev`` rows of ``old``, then ``new``, then ``extra`` rows of ``fill``."""
    return with_headroom([old[:, :, :prev], new], extra, fill)


class RowStore:
    """The kept rows of one layer (module docstring). ``fields``: per-row field -> the value of a new row;
    ``written``: the fields the method writes for every new row itself (no fill write in place)."""

    step = 256  # prompt text held to the prompt's end grows in steps of this many rows, like mlx-lm's KVCache
    decode_step = 64  # a single token that outgrows the buffer adds this many rows (unbounded decode)

    def __init__(self, bits: int | None, group_size: int, fields: dict, written: tuple = ()):
        self.bits, self.group_size = bits, group_size
        self.fills, self.written = dict(fields), tuple(written)
        self.unwritten = [(n, fill) for n, fill in self.fills.items() if n not in self.written]  # append fills them
        self.keys = self.values = self.positions = None  # (B, H, capacity, ...) as held (quantized: tuples)
        self.fields: dict = {}  # name -> (B, H, capacity) float32
        self.rows = 0  # stored rows per head (padding included)
        self.ragged = False  # heads keep different numbers of rows (padding present)
        self.prefilled = None  # the positions buffer whose headroom holds its future positions
        self.external = False  # a batch row: the batch holds the keys and values (caches.batch_storage)

    # -- reads -----------------------------------------------------------------------------------------
    def raw(self, name: str = "keys"):
        """The stored rows of ``keys``, ``values``, ``positions`` or a field, as held (quantized: the parts)."""
        arr = {"keys": self.keys, "values": self.values, "positions": self.positions}.get(name)
        load = getattr(arr, "load", None)
        if load is not None:  # a paged prompt's rows, read back from its file on first use (caches.pages)
            arr = load()
            setattr(self, name, arr)
        if arr is None:
            arr = self.fields[name]
        r = self.rows
        return rows_map(lambda a: a[:, :, :r], arr)

    def read(self, name: str = "keys") -> mx.array:
        """:meth:`raw`, quantized keys / values dequantized: exactly the values attention reads."""
        return dequantize_rows(self.raw(name), self.bits, self.group_size)

    def fetch(self):
        """(keys, values) of every stored row, as attention reads them (quantized: the parts)."""
        r = self.rows
        if r == self.positions.shape[2]:
            return self.keys, self.values
        return rows_map(lambda a: a[:, :, :r], self.keys), rows_map(lambda a: a[:, :, :r], self.values)

    def kept_per_head(self) -> mx.array:
        """(B, H) real kept rows per batch row and KV head."""
        return (self.raw("positions") != PAD_POSITION).sum(axis=-1)

    # -- writes ----------------------------------------------------------------------------------------
    def check(self, keys, values, head_dim: int | None) -> None:
        """New rows must be 4-D floating (B, H, S >= 1, D) and match what is stored: clear errors otherwise."""
        if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
            raise TypeError("keys and values must be mx.array")
        if keys.ndim != 4 or values.ndim != 4:
            raise ValueError(f"keys/values must be 4-D (B, H_kv, S, D), got {keys.shape} and {values.shape}")
        if keys.shape[:3] != values.shape[:3]:
            raise ValueError(f"keys {keys.shape} and values {values.shape} disagree on (B, H_kv, S)")
        if keys.shape[2] == 0:
            raise ValueError("update_and_fetch needs at least one new token")
        if not (mx.issubdtype(keys.dtype, mx.floating) and mx.issubdtype(values.dtype, mx.floating)):
            raise TypeError(f"keys/values must be floating point, got {keys.dtype} and {values.dtype}")
        if head_dim is not None and keys.shape[-1] != head_dim:
            raise ValueError(f"config.head_dim={head_dim} but the model sends keys with head_dim={keys.shape[-1]}")
        bits = self.bits
        if self.keys is None:
            check_group(keys.shape[-1], bits, self.group_size)
            check_group(values.shape[-1], bits, self.group_size)
            return
        B, H, _, Dk = buf_shape(self.keys, bits)
        Dv = row_dim(self.values, bits)
        if (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3]) != (B, H, Dk, Dv):
            raise ValueError(f"new keys {keys.shape}/values {values.shape} do not match the stored "
                             f"(B={B}, H_kv={H}, D_k={Dk}, D_v={Dv})")
        kd, vd = buf_dtype(self.keys), buf_dtype(self.values)
        if keys.dtype != kd or values.dtype != vd:
            raise TypeError(f"dtype changed: stored {kd}/{vd}, new {keys.dtype}/{values.dtype}")

    def append(self, keys, values, offset: int, exact: bool = False):
        """Store S new rows at positions ``offset ..`` and return every stored row as attention reads them
        (the step attends to them all, whatever is evicted after it). A buffer that cannot take them grows:
        a single token by ``decode_step`` rows, a chunk evicted right after its step (``exact``) to exactly
        its rows, prompt text held to its end in steps of ``step`` rows."""
        B, H, S, _ = keys.shape
        prev, need = self.rows, self.rows + S
        kv = not self.external
        if kv and self.bits is not None:  # each new row quantized once, as mlx-lm's QuantizedKVCache does
            keys = quantize_rows(keys, self.bits, self.group_size)
            values = quantize_rows(values, self.bits, self.group_size)
        if self.positions is None or need > self.positions.shape[2]:
            cap = need + self.decode_step if S == 1 else need if exact else -(-need // self.step) * self.step
            self._grow(keys, values, offset, (B, H, S), cap - need, kv)
        else:
            if kv and self.bits is None:
                self.keys[:, :, prev:need] = keys
                self.values[:, :, prev:need] = values
            elif kv:  # quantized rows: each part of the buffer
                for buf, new in ((self.keys, keys), (self.values, values)):
                    for part, r in zip(buf, new):
                        part[:, :, prev:need] = r
            if self.prefilled is not self.positions:  # a buffer given (loaded, recalled): write the positions
                self.positions[:, :, prev:need] = offset if S == 1 else mx.arange(offset, offset + S, dtype=mx.int32)
            for name, fill in self.unwritten:
                self.fields[name][:, :, prev:need] = fill
        self.rows = need
        if not kv:
            return None
        if self.bits is None:
            return self.keys[:, :, :need], self.values[:, :, :need]
        return self.fetch()

    def _grow(self, keys, values, offset: int, shape: tuple, extra: int, kv: bool) -> None:
        """New buffers of the stored rows, the new ones and ``extra`` rows of headroom (one copy each)."""
        (B, H, S), prev = shape, self.rows
        if kv:
            self.keys = rows_zip(lambda o, n: _joined(o, prev, n, extra), self.keys, keys) if prev else \
                rows_map(lambda n: with_headroom(n, extra), keys)
            self.values = rows_zip(lambda o, n: _joined(o, prev, n, extra), self.values, values) if prev else \
                rows_map(lambda n: with_headroom(n, extra), values)
        pos = mx.broadcast_to(mx.arange(offset, offset + S + extra, dtype=mx.int32), (B, H, S + extra))
        self.positions = self.prefilled = _joined(self.positions, prev, pos, 0) if prev else mx.contiguous(pos)
        for name, fill in self.fills.items():
            new = mx.full((B, H, S), fill, mx.float32)
            self.fields[name] = _joined(self.fields[name], prev, new, extra, fill) if prev else \
                with_headroom(new, extra, fill)

    def compact(self, idx: mx.array, real: mx.array | None, extra: int, offset: int, prefill: bool = True) -> int:
        """Keep the stored rows ``idx`` (B, H, K) (``real`` False: padding) in NEW buffers with ``extra`` rows
        of headroom (never an in-place write: this step's attention still reads the slices it was handed).
        The headroom's positions are the ones the next appends will get (``prefill``; else padding)."""
        K = idx.shape[-1]
        # keys and values with their headroom in ONE gather (headroom rows repeat row 0 until overwritten);
        # quantized rows: words, scales and biases gathered alike, never requantized. (A batch row gets its
        # own buffer of kept rows here, which the batch writes back into its slice at the next step.)
        k_idx = idx if extra <= 0 else mx.concatenate([idx, mx.zeros((*idx.shape[:-1], extra), idx.dtype)], -1)
        # a paged prompt's keys or values not read back (caches.pages.PagedRows): only the kept rows are read
        paged = {name: getattr(getattr(self, name), "gather", None) for name in ("keys", "values")}
        held = [name for name in ("keys", "values") if paged[name] is None]
        parts = {name: buf_parts(getattr(self, name)) for name in held}
        kept = gather_rows_of([p for name in held for p in parts[name]], k_idx)
        for name in ("keys", "values"):
            if paged[name] is not None:
                setattr(self, name, paged[name](k_idx))
            else:
                n = len(parts[name])
                setattr(self, name, from_parts(kept[:n], getattr(self, name)))
                kept = kept[n:]
        pos = gather_rows(self.positions, idx)
        if real is not None:
            pos = mx.where(real, pos, PAD_POSITION)
        self.ragged = real is not None
        if extra <= 0 or not prefill:
            self.positions, self.prefilled = with_headroom(pos, extra, PAD_POSITION), None
        else:
            B, H = pos.shape[:2]
            ahead = mx.broadcast_to(mx.arange(offset, offset + extra, dtype=mx.int32), (B, H, extra))
            self.positions = self.prefilled = mx.concatenate([pos, ahead], axis=2)
        for name in self.fields:
            self.fields[name] = with_headroom(gather_rows(self.fields[name], idx), extra)
        self.rows = K
        return K

    def write(self, fields: dict) -> None:
        """Per-row fields of the newest rows: ``{name: (B, H or 1, n)}`` covers the last n stored rows."""
        r = self.rows
        for name, v in fields.items():
            self.fields[name][:, :, r - v.shape[2]:r] = v

    def replace(self, keys, values, positions: mx.array, fields: dict, ragged: bool) -> None:
        """These rows become the stored rows (read back from a page file, joined with recalled rows): no
        headroom, the next append grows; their positions are written row by row."""
        self.keys, self.values = keys, values
        self.positions, self.prefilled = mx.contiguous(positions), None
        self.fields, self.rows, self.ragged = dict(fields), positions.shape[2], ragged

    def drop(self, rows: int = 0) -> None:
        """Forget every buffer; ``rows`` rows live elsewhere (a closed page file: ``caches.pages``)."""
        self.keys = self.values = self.positions = self.prefilled = None
        self.fields, self.rows, self.ragged = {}, rows, False

    def bind(self, keys, values) -> None:
        """A batch row's keys and values: views of the batch's buffers (``caches.batch_storage``)."""
        self.keys, self.values = keys, values

    # -- bytes -----------------------------------------------------------------------------------------
    @property
    def nbytes(self) -> int:
        """Allocated bytes: the key / value buffers' capacity (packed words, scales, biases), positions, fields."""
        if self.positions is None:
            return 0
        return (buf_nbytes(self.keys) + buf_nbytes(self.values) + self.positions.nbytes
                + sum(a.nbytes for a in self.fields.values()))

    def kept_bytes(self) -> int:
        """Bytes of the kept rows' keys and values (ragged heads: their real rows, counted by a host read)."""
        if self.keys is None:
            return 0
        B, H = self.positions.shape[:2]
        return (int(self.kept_per_head().sum().item()) if self.ragged else B * H * self.rows) * self.row_bytes()

    def full_bytes(self, tokens: int) -> int:
        """Bytes mlx-lm's uncompressed KVCache would hold for ``tokens`` tokens of these heads."""
        return 0 if self.keys is None else self.positions.shape[0] * self.positions.shape[1] * tokens * \
            self.full_row_bytes()

    def row_bytes(self) -> int:
        """Stored bytes of one kept row (K and V of one head)."""
        return bytes_per_row(self.keys) + bytes_per_row(self.values)

    def full_row_bytes(self) -> int:
        """Bytes of one row of mlx-lm's uncompressed KVCache (K and V in the model's dtype)."""
        bits = self.bits
        return (row_dim(self.keys, bits) * buf_dtype(self.keys).size
                + row_dim(self.values, bits) * buf_dtype(self.values).size)

    # -- state (save / load) ---------------------------------------------------------------------------
    def arrays(self) -> dict:
        """The stored rows as saved: keys / values as held (quantized: ``.scales`` / ``.biases`` beside the
        words, so a round trip is exact), positions, each field as ``row.<name>``."""
        st = {"positions": self.raw("positions")}
        for name in ("keys", "values"):
            rows = self.raw(name)
            if isinstance(rows, tuple):
                st[name], st[name + ".scales"], st[name + ".biases"] = rows
            else:
                st[name] = rows
        st.update({"row." + name: self.raw(name) for name in self.fields})
        return st

    def load(self, st: dict, owner: str) -> None:
        """:meth:`arrays` read back (``owner`` names the cache in errors)."""
        required = {"keys", "values", "positions"}
        if not required <= set(st):
            raise ValueError(f"{owner} state is missing {sorted(required - set(st))}")
        quant_parts = {f"{n}.{p}" for n in ("keys", "values") for p in ("scales", "biases")}
        if self.bits is not None:
            if not quant_parts <= set(st):
                raise ValueError(f"{owner} state is missing {sorted(quant_parts - set(st))} "
                                 f"(the config stores {self.bits}-bit rows)")
            keys = (st["keys"], st["keys.scales"], st["keys.biases"])
            values = (st["values"], st["values.scales"], st["values.biases"])
        elif quant_parts & set(st):
            raise ValueError(f"{owner} state holds quantized rows but the config has kv_bits=None")
        else:
            keys, values = st["keys"], st["values"]
        fields = {k[4:]: v for k, v in st.items() if k.startswith("row.")}
        if set(fields) != set(self.fills):
            raise ValueError(f"{owner} state has row fields {sorted(fields)}, expected {sorted(self.fills)}")
        positions = st["positions"]
        parts = [p for buf in (keys, values) for p in (buf if isinstance(buf, tuple) else (buf,))]
        if any(p.shape[:3] != positions.shape for p in parts):
            raise ValueError("inconsistent cache state: keys/values/positions row counts differ")
        self.keys, self.values, self.positions, self.prefilled = keys, values, positions, None
        self.fields, self.rows = fields, positions.shape[2]
