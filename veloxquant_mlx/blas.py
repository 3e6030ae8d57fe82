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

    python -m veloxquant_mlx.blas your_script.py --args
    python -m veloxquant_mlx.blas -m some.module --args
    python -m veloxquant_mlx.blas              # status and a 1024x1024 fp32 matmul benchmark

The default is one OpenBLAS thread (``$OPENBLAS_NUM_THREADS`` set by the user wins): on the
bundled model two threads were not faster on a 2-core machine (see README, "CPU BLAS").
Nothing here does anything on macOS (MLX uses Accelerate / Metal there).
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = [
    "BlasLibrary",
    "find_blas",
    "find_openblas",
    "openblas_preloaded",
    "preloaded_openblas_path",
    "preload_env",
    "blas_hint",
    "describe",
    "reexec_with_openblas",
    "measure_matmul_gflops",
    "blas_info",
    "REEXEC_GUARD_ENV",
    "DEFAULT_NUM_THREADS",
]

#: Set in the environment of a re-executed process so it never re-executes again.
REEXEC_GUARD_ENV = "VELOXQUANT_BLAS_REEXEC"
#: Explicit path override for the OpenBLAS shared library.
OPENBLAS_PATH_ENV = "VELOXQUANT_OPENBLAS"
#: OpenBLAS threads when ``$OPENBLAS_NUM_THREADS`` is not set (see the module docstring).
DEFAULT_NUM_THREADS = 1

_LIB = "libopenblas.so.0"
_PIP_SOURCE = "cmeel-openblas"
# Other libraries that also count as "an optimized BLAS is preloaded".
_OPTIMIZED_BLAS_MARKERS = ("libopenblas", "libmkl_rt", "libblis")
# Wheel-bundled library folders (auditwheel's "<dist>.libs") searched for runtime dependencies,
# best first: mlx-cpu is always installed next to MLX on Linux.
_BUNDLED_LIB_DIRS = ("mlx_cpu.libs", "numpy.libs", "scipy.libs")


@dataclasses.dataclass(frozen=True)
class BlasLibrary:
    """An OpenBLAS that can be preloaded, and what it takes to preload it."""

    path: str  #: the ``libopenblas.so.0`` to preload
    source: str  #: where it comes from: ``"cmeel-openblas"``, ``"system ..."``, ``"... via $VELOXQUANT_OPENBLAS"``
    #: wheel-bundled runtime dependencies preloaded (by full path) before ``path``
    deps: Tuple[str, ...] = ()
    #: soname -> file: symlinks made so that ``path``'s DT_NEEDED entries resolve to ``deps``
    links: Tuple[Tuple[str, str], ...] = ()


# -- where libraries live -------------------------------------------------------------------------
def _triples() -> List[str]:
    machine = platform.machine().lower()
    return {
        "x86_64": ["x86_64-linux-gnu"],
        "amd64": ["x86_64-linux-gnu"],
        "aarch64": ["aarch64-linux-gnu"],
        "arm64": ["aarch64-linux-gnu"],
        "ppc64le": ["powerpc64le-linux-gnu"],
        "s390x": ["s390x-linux-gnu"],
        "riscv64": ["riscv64-linux-gnu"],
    }.get(machine, [])


def _multiarch_dirs() -> List[str]:
    dirs = []
    for triple in _triples():
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


def _site_dirs() -> List[str]:
    """site-packages folders of this interpreter (venv first), without duplicates."""
    import site

    dirs: List[str] = []
    try:
        dirs += list(site.getsitepackages())
    except Exception:  # pragma: no cover - some embedded interpreters lack it
        pass
    try:
        dirs.append(site.getusersitepackages())
    except Exception:  # pragma: no cover
        pass
    dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    seen, out = set(), []
    for d in dirs:
        real = os.path.realpath(d)
        if real not in seen and os.path.isdir(real):
            seen.add(real)
            out.append(d)
    return out


def _pip_openblas() -> List[str]:
    return [c for d in _site_dirs() for c in [os.path.join(d, "cmeel.prefix", "lib", _LIB)]
            if os.path.isfile(c)]


def _system_openblas() -> List[str]:
    found = []
    for directory in _multiarch_dirs():
        candidate = os.path.join(directory, _LIB)
        if os.path.isfile(candidate):
            found.append(candidate)
    if not found:  # a versioned file without the .so.0 alias
        for directory in _multiarch_dirs():
            hits = sorted(glob.glob(os.path.join(directory, "libopenblas*.so*")))
            found += [h for h in hits if "64_" not in os.path.basename(h)]  # ILP64 symbols don't interpose
    return found


def _source_of(path: str) -> str:
    if os.sep + "cmeel.prefix" + os.sep in path:
        return _PIP_SOURCE
    if "openblas-pthread" in path:
        return "system (Debian libopenblas0-pthread)"
    return "system"


