"""Files a cache owns on disk (the recall tier's cold rows, the paged prompt's rows): created in a folder
that is checked before anything is written, removed when their owner is freed or the process exits, and
named with the owner's pid so that the next owner opened in the same folder removes what a killed process
(SIGKILL, a crash) left behind."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import mlx.core as mx
import numpy as np

# numpy has no bfloat16: rows go to a file as their raw bits, an unsigned integer of their size (mx, numpy)
RAW_BITS = {1: (mx.uint8, np.uint8), 2: (mx.uint16, np.uint16), 4: (mx.uint32, np.uint32)}


def host_bits(a: mx.array) -> np.ndarray:
    """The array's raw bits on the host (materialized)."""
    return np.array(a.view(RAW_BITS[a.dtype.size][0]) if a.dtype.size in RAW_BITS else a)


PREFIX = "veloxquant-"  # + kind + "-" + the owner's pid + "-": a killed owner's files are found by it
KINDS = ("recall", "pages")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _owner_pid(name: str):
    for kind in KINDS:
        head = f"{PREFIX}{kind}-"
        if name.startswith(head) and name.endswith(".bin"):
            pid = name[len(head):].split("-", 1)[0]
            return int(pid) if pid.isdigit() else None
    return None


def sweep_dead(folder: str) -> int:
    """Remove the files a killed process left in ``folder`` (its pid no longer runs). Files of live
    processes, and names no cache here writes, are left alone. Returns how many were removed."""
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    n = 0
    for name in names:
        pid = _owner_pid(name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            n += remove(os.path.join(folder, name))
    return n


def remove(path: str) -> bool:
    try:
        os.remove(path)
    except OSError:
        return False
    return True


def folder_of(folder: str | None) -> str:
    return folder or tempfile.gettempdir()


class OwnedFile:
    """A new empty file ``veloxquant-<kind>-<pid>-*.bin`` in ``folder`` (None: the system temp folder),
    removed when ``owner`` is garbage-collected, at exit, or by :meth:`free`. ``what`` names the owner
    in the one-line error raised when the folder cannot take the file."""

    def __init__(self, owner, folder: str | None, kind: str, what: str):
        if kind not in KINDS:
            raise ValueError(f"unknown scratch file kind {kind!r}")
        self.folder, self.kind, self.what = folder_of(folder), kind, what
        sweep_dead(self.folder)
        try:
            fd, self.path = tempfile.mkstemp(prefix=f"{PREFIX}{kind}-{os.getpid()}-", suffix=".bin", dir=self.folder)
        except OSError as e:
            raise ValueError(f"{what} cannot create its file in {self.folder!r}: {e.strerror or e}") from None
        os.close(fd)
        self._finalizer = weakref.finalize(owner, remove, self.path)

    def free(self) -> None:
        """Remove the file now."""
        self._finalizer()

    def copy_for(self, owner) -> "OwnedFile":
        """A new file of the same kind in the same folder, with this one's bytes, owned by ``owner``."""
        new = OwnedFile(owner, self.folder, self.kind, self.what)
        shutil.copyfile(self.path, new.path)
        return new

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.folder).free
