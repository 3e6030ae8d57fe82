"""Helpers for getting a fast CPU BLAS under MLX on Linux.

MLX's Linux CPU wheel (``mlx-cpu``) links a bundled *reference* BLAS, which runs fp32 matmuls at
only a few GFLOP/s. Preloading an OpenBLAS with ``LD_PRELOAD`` makes MLX bind ``cblas_sgemm`` to it
instead (about 30x faster fp32 matmul). Two sources are searched, in this order:

1. ``cmeel-openblas`` from PyPI (``pip install -e ".[fast-cpu]"``): an unprefixed
   ``libopenblas.so.0`` under ``site-packages/cmeel.prefix/lib``. It needs ``libgfortran.so.5``,
   which most machines without a Fortran toolchain lack; the copy that ``mlx-cpu`` (or NumPy)
   bundles under ``<pkg>.libs/`` is used then. Those copies carry hashed sonames
   (``libgfortran-<hash>.so.5.0.0``), and the dynamic loader matches an already loaded library
   only by soname or by file identity, so the bundled file is preloaded by its full path *and* a
   symlink named ``libgfortran.so.5`` pointing at it is put in a small directory (under
   ``$VELOXQUANT_CACHE_DIR`` or ``~/.cache/veloxquant_mlx``) that is prepended to ``LD_LIBRARY_PATH``: the loader opens the
   symlink, sees the same file and reuses the preloaded copy.
2. The system's OpenBLAS (Debian: ``apt-get install libopenblas0-pthread``).

The x86_64 ``cmeel-openblas`` wheel is built for one target, SKYLAKEX (AVX-512, no DYNAMIC_ARCH): on
a CPU without AVX-512 its ``sgemm`` dies of SIGILL, which the child-process probe below catches
(it runs one ``cblas_sgemm``), and the system library or the hint takes over. The aarch64 wheel is
built for NEOVERSEN2 (not tried here); the same probe guards it.

Wheels with *prefixed* symbols (``scipy-openblas32``: ``scipy_cblas_sgemm``; NumPy's bundled
``scipy_openblas64_``) cannot interpose MLX's ``cblas_sgemm`` and are not used.

``LD_PRELOAD`` only takes effect at process start, hence :func:`reexec_with_openblas`, which
checks the preload in a throw-away child process (a preload whose dependencies do not resolve
kills every process started with it) and then restarts the current Python command with it. It
is also available as a launcher::

    python -m veloxquant_mlx.platform.blas your_script.py --args
    python -m veloxquant_mlx.platform.blas -m some.module --args
    python -m veloxquant_mlx.platform.blas              # status and a 1024x1024 fp32 matmul benchmark

The default is one OpenBLAS thread (``$OPENBLAS_NUM_THREADS`` set by the user wins): on the
bundled model two threads were not faster on a 2-core machine (see README, "CPU BLAS").
Nothing here does anything on macOS (MLX uses Accelerate / Metal there).
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Dict, List, Optional, Sequence, Tuple

from .slow_blas import (_OPTIMIZED_BLAS_MARKERS, SlowBlasWarning, _mlx_on_cpu, _preload_entries,  # noqa: F401
                        _preloaded, warn_if_slow_blas)
from .blas_locate import (_PIP_SOURCE, OPENBLAS_PATH_ENV, BlasLibrary, _candidates, _plan, _source_of, find_blas,
                          find_openblas)

__all__ = [
    "BlasLibrary",
    "find_blas",
    "find_openblas",
    "openblas_preloaded",
    "preloaded_openblas_path",
    "preload_env",
    "blas_hint",
    "warn_if_slow_blas",
    "SlowBlasWarning",
    "describe",
    "reexec_with_openblas",
    "measure_matmul_gflops",
    "blas_info",
    "REEXEC_GUARD_ENV",
    "DEFAULT_NUM_THREADS",
    "OPENBLAS_PATH_ENV",
]

#: Set in the environment of a re-executed process so it never re-executes again.
REEXEC_GUARD_ENV = "VELOXQUANT_BLAS_REEXEC"
#: OpenBLAS threads when ``$OPENBLAS_NUM_THREADS`` is not set (see the module docstring).
DEFAULT_NUM_THREADS = 1
# Other libraries that also count as "an optimized BLAS is preloaded".


def _link_dir(links: Sequence[Tuple[str, str]]) -> str:
    """A directory holding symlinks ``soname -> file`` (made once, reused, race-free)."""
    key = hashlib.sha1(repr(sorted(links)).encode()).hexdigest()[:12]
    roots = [os.path.expanduser(os.environ.get("VELOXQUANT_CACHE_DIR") or "~/.cache/veloxquant_mlx"),
             os.path.join(tempfile.gettempdir(), f"veloxquant_mlx-{os.getuid()}")]
    last_error: Optional[OSError] = None
    for root in roots:
        directory = os.path.join(root, f"blas-links-{key}")
        try:
            os.makedirs(directory, exist_ok=True)
            for name, target in links:
                link = os.path.join(directory, name)
                if os.path.realpath(link) == os.path.realpath(target):
                    continue
                tmp = f"{link}.{os.getpid()}.tmp"
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                os.symlink(target, tmp)
                os.replace(tmp, link)
            return directory
        except OSError as e:
            last_error = e
    raise OSError(f"cannot create a folder for the BLAS symlinks: {last_error}")


def _coretype() -> Optional[str]:
    """An ``OPENBLAS_CORETYPE`` from the CPU's flags (x86_64), or None.

    A DYNAMIC_ARCH OpenBLAS picks its kernels from the CPU model; a model it does not know gets
    generic kernels: Debian 12's 0.3.21 chose "Prescott" (SSE3) on a virtualized Xeon with AVX-512,
    10-15 GFLOP/s instead of 60. The CPU's feature flags name the right kernel family. (Builds for
    one target, like cmeel-openblas's, ignore the variable.)"""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo", "r") as fh:
            for line in fh:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
            else:
                return None
    except OSError:
        return None
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def preload_env(lib: BlasLibrary, num_threads: Optional[int] = None,
                base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) that preloads ``lib`` in a new process."""
    env = dict(os.environ if base is None else base)
    previous = [p for p in env.get("LD_PRELOAD", "").replace(":", " ").split() if p]
    env["LD_PRELOAD"] = ":".join([*lib.deps, lib.path, *previous])
    if lib.links:
        dirs = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
        env["LD_LIBRARY_PATH"] = ":".join([_link_dir(lib.links), *dirs])
    coretype = _coretype()
    if coretype and "OPENBLAS_CORETYPE" not in env and not lib.source.startswith(_PIP_SOURCE):
        env["OPENBLAS_CORETYPE"] = coretype
    if num_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(int(num_threads))
    elif "OPENBLAS_NUM_THREADS" not in env:
        env["OPENBLAS_NUM_THREADS"] = str(DEFAULT_NUM_THREADS)
    return env


_PROBE = """
import ctypes, sys
if sys.argv[1] not in open("/proc/self/maps").read():
    sys.exit(3)  # the preload did not take
