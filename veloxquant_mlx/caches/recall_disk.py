"""The ``recall="disk"`` cold tier: full-precision cold rows in a file the tier owns.

The file holds one record per (page, batch row, KV head): the page's keys, values (their raw bits,
so bfloat16 needs no conversion) and positions. Nothing of it stays resident: reads go through a
``numpy.memmap`` of the records a recall picked. Writing needs materialized arrays, so evicted pages
wait in memory ("pending", counted as resident) until :meth:`DiskTier.flush`, which runs at the end of
a prompt's one-shot compression and at each recall (the one host sync per layer of this tier, never
per decode token). The file is removed when the tier is freed or the process exits normally; a deep
copy (mlx-lm's prompt-cache reuse) gets its own copy of the file. A killed process cannot remove its
files: they stay in ``recall_dir`` (default: the system temp folder) until the next disk tier opened
there removes every file whose owner's pid no longer runs.
"""

from __future__ import annotations

import copy
import os
import shutil

import mlx.core as mx
import numpy as np

from .quant import buf_nbytes
from .recall import ColdTier, MemoryTier
from .scratch_files import RAW_BITS, OwnedFile



def make_cold_tier(config):
    """The cold tier a config asks for (None: recall off)."""
    if config.recall is None:
        return None
    return (MemoryTier if config.recall == "memory" else DiskTier)(config)


