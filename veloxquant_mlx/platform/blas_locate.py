"""Where an OpenBLAS for MLX lives on this machine, and what it needs to be preloaded.

Candidates, best first: ``$VELOXQUANT_OPENBLAS``, pip's ``cmeel-openblas``, the system's library. For
each, the ELF dependencies are read (``DT_NEEDED``) and any that the system cannot resolve are taken
from a wheel-bundled copy (``mlx_cpu.libs``, ...), see :mod:`veloxquant_mlx.platform.blas`.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import platform
import struct
import sys
from typing import List, Optional, Tuple

#: Explicit path override for the OpenBLAS shared library.
OPENBLAS_PATH_ENV = "VELOXQUANT_OPENBLAS"

_LIB = "libopenblas.so.0"
_PIP_SOURCE = "cmeel-openblas"
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