# -- ELF: which libraries does a shared object need? -------------------------------------------------
def _elf_needed(path: str) -> Optional[List[str]]:
    """DT_NEEDED entries of a 64-bit ELF shared object, or None if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            ident = fh.read(64)
            if len(ident) < 64 or ident[:4] != b"\x7fELF" or ident[4] != 2:  # ELFCLASS64 only
                return None
            end = "<" if ident[5] == 1 else ">"
            phoff, = struct.unpack_from(end + "Q", ident, 32)
            phentsize, phnum = struct.unpack_from(end + "HH", ident, 54)
            fh.seek(phoff)
            ph = fh.read(phentsize * phnum)
            loads, dynamic = [], None
            for i in range(phnum):
                p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from(
                    end + "IIQQQQ", ph, i * phentsize)
                if p_type == 1:  # PT_LOAD
                    loads.append((p_vaddr, p_offset, p_filesz))
                elif p_type == 2:  # PT_DYNAMIC
                    dynamic = (p_offset, p_filesz)
            if dynamic is None:
                return []
            fh.seek(dynamic[0])
            raw = fh.read(dynamic[1])
            needed, strtab, strsz = [], None, 0
            for off in range(0, len(raw) - 15, 16):
                tag, val = struct.unpack_from(end + "qQ", raw, off)
                if tag == 0:  # DT_NULL
                    break
                if tag == 1:  # DT_NEEDED
                    needed.append(val)
                elif tag == 5:  # DT_STRTAB (a virtual address)
                    strtab = val
                elif tag == 10:  # DT_STRSZ
                    strsz = val
            if strtab is None:
                return None
            for vaddr, offset, filesz in loads:
                if vaddr <= strtab < vaddr + filesz:
                    fh.seek(offset + strtab - vaddr)
                    table = fh.read(strsz)
                    break
            else:
                return None
            return [table[i:table.index(b"\0", i)].decode() for i in needed]
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return None


def _system_resolves(soname: str) -> bool:
    """Would the dynamic loader find ``soname`` without help (LD_LIBRARY_PATH, ld.so.cache, dirs)?"""
    # (not our own symlink folders: a re-executed process must still plan the same preload)
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":")
            if d and not os.path.basename(d.rstrip("/")).startswith("blas-links-")]
    dirs += [f"/lib/{t}" for t in _triples()] + [f"/usr/lib/{t}" for t in _triples()]
    dirs += ["/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib"]
    if any(os.path.exists(os.path.join(d, soname)) for d in dirs):
        return True
    try:
        with open("/etc/ld.so.cache", "rb") as fh:
            return (b"/" + soname.encode() + b"\0") in fh.read()
    except OSError:
        return False


def _bundled_copy(soname: str) -> Optional[str]:
    """A wheel-bundled copy of ``soname`` (``libgfortran.so.5`` -> ``.../libgfortran-<hash>.so.5*``)."""
    stem, _, version = soname.partition(".so")
    major = version.lstrip(".").split(".")[0]
    for site_dir in _site_dirs():
        for libs in _BUNDLED_LIB_DIRS + ("*.libs",):
            pattern = os.path.join(site_dir, libs, f"{stem}-*.so" + (f".{major}*" if major else "*"))
            hits = sorted(glob.glob(pattern))
            if hits:
                return os.path.realpath(hits[0])
    return None


def _plan(path: str, source: str, bundled_first: Optional[bool] = None) -> Optional[BlasLibrary]:
    """How to preload ``path``: None if a dependency is missing and no bundled copy exists.

    A pip library takes its missing runtime dependencies from the wheels next to it first (the
    environment then stands alone: removing the distro's libgfortran later cannot break it), a
    system library from the system first; ``bundled_first`` overrides that order."""
    if bundled_first is None:
        bundled_first = source.startswith(_PIP_SOURCE)
    deps, links = [], []
    for soname in _elf_needed(path) or []:
        if soname.startswith(("libc.", "libm.", "libpthread.", "libdl.", "librt.", "ld-linux",
                              "libgcc_s.")):
            continue  # always there
        if not bundled_first and _system_resolves(soname):
            continue
        copy = _bundled_copy(soname)
        if copy is None:
            if _system_resolves(soname):
                continue
            return None
        deps.append(copy)
        links.append((soname, copy))
    return BlasLibrary(path=path, source=source, deps=tuple(deps), links=tuple(links))


def _candidates() -> List[Tuple[str, str]]:
    override = os.environ.get(OPENBLAS_PATH_ENV)
    if override:
        return [(override, f"{_source_of(override)} via ${OPENBLAS_PATH_ENV}")] if os.path.isfile(override) else []
    if not sys.platform.startswith("linux"):
        return []
    return [(p, _source_of(p)) for p in _pip_openblas() + _system_openblas()]


def find_blas() -> Optional[BlasLibrary]:
    """The OpenBLAS to preload (pip's ``cmeel-openblas`` first, then the system's), or None.

    ``$VELOXQUANT_OPENBLAS`` overrides the search. Only Linux is searched (macOS MLX uses
    Accelerate and needs nothing). This does not check that the preload works: see
    :func:`reexec_with_openblas`.
    """
    for path, source in _candidates():
        plan = _plan(path, source)
        if plan is not None:
            return plan
    return None


def find_openblas() -> Optional[str]:
    """Path of the ``libopenblas.so.0`` :func:`find_blas` would preload, or None."""
    lib = find_blas()
    return lib.path if lib else None


# -- the environment of a preloaded process ----------------------------------------------------------
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


# -- what this process runs on ------------------------------------------------------------------------
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


def _mlx_on_cpu() -> bool:
    try:
        import mlx.core as mx

        return mx.default_device() == mx.cpu
    except Exception:  # pragma: no cover - mlx missing/broken
        return True


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
    launcher = "re-run with --fast-blas (or `python -m veloxquant_mlx.blas <script> ...`)"
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


# -- re-exec --------------------------------------------------------------------------------------------
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


# -- measuring ------------------------------------------------------------------------------------------
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
