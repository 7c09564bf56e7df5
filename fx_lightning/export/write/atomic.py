"""Atomic directory writing: build in a temporary sibling, then rename into place.

An export appears complete or not at all; an existing one is replaced only by a complete one, and restored
if the rename fails. Directories created on the way are removed again on failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, List, Optional, Sequence, Tuple

from fx_lightning.errors import ExportError

__all__ = ["staging_directory", "replace_directories", "list_files"]


@contextlib.contextmanager
def staging_directory(final: Path) -> Iterator[Path]:
    """A fresh temporary sibling of ``final`` to write into; renamed to ``final`` when the block succeeds,
    removed (with any parents created for it) when it raises."""
    parent = final.parent
    created = _make_parents(parent)
    staging = parent / f".{final.name}.tmp-{uuid.uuid4().hex[:10]}"
    try:
        os.mkdir(staging)
    except OSError as exc:
        _remove_empty(created)
        raise ExportError(f"{parent}: cannot write the export there: {exc.strerror or exc}.") from exc
    try:
        yield staging
        replace_directories([(staging, final)])
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        _remove_empty(created)
        raise


def replace_directories(pairs: Sequence[Tuple[Path, Path]]) -> None:
    """Rename each staged directory onto its final place, all or none: an existing one is moved aside first, and
    if any rename fails every final place done so far gets its old content back (the staged ones are left for the
    caller to remove)."""
    done: List[Tuple[Path, Path, Optional[Path]]] = []
    try:
        for staging, final in pairs:
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:10]}" if final.exists() else None
            if old is not None:
                os.rename(final, old)
            done.append((staging, final, old))
            os.rename(staging, final)
    except BaseException:
        for staging, final, old in reversed(done):
            if final.exists() and not staging.exists():
                os.rename(final, staging)
            if old is not None:
                os.rename(old, final)
        raise
    for _, _, old in done:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _make_parents(parent: Path) -> List[Path]:
    """Create ``parent`` and missing ancestors; return those created (deepest last) for clean-up."""
    missing: List[Path] = []
    p = parent
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise ExportError(f"{parent}: cannot create the export directory: {p} is a file, not a directory.")
    created: List[Path] = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        except OSError as exc:
            _remove_empty(created)
            raise ExportError(f"{parent}: cannot create the export directory: {exc.strerror or exc}.") from exc
        created.append(d)
    return created


def _remove_empty(created: List[Path]) -> None:
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


def list_files(root: Path) -> List[str]:
    """Every file under ``root`` as a relative posix path, sorted (``__pycache__`` left out)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()
                  and "__pycache__" not in p.parts)
