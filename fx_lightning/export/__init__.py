"""Export: write a fused model in the configured formats plus ``manifest.json``, atomically; read it back.

Layout of an export directory::

    manifest.json          format version, versions, resolved config, fuse report, parity, the signature (how the
                           artifacts are called), inputs and outputs, files + sha256
    README.md              how to load each format without the training code
    check.pt               example inputs and the fp64 outputs every artifact is checked against
    model.pt2              pt2: torch.export ExportedProgram (torch.export.save; no pickled code)
    model.pt               graph_module: the fused GraphModule (torch.save; pickled code: weights_only=False)
    fused_module/          code: readable Python (module.py) + weights.pt, importable as a package
    model.onnx             onnx: ONNX with the dynamic axes the signature names (optional extra)

The formats themselves live in :mod:`fx_lightning.formats` (one module per format); here :mod:`.manifest`,
:mod:`.check`, and :mod:`.write`, :mod:`.load` and :mod:`.select`, whose own docstrings name their modules.
"""

from __future__ import annotations

from fx_lightning.export.load.loader import load_artifact, load_fused
from fx_lightning.export.files import sha256_file
from fx_lightning.export.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, read_manifest, verify_files
from fx_lightning.export.select.selection import bench_export, record_selection, select_fastest
from fx_lightning.export.write.writer import export_fused
from fx_lightning.formats import FORMATS
from fx_lightning.formats.base import Format

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
