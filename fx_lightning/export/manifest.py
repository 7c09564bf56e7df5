"""``manifest.json`` and the export's ``README.md``: what an export holds, how to load it, and each file's
size and sha256; reading and checking them back."""

from __future__ import annotations

import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from fx_lightning._json import dtype_name, json_safe
from fx_lightning._version import __version__
from fx_lightning.batches import batch_size_of, flat_tensors
from fx_lightning.errors import ExportError
from fx_lightning.export.base import WriteContext
from fx_lightning.export.formats import FORMATS

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "build_manifest",
    "write_manifest",
    "replace_manifest",
    "read_manifest",
    "verify_files",
    "sha256_file",
    "readme_text",
]

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


def sha256_file(path: Any) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(
    ctx: WriteContext,
    entries: Dict[str, Dict[str, Any]],
    files: Dict[str, Dict[str, Any]],
    metadata: Dict[str, Any],
) -> Dict[str, Any]:
    """The manifest of an export: versions, inputs and outputs, formats, files, and the caller's
    ``metadata`` (config, report, parity, extra), made JSON-safe."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": _versions(entries),
        "config": metadata.get("config"),
        "report": metadata.get("report"),
        "parity": metadata.get("parity"),
        "inputs": _input_specs(ctx),
        "outputs": _output_specs(ctx),
        "dynamic_batch": ctx.dynamic_shapes is not None,
        "formats": entries,
        "files": files,
        "notes": ctx.notes,
        "extra": metadata.get("extra") or {},
    }
    return json_safe(manifest)


def write_manifest(root: Path, manifest: Dict[str, Any], name: str = MANIFEST_NAME) -> None:
    text = json.dumps(manifest, indent=2, allow_nan=False, sort_keys=False)
    (root / name).write_text(text + "\n", encoding="utf-8")


def replace_manifest(root: Path, manifest: Dict[str, Any]) -> None:
    """Rewrite the manifest of a finished export atomically (a reader sees the old one or the new one)."""
    staging = f".{MANIFEST_NAME}.tmp"
    write_manifest(Path(root), manifest, staging)
    os.replace(Path(root) / staging, Path(root) / MANIFEST_NAME)


def read_manifest(directory: Any) -> Dict[str, Any]:
    """The manifest of an export directory, checked for a supported ``format_version``."""
    root = Path(directory)
    path = root / MANIFEST_NAME
    if not root.is_dir():
        raise ExportError(f"{root}: no such export directory.")
    if not path.is_file():
        raise ExportError(
            f"{path}: missing; {root} is not an fx-lightning export (or an incomplete one; exports are "
            "written atomically, so look for the error of the run that wrote it)."
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{path}: unreadable or corrupt manifest: {exc}") from None
    if not isinstance(manifest, dict):
        raise ExportError(f"{path}: corrupt manifest: expected a JSON object, got {type(manifest).__name__}.")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ExportError(
            f"{path}: unknown manifest format_version {version!r}; this fx_lightning "
            f"({__version__}) reads format_version {FORMAT_VERSION}. "
            + ("Upgrade fx-lightning to load it." if isinstance(version, int) and version > FORMAT_VERSION
               else "The file was not written by fx-lightning or is damaged.")
        )
    for key in ("formats", "files"):
        if not isinstance(manifest.get(key), dict):
            raise ExportError(f"{path}: corrupt manifest: '{key}' is missing or not an object.")
    return manifest


def verify_files(root: Path, manifest: Dict[str, Any], fmt: Optional[str] = None) -> None:
    """Check size and sha256 of the manifest's files (those of ``fmt`` only, when given)."""
    files: Dict[str, Any] = manifest["files"]
    names = sorted(files) if fmt is None else manifest["formats"][fmt].get("files", [])
    if not names:
        raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no files listed for format {fmt!r}.")
    for name in names:
        info = files.get(name)
        path = root / name
        if not isinstance(info, dict):
            raise ExportError(f"{root / MANIFEST_NAME}: corrupt manifest: no size/sha256 entry for {name!r}.")
        if not path.is_file():
            raise ExportError(f"{path}: missing file of format {fmt or 'export'!r} (listed in the manifest).")
        size = path.stat().st_size
        if size != info.get("size"):
            raise ExportError(
                f"{path}: corrupt file: size {size} bytes, the manifest says {info.get('size')} bytes."
            )
        digest = sha256_file(path)
        if digest != info.get("sha256"):
            raise ExportError(
                f"{path}: corrupt file: sha256 {digest[:16]}... does not match the manifest's "
                f"{str(info.get('sha256'))[:16]}...; re-export rather than load it."
            )


def readme_text(entries: Dict[str, Dict[str, Any]]) -> str:
    """The export's README.md: how to load each written format, with and without fx-lightning."""
    lines = [
        "# Fused model exported by fx-lightning",
        "",
        "`manifest.json` lists the formats, the inputs (dim 0 is the batch, any size when `dynamic_batch`),",
        "the fuse report, the parity verdict and each file's sha256. With fx-lightning installed:",
        "",
        "    from fx_lightning import load_fused",
        "    model = load_fused('this/directory')          # checks sha256",
        "",
        "Without it, with torch only:",
        "",
    ]
    for name, entry in entries.items():
        lines.append(FORMATS[name].readme_text(entry))
    return "\n".join(lines) + "\n"


def _input_specs(ctx: WriteContext) -> List[Dict[str, Any]]:
    specs = []
    for i, (name, a) in enumerate(zip(ctx.input_names, ctx.args)):
        if isinstance(a, torch.Tensor):
            dyn = ctx.dynamic_shapes is not None and ctx.dynamic_shapes[i] is not None
            shape: List[Any] = list(a.shape)
            if dyn:
                shape[0] = "batch"
            specs.append({"name": name, "kind": "tensor", "shape": shape, "dtype": dtype_name(a.dtype),
                          "example_shape": list(a.shape), "device": str(a.device)})
        else:
            specs.append({"name": name, "kind": type(a).__name__, "value": repr(a)[:200]})
    return specs


def _output_specs(ctx: WriteContext) -> List[Dict[str, Any]]:
    with torch.no_grad():
        outs = flat_tensors(ctx.model(*ctx.args))
    batch = batch_size_of(ctx.args)
    specs = []
    for i, t in enumerate(outs):
        shape: List[Any] = list(t.shape)
        if ctx.dynamic_shapes is not None and shape and shape[0] == batch:
            shape[0] = "batch"
        specs.append({"name": f"output_{i}", "shape": shape, "dtype": dtype_name(t.dtype)})
    return specs


def _versions(entries: Sequence[str]) -> Dict[str, Optional[str]]:
    out: Dict[str, Optional[str]] = {
        "format_version": str(FORMAT_VERSION),
        "fx_lightning": __version__,
        "torch": torch.__version__,
        "lightning": _dist_version("lightning"),
        "python": platform.python_version(),
    }
    for name in entries:
        fmt = FORMATS[name]
        for module in (*fmt.requires, *fmt.runtime_requires):
            out[module] = _dist_version(module)
    return out


def _dist_version(name: str) -> Optional[str]:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