n = 96
a = (ctypes.c_float * (n * n))(*([0.5] * (n * n)))
c = (ctypes.c_float * (n * n))()
lib = ctypes.CDLL(sys.argv[1])  # the preloaded copy
lib.cblas_sgemm(101, 111, 111, n, n, n, ctypes.c_float(1.0), a, n, a, n, ctypes.c_float(0.0), c, n)
sys.exit(0 if abs(c[0] - 0.25 * n) < 1e-3 and abs(c[n * n - 1] - 0.25 * n) < 1e-3 else 4)
"""


def _probe(lib: BlasLibrary, env: Dict[str, str]) -> bool:
    """Does a process started with ``env`` come up with ``lib`` mapped, and does its ``cblas_sgemm``
    run and compute right? (~50 ms.) The latter catches builds for a newer CPU: cmeel-openblas's
    x86_64 wheel is built for SKYLAKEX only (AVX-512, no DYNAMIC_ARCH) and dies of SIGILL elsewhere."""
    try:
        done = subprocess.run([sys.executable, "-S", "-c", _PROBE, os.path.realpath(lib.path)], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0 and b"ld.so" not in done.stderr


def _working_env(num_threads: Optional[int]) -> Optional[Tuple[BlasLibrary, Dict[str, str]]]:
    """The first candidate whose preload starts a process and runs sgemm, with its environment."""
    for path, source in _candidates():
        first = _plan(path, source)
        tried = []
        for lib in (first, _plan(path, source, not source.startswith(_PIP_SOURCE))):
            if lib is None or lib in tried:
                continue
            tried.append(lib)
            try:
                env = preload_env(lib, num_threads)
            except OSError:
                continue
            if _probe(lib, env):
                return lib, env
    return None


def openblas_preloaded() -> bool:
    """True when OpenBLAS is in ``LD_PRELOAD`` and actually mapped in this process.

    A library that is merely loaded later (e.g. NumPy's own ``scipy_openblas``)
    does not count: only a preloaded one overrides MLX's bundled BLAS.
    """
    return _preloaded(("libopenblas",))


def preloaded_openblas_path() -> Optional[str]:
    """Path of the preloaded OpenBLAS mapped in this process, or None."""
    if not openblas_preloaded():
        return None
    for entry in _preload_entries():
        if "libopenblas" in os.path.basename(entry):
            return entry
    return None  # pragma: no cover


def _threads() -> str:
    n = os.environ.get("OPENBLAS_NUM_THREADS")
    return "OpenBLAS's default threads (one per core)" if not n else f"{n} thread" + ("" if n == "1" else "s")


def describe() -> str:
    """One line naming the BLAS this process's MLX CPU matmuls use."""
    if not sys.platform.startswith("linux"):
        return "Accelerate / Metal (macOS): nothing to do"
    path = preloaded_openblas_path()
    if path:
        return f"OpenBLAS from {_source_of(path)} ({path}), {_threads()}"
    if _preloaded(_OPTIMIZED_BLAS_MARKERS):
        return "an optimized BLAS from LD_PRELOAD (" + os.environ.get("LD_PRELOAD", "") + ")"
    return "MLX's bundled reference BLAS (slow)"


def blas_hint(tried: bool = False) -> Optional[str]:
    """One-line advice when MLX runs on a Linux CPU with its slow reference BLAS.

    Returns ``None`` when nothing can be improved (not Linux, MLX on a GPU, an
    optimized BLAS already preloaded). ``tried``: a re-exec was just refused (no library passed
    the preload check), so an installed library is named as not usable here.
    """
    if not sys.platform.startswith("linux") or not _mlx_on_cpu():
        return None
    if _preloaded(_OPTIMIZED_BLAS_MARKERS):
        return None
    launcher = "re-run with --fast-blas (or `python -m veloxquant_mlx.platform.blas <script> ...`)"
    lib = find_blas()
    if lib and tried:
        return (f"MLX is using its slow reference CPU BLAS; OpenBLAS from {lib.source} ({lib.path}) failed "
                "the preload check on this machine (cmeel-openblas's x86_64 build needs AVX-512): "
                f"`apt-get install libopenblas0-pthread` and {launcher} for ~30x faster fp32 matmul")
    if lib:
        return (f"MLX is using its slow reference CPU BLAS; OpenBLAS from {lib.source} is installed "
                f"({lib.path}): {launcher} for ~30x faster fp32 matmul")
    return ("MLX is using its slow reference CPU BLAS (~30x slower fp32 matmul): "
            "`pip install cmeel-openblas` (the `fast-cpu` extra; or `apt-get install libopenblas0-pthread`) "
            f"and {launcher}")


def _default_argv() -> List[str]:
    orig = getattr(sys, "orig_argv", None)
    if orig:
        return list(orig[1:])  # keeps "-m pkg.module" intact, unlike sys.argv
    return list(sys.argv)


def reexec_with_openblas(
    argv: Optional[Sequence[str]] = None,
    *,
    library: Optional[str] = None,
    num_threads: Optional[int] = None,
    quiet: bool = False,
) -> bool:
    """Re-execute this Python process with OpenBLAS in ``LD_PRELOAD``.

    ``argv`` is the argument list for the interpreter (without the executable);
    by default the current command line (``sys.orig_argv[1:]``), so both
    ``python script.py ...`` and ``python -m pkg ...`` restart unchanged.
    ``library`` forces a ``libopenblas`` path (its runtime dependencies are still resolved);
    ``num_threads`` defaults to ``$OPENBLAS_NUM_THREADS``, else :data:`DEFAULT_NUM_THREADS`.
    Unless ``quiet``, one line on stderr names the library used.

    On success this call does not return (``os.execve``).  It returns ``False``
    without doing anything when OpenBLAS is already preloaded, when no OpenBLAS
    library is found or none preloads cleanly (checked in a child process first), on
    non-Linux platforms, or when this process was itself started by a re-exec
    (``$VELOXQUANT_BLAS_REEXEC`` is set) -- the latter guarantees there is never a
    re-exec loop even if the preload failed.
    """
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get(REEXEC_GUARD_ENV) or openblas_preloaded():
        return False
    if library is not None:
        if not os.path.isfile(library):
            return False
        saved = os.environ.get(OPENBLAS_PATH_ENV)
        os.environ[OPENBLAS_PATH_ENV] = library
        try:
            found = _working_env(num_threads)
        finally:
            if saved is None:
                os.environ.pop(OPENBLAS_PATH_ENV, None)
            else:
                os.environ[OPENBLAS_PATH_ENV] = saved
    else:
        found = _working_env(num_threads)
    if found is None:
        return False
    lib, env = found
    env[REEXEC_GUARD_ENV] = "1"
    args = list(_default_argv() if argv is None else argv)
    if not quiet:
        n = env["OPENBLAS_NUM_THREADS"]
        print(f"fast-blas: using OpenBLAS from {lib.source} ({lib.path}), {n} thread{'' if n == '1' else 's'}"
              + (f"; libgfortran from {os.path.dirname(lib.deps[0])}" if lib.deps else ""), file=sys.stderr)
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
    lib = find_blas()
    info = {
        "blas": describe(),
        "openblas_path": lib.path if lib else None,
        "openblas_source": lib.source if lib else None,
        "openblas_preloaded": openblas_preloaded(),
        "openblas_num_threads": os.environ.get("OPENBLAS_NUM_THREADS"),
        "ld_preload": os.environ.get("LD_PRELOAD", ""),
    }
    if measure:
        info["matmul_gflops_1024_fp32"] = measure_matmul_gflops(1024)
    return info


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m veloxquant_mlx.platform.blas [script.py | -m module] [args...]``

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
            print(f"veloxquant_mlx.platform.blas: {hint}", file=sys.stderr)
    # Already preloaded (or impossible): run the command in a fresh interpreter
    # image anyway so behaviour is identical either way.
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, [sys.executable, *args])
    return 0  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
