"""Helpers for getting a fast CPU BLAS under MLX on Linux.

MLX's Linux CPU wheel (``mlx-cpu``) links a bundled *reference* BLAS, which
runs fp32 matmuls at only a few GFLOP/s.  Preloading Debian's OpenBLAS
(``apt-get install libopenblas0-pthread``) with ``LD_PRELOAD`` makes MLX bind
``sgemm``/``cblas_sgemm`` to OpenBLAS instead and speeds fp32 matmul up by
roughly an order of magnitude.  ``OPENBLAS_NUM_THREADS=1`` is used because a
multi-threaded OpenBLAS inside MLX's own CPU threads was seen to hang once.

``LD_PRELOAD`` only takes effect at process start, hence
:func:`reexec_with_openblas`, which restarts the current Python command with
the library preloaded.  It is also available as a launcher::

    python -m veloxquant_mlx.blas your_script.py --args
    python -m veloxquant_mlx.blas -m some.module --args
"""

from __future__ import annotations

import glob
import os
import platform
import sys
import time
from typing import List, Optional, Sequence

__all__ = [
    "find_openblas",
    "openblas_preloaded",
    "blas_hint",
    "reexec_with_openblas",
    "measure_matmul_gflops",
    "blas_info",
    "REEXEC_GUARD_ENV",
]

#: Set in the environment of a re-executed process so it never re-executes again.
REEXEC_GUARD_ENV = "VELOXQUANT_BLAS_REEXEC"
#: Explicit path override for the OpenBLAS shared library.
OPENBLAS_PATH_ENV = "VELOXQUANT_OPENBLAS"

_LIB = "libopenblas.so.0"
# Other libraries that also count as "an optimized BLAS is preloaded".
_OPTIMIZED_BLAS_MARKERS = ("libopenblas", "libmkl_rt", "libblis")


def _multiarch_dirs() -> List[str]:
    machine = platform.machine().lower()
    triples = {
        "x86_64": ["x86_64-linux-gnu"],
        "amd64": ["x86_64-linux-gnu"],
        "aarch64": ["aarch64-linux-gnu"],
        "arm64": ["aarch64-linux-gnu"],
        "ppc64le": ["powerpc64le-linux-gnu"],
        "s390x": ["s390x-linux-gnu"],
        "riscv64": ["riscv64-linux-gnu"],
    }.get(machine, [])
    dirs = []
    for triple in triples:
        # Debian/Ubuntu: the pthread flavour first (what we recommend), then
        # the alternatives symlink, then the other flavours.
        dirs += [
            f"/usr/lib/{triple}/openblas-pthread",
            f"/usr/lib/{triple}",
            f"/usr/lib/{triple}/openblas-serial",
            f"/usr/lib/{triple}/openblas-openmp",
        ]
    # Fedora/Arch/Alpine/source installs.
    dirs += ["/usr/lib64", "/usr/lib", "/usr/local/lib", "/opt/OpenBLAS/lib"]
    return dirs


def find_openblas() -> Optional[str]:
    """Return the path of a system ``libopenblas.so.0`` or ``None``.

    ``$VELOXQUANT_OPENBLAS`` overrides the search.  Only Linux is searched
    (macOS MLX uses Accelerate and needs nothing).
    """
    override = os.environ.get(OPENBLAS_PATH_ENV)
    if override:
        return override if os.path.isfile(override) else None
    if not sys.platform.startswith("linux"):
        return None
    for directory in _multiarch_dirs():
        candidate = os.path.join(directory, _LIB)
        if os.path.isfile(candidate):
            return candidate
    # Last resort: a versioned file without the .so.0 alias.
    for directory in _multiarch_dirs():
        hits = sorted(glob.glob(os.path.join(directory, "libopenblas*.so*")))
        hits = [h for h in hits if "64_" not in os.path.basename(h)]  # ILP64 symbols don't interpose
        if hits:
            return hits[0]
    return None


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


def openblas_preloaded() -> bool:
    """True when OpenBLAS is in ``LD_PRELOAD`` and actually mapped in this process.

    A library that is merely loaded later (e.g. NumPy's own ``scipy_openblas``)
    does not count: only a preloaded one overrides MLX's bundled BLAS.
    """
    return _preloaded(("libopenblas",))


def _mlx_on_cpu() -> bool:
    try:
        import mlx.core as mx

        return mx.default_device() == mx.cpu
    except Exception:  # pragma: no cover - mlx missing/broken
        return True


