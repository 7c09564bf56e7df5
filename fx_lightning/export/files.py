"""An export's files as the manifest records them: each one's size and sha256."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Sequence

__all__ = ["FileInfo", "sha256_file", "file_infos"]


def sha256_file(path: Any) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class FileInfo:
    size: int
    sha256: str


def file_infos(root: Path, names: Sequence[str]) -> Dict[str, FileInfo]:
    return {name: FileInfo((root / name).stat().st_size, sha256_file(root / name)) for name in names}
