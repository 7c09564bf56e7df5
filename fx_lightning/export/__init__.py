"""Export: write a fused model in the configured formats plus ``manifest.json``, atomically; read it back.

Layout of an export directory::

    manifest.json          format version, versions, resolved config, fuse report, parity, inputs, files + sha256
    README.md              how to load each format without the training code
    model.pt2              pt2: torch.export ExportedProgram (torch.export.save; no pickled code)
    model.pt               graph_module: the fused GraphModule (torch.save; pickled code: weights_only=False)
    fused_module/          code: readable Python (module.py) + weights.pt, importable as a package
    model.onnx             onnx: ONNX with a dynamic batch axis (optional extra)

One module per concern: ``base`` (the :class:`Format` record), ``formats/`` (one module per format),
``atomic`` (writing a directory atomically), ``codegen`` (the ``code`` format's source), ``manifest``,
``writer`` (:func:`export_fused`) and ``loader`` (:func:`load_fused`). The names below are imported on first
use: the config schema reads ``formats`` without pulling in the writer.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FORMATS",
    "Format",
    "export_fused",
    "load_fused",
    "read_manifest",
    "Manifest",
    "load_artifact",
    "verify_files",
    "sha256_file",
    "bench_export",
    "select_fastest",
    "record_selection",
]

_HOMES = {
    "FORMAT_VERSION": "manifest",
    "MANIFEST_NAME": "manifest",
    "read_manifest": "manifest",
    "Manifest": "manifest",
    "load_artifact": "loader",
    "verify_files": "manifest",
    "sha256_file": "manifest",
    "FORMATS": "formats",
    "Format": "base",
    "export_fused": "writer",
    "load_fused": "loader",
    "bench_export": "selection",
    "select_fastest": "selection",
    "record_selection": "selection",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