def blas_hint() -> Optional[str]:
    """One-line advice when MLX runs on a Linux CPU with its slow reference BLAS.

    Returns ``None`` when nothing can be improved (not Linux, MLX on a GPU, an
    optimized BLAS already preloaded).
    """
    if not sys.platform.startswith("linux") or not _mlx_on_cpu():
        return None
    if _preloaded(_OPTIMIZED_BLAS_MARKERS):
        return None
    launcher = "re-run with --fast-blas (or `python -m veloxquant_mlx.blas <script> ...`)"
    if find_openblas():
        return (
            "MLX is using its slow reference CPU BLAS; OpenBLAS is installed: "
            f"{launcher} for ~10x faster fp32 matmul"
        )
    return (
        "MLX is using its slow reference CPU BLAS; for ~10x faster fp32 matmul run "
        f"`apt-get install libopenblas0-pthread` and {launcher}"
    )


def _default_argv() -> List[str]:
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return list(orig[1:])  # keeps "-m pkg.module" intact, unlike sys.argv
    return list(sys.argv)


def reexec_with_openblas(
    argv: Optional[Sequence[str]] = None,
    *,
    library: Optional[str] = None,
    num_threads: int = 1,
) -> bool:
    """Re-execute this Python process with OpenBLAS in ``LD_PRELOAD``.

    ``argv`` is the argument list for the interpreter (without the executable);
    by default the current command line (``sys.orig_argv[1:]``), so both
    ``python script.py ...`` and ``python -m pkg ...`` restart unchanged.

    On success this call does not return (``os.execve``).  It returns ``False``
    without doing anything when OpenBLAS is already preloaded, when no OpenBLAS
    library is found, on non-Linux platforms, or when this process was itself
    started by a re-exec (``$VELOXQUANT_BLAS_REEXEC`` is set) -- the latter
    guarantees there is never a re-exec loop even if the preload failed.
    """
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get(REEXEC_GUARD_ENV) or openblas_preloaded():
        return False
    lib = library or find_openblas()
    if not lib or not os.path.isfile(lib):
        return False
    args = list(_default_argv() if argv is None else argv)
    env = dict(os.environ)
    previous = env.get("LD_PRELOAD", "").strip()
    env["LD_PRELOAD"] = f"{lib}:{previous}" if previous else lib
    env["OPENBLAS_NUM_THREADS"] = str(int(num_threads))
    env[REEXEC_GUARD_ENV] = "1"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os.execve(sys.executable, [sys.executable, *args], env)
    return True  # pragma: no cover - execve does not return


def measure_matmul_gflops(n: int = 512, repeats: int = 3, dtype=None) -> float:
    """Best-of-``repeats`` fp32 (default) ``n x n`` matmul throughput in GFLOP/s
    on MLX's default device."""
    import mlx.core as mx

    dtype = mx.float32 if dtype is None else dtype
    a = mx.random.normal((n, n), key=mx.random.key(0)).astype(dtype)
    b = mx.random.normal((n, n), key=mx.random.key(1)).astype(dtype)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up
    best = float("inf")
    for _ in range(max(1, int(repeats))):
        start = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / max(best, 1e-12) / 1e9


def blas_info(measure: bool = False) -> dict:
    """Small dict describing the BLAS setup, for benchmark result files."""
    info = {
        "openblas_path": find_openblas(),
        "openblas_preloaded": openblas_preloaded(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if measure:
        info["matmul_gflops_512_fp32"] = measure_matmul_gflops()
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m veloxquant_mlx.blas [script.py | -m module] [args...]``

    Without arguments: print the BLAS status and a quick matmul benchmark.
    With arguments: run that Python command with OpenBLAS preloaded.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "--status"):
        if args and args[0] in ("-h", "--help"):
            print(main.__doc__)
            return 0
        info = blas_info(measure=True)
        for key, value in info.items():
            print(f"{key}: {value}")
        hint = blas_hint()
        if hint:
            print(f"hint: {hint}")
        return 0
    if not openblas_preloaded():
        reexec_with_openblas(args)  # does not return on success
        hint = blas_hint()
        if hint:
            print(f"veloxquant_mlx.blas: {hint}", file=sys.stderr)
    # Already preloaded (or impossible): run the command in a fresh interpreter
    # image anyway so behaviour is identical either way.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *args])
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
