"""The one warning a library user gets at ``import veloxquant_mlx`` when MLX's CPU matmuls run on its slow
reference BLAS, and what it needs to know. Apart from :mod:`.blas` (the launcher), so that importing the
package does not import the launcher's module before ``python -m veloxquant_mlx.platform.blas`` runs it.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import List, Optional, Sequence

from .blas_locate import find_blas

_OPTIMIZED_BLAS_MARKERS = ("libopenblas", "libmkl_rt", "libblis")


def _preload_entries() -> List[str]:
    raw = os.environ.get("LD_PRELOAD", "")
    return [p for p in raw.replace(":", " ").split() if p]


def _mapped_libraries() -> Optional[str]:
    try:
        with open("/proc/self/maps", "r") as fh:
            return fh.read()
    except OSError:
        return None


def _preloaded(markers: Sequence[str]) -> bool:
    entries = [e for e in _preload_entries() if any(m in os.path.basename(e) for m in markers)]
    if not entries:
        return False
    maps = _mapped_libraries()
    if maps is None:  # cannot verify (no procfs): trust LD_PRELOAD
        return True
    # The dynamic loader silently ignores preload entries it cannot open, so
    # confirm the library really is mapped into this process.
    return any(m in maps for m in markers)


def _mlx_on_cpu() -> bool:
    try:
        import mlx.core as mx

        return mx.default_device() == mx.cpu
    except Exception:  # pragma: no cover - mlx missing/broken
        return True


class SlowBlasWarning(UserWarning):
    """MLX runs its fp32 matmuls on the slow reference CPU BLAS (Linux CPU, nothing preloaded)."""


_warned_slow_blas = False


def _run_by_our_cli() -> bool:
    """``python -m veloxquant_mlx ...`` (or its launcher / console script): it prints its own note."""
    argv = list(getattr(sys, "orig_argv", None) or sys.argv)
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module.split(".")[0] == "veloxquant_mlx" or os.path.basename(sys.argv[0] or "") == "veloxquant-mlx"


def warn_if_slow_blas() -> None:
    """Once per process: a :class:`SlowBlasWarning` naming the one-line fix, when MLX's CPU matmuls
    run on its reference BLAS (a library user's script gets it at ``import veloxquant_mlx``; the CLI
    prints its own note). Silence it with ``warnings.filterwarnings("ignore", category=SlowBlasWarning)``."""
    global _warned_slow_blas
    if _warned_slow_blas or not sys.platform.startswith("linux") or _run_by_our_cli():
        return
    _warned_slow_blas = True
    if not _mlx_on_cpu() or _preloaded(_OPTIMIZED_BLAS_MARKERS):
        return
    fix = "python -m veloxquant_mlx.platform.blas your_script.py"
    lib = find_blas()
    where = f"OpenBLAS from {lib.source} is installed" if lib else \
        "`pip install cmeel-openblas` (or `apt-get install libopenblas0-pthread`) first"
    warnings.warn(f"MLX is using its slow reference CPU BLAS (~30x slower fp32 matmul; {where}): run "
                  f"`{fix}` to preload OpenBLAS (docs/cpu-blas.md)", SlowBlasWarning, stacklevel=3)