class DiskTier(ColdTier):
    """Cold rows on disk (module docstring)."""

    def __init__(self, config):
        super().__init__(config)
        self.folder = config.recall_dir
        self._open_file()
        self.dtype = None  # the rows' mx dtype, set by the first store
        self.record = None  # numpy record dtype of one (page, b, h)
        self.shape = None  # (B, H)
        self.flushed = 0  # pages in the file
        self.pending = []  # (keys, values, positions) of pages not written yet, in page order

    def _open_file(self) -> None:
        self.file = OwnedFile(self, self.folder, "recall", "recall='disk'")
        self.path = self.file.path

    def free(self) -> None:
        """Remove the file now (also done when the tier is garbage-collected or at exit)."""
        self.file.free()

    def __deepcopy__(self, memo):
        # Arrays are copied (in-place page writes must not reach the original), the file too.
        new = DiskTier.__new__(DiskTier)
        shared = ("file", "dtype", "record")  # an mx / numpy dtype is immutable (and mx's cannot be copied)
        new.__dict__.update({k: (v if k in shared else copy.deepcopy(v, memo)) for k, v in self.__dict__.items()})
        new.file = self.file.copy_for(new)
        new.path = new.file.path
        return new

    def _layout(self, keys, values):
        B, H, _, D = keys.shape
        Dv = values.shape[-1]
        self.dtype, self.shape = keys.dtype, (B, H)
        raw = RAW_BITS[keys.dtype.size][1]
        self.record = np.dtype([("k", raw, (self.page, D)), ("v", raw, (self.page, Dv)),
                                ("pos", np.int32, (self.page,))])

    def store(self, keys, values, pos) -> None:
        if self.record is None:
            self._layout(keys, values)
        self.pending.append((keys, values, pos))

    def _records(self, keys, values, pos) -> np.ndarray:
        """(n, B, H) records of (B, H, n*page, ...) rows (a host read of materialized arrays)."""
        raw = RAW_BITS[self.dtype.size][0]
        B, H = self.shape
        n = pos.shape[2] // self.page
        rec = np.empty((n, B, H), self.record)

        def pages(a):  # (B, H, n*page, X) -> (n, B, H, page, X)
            a = np.array(a)
            return np.moveaxis(a.reshape(B, H, n, self.page, *a.shape[3:]), 2, 0)
        rec["k"] = pages(keys.astype(self.dtype).view(raw))
        rec["v"] = pages(values.astype(self.dtype).view(raw))
        rec["pos"] = pages(pos)
        return rec

    def flush(self) -> None:
        if not self.pending:
            return
        keys, values, pos = (mx.concatenate(parts, axis=2) for parts in zip(*self.pending))
        rec = self._records(keys, values, pos)
        try:
            with open(self.path, "ab") as f:
                f.write(rec.tobytes())
        except OSError as e:  # the rows are still pending: nothing was dropped
            raise RuntimeError(f"recall='disk' cannot write {rec.nbytes} bytes to {self.path!r}: "
                               f"{e.strerror or e}; the evicted rows are kept in memory") from None
        self.flushed += rec.shape[0]
        self.pending = []

    def _map(self, mode="r"):
        if not os.path.exists(self.path):
            raise ValueError(f"recall='disk' file {self.path!r} is gone: its cold rows cannot be read")
        return np.memmap(self.path, dtype=self.record, mode=mode, shape=(self.flushed, *self.shape))

    def _where(self, pages):
        p = np.array(pages)  # the host sync of a recall: which pages to read
        B, H, m = p.shape
        return p, np.arange(B)[:, None, None], np.arange(H)[None, :, None]

    def read(self, pages, rows):
        p, b, h = self._where(pages)
        rec = np.array(self._map()[p, b, h])  # (B, H, m) records: the only rows read from disk
        B, H, m = p.shape

        def rows_of(field):
            a = rec[field]
            return mx.array(a.reshape(B, H, m * self.page, *a.shape[4:]))
        keys = rows_of("k").view(self.dtype)
        values = rows_of("v").view(self.dtype)
        return keys, values, rows_of("pos")

    def write(self, pages, rows, keys, values, pos) -> None:
        p, b, h = self._where(pages)
        rec = self._records(keys, values, pos)  # (m, B, H): page i of every (b, h)
        mm = self._map("r+")
        mm[p, b, h] = np.moveaxis(rec, 0, 2)
        del mm  # no msync: the page cache serves the next read, and the file is this process's scratch

    # -- accounting and state -------------------------------------------------------------------
    @property
    def rows_bytes(self) -> int:
        return sum(buf_nbytes(a) for part in self.pending for a in part)

    @property
    def disk_bytes(self) -> int:
        return 0 if self.record is None else self.flushed * self.shape[0] * self.shape[1] * self.record.itemsize

    def rows_state(self) -> dict:
        st = {}
        for i, (k, v, p) in enumerate(self.pending):
            st.update({f"recall.pending.{i}.k": k, f"recall.pending.{i}.v": v, f"recall.pending.{i}.pos": p})
        return st

    def set_rows_state(self, st: dict) -> None:
        n = sum(1 for k in st if k.startswith("recall.pending.") and k.endswith(".pos"))
        self.pending = [(st[f"recall.pending.{i}.k"], st[f"recall.pending.{i}.v"], st[f"recall.pending.{i}.pos"])
                        for i in range(n)]

    def meta(self) -> dict:
        layout = None if self.record is None else {"dtype": str(self.dtype), "shape": list(self.shape),
                                                   "d": self.record["k"].shape[-1], "dv": self.record["v"].shape[-1]}
        return {**super().meta(), "path": self.path, "flushed": self.flushed, "layout": layout}

    def set_meta(self, meta: dict) -> None:
        """A loaded cache copies the saved tier's file into a file of its own; it refuses when the
        file is gone or does not hold the pages the cache says it wrote."""
        super().set_meta(meta)
        self.flushed = meta.get("flushed", 0)
        layout = meta.get("layout")
        if layout is not None:
            dtype = getattr(mx, layout["dtype"].rpartition(".")[2])
            B, H = layout["shape"]
            self._layout(mx.zeros((B, H, 1, layout["d"]), dtype), mx.zeros((B, H, 1, layout["dv"]), dtype))
        if self.flushed:
            src = meta.get("path")
            want = self.disk_bytes
            if not src or not os.path.exists(src):
                raise ValueError(f"this saved cache's recall='disk' file {src!r} is gone (it lives as long as "
                                 "the cache that wrote it): its cold rows cannot be loaded")
            if os.path.getsize(src) != want:
                raise ValueError(f"recall='disk' file {src!r} holds {os.path.getsize(src)} bytes, the saved "
                                 f"cache expects {want}")
            shutil.copyfile(src, self.path)
