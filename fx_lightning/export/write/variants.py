"""Serving variants of an export: lossy models (int8, bf16) written beside the exact artifacts, in a subfolder
named after the variant, and kept only when the artifact itself, loaded back, passes the caller's gate: the caller
(:func:`fx_lightning.pipeline.export_step.add_variants`) makes each artifact (:func:`make_artifact`), gates it and
records the outcome (:func:`record_artifact`), data flowing down by return values.

A variant (:mod:`fx_lightning.variants`) comes from one of two places. The torch formats (pt2, aoti) write the
model the variant made from the fused graph (int8: torchao's; bf16): :func:`variant_makers`. Other formats make it
from their own fp32 artifact (OpenVINO int8 through NNCF and bf16 through its precision hint, ONNX Runtime int8):
:func:`format_variant_makers`, from each :class:`~fx_lightning.formats.base.Format`'s ``variants``. Either way the
entry is named ``<format>-<variant>`` (``aoti-int8``, ``openvino-int8``), says which format loads it, and carries
its gate report instead of a round-trip check (a lossy model is not expected to match the fp32 one). A variant
the CPU cannot run fast is recorded as skipped, with the reason (:func:`skip_variant`). Variants are written into
the export's staging directory, before the export is renamed into place.
"""

from __future__ import annotations

import dataclasses
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import FuseConfig
from fx_lightning.errors import first_line
from fx_lightning.export.write.atomic import list_files
from fx_lightning.formats.base import Format, FormatEntry, VariantRequest
from fx_lightning.formats.batching import quiet_pieces, with_pieces
from fx_lightning.formats import FORMATS
from fx_lightning.export.files import file_infos
from fx_lightning.export.manifest import Manifest, Preprocess, VariantOutcome
from fx_lightning.export.write.writer import make_context, require_formats
from fx_lightning.common.notes import Note
from fx_lightning.parity.report import ParityReport
from fx_lightning.signature.signature import Signature

__all__ = ["Maker", "VariantArtifact", "variant_makers", "format_variant_makers", "make_artifact", "record_artifact",
           "finish_variant", "skip_variant", "torch_variant_formats"]

Maker = Tuple[Format, Callable[[], Optional[FormatEntry]]]  # a format and how it writes the variant's artifact


@dataclass
class VariantArtifact:
    """One artifact of a variant, written into the staging directory and loaded back for the caller to gate (with
    pieces for the batch sizes it was not built for), or the error that stopped it; ``files``: what it added."""

    entry_name: str
    entry: Optional[FormatEntry]
    files: List[str]
    loaded: Optional[nn.Module] = None
    error: Optional[str] = None


def torch_variant_formats(config: FuseConfig, precision: str) -> List[str]:
    """The configured formats a variant's own model is written in (``Format.writes_variants``: pt2, aoti); pt2
    when none is configured and no configured format makes the variant itself."""
    wanted = [f.value for f in config.export.formats if FORMATS[f.value].writes_variants]
    if wanted or any(precision in FORMATS[f.value].variants for f in config.export.formats):
        return wanted
    return ["pt2"]


def variant_makers(root: Path, name: str, module: nn.Module, example_inputs: tuple, config: FuseConfig,
                   imports: Sequence[str] = (), preprocess: Optional[Preprocess] = None,
                   normalised_dtype: torch.dtype = torch.float32, signature: Optional[Signature] = None,
                   other_inputs: Sequence[tuple] = (), fixed: Optional[str] = None) -> List[Maker]:
    """How ``module`` is written as variant ``name`` in :func:`torch_variant_formats`. ``imports``: modules a
    process must import to load the variant (the ones that register its ops); ``preprocess``: the raw-input prologue
    the fp32 artifacts have, spliced in front of ``module`` too (``example_inputs`` are then raw inputs;
    ``normalised_dtype``: the dtype ``module`` takes its input in); ``signature``, ``other_inputs`` and ``fixed``:
    how the fp32 model is called, examples of its other sizes, and why it is fixed to the example's (the variant is
    made dynamic where it is)."""
    formats = [FORMATS[f] for f in torch_variant_formats(config, name)]
    require_formats(formats)
    ctx = make_context(module, example_inputs, config, preprocess=preprocess, normalised_dtype=normalised_dtype,
                       signature=signature, other_inputs=other_inputs, fixed=fixed)

    def write(fmt: Format) -> FormatEntry:
        entry = fmt.write(root / name, ctx)
        entry.path = f"{name}/{entry.path}"
        entry.imports = list(imports)
        entry.device = entry.device or str(ctx.device)
        sizes, entry.built_shapes = ctx.built_for(fmt)
        entry.batch_sizes = entry.batch_sizes or sizes
        return entry

    return [(fmt, lambda fmt=fmt: write(fmt)) for fmt in formats]


def format_variant_makers(root: Path, manifest: Manifest, precision: str, calibration: List[tuple]) -> List[Maker]:
    """How each exported fp32 format that makes a ``precision`` variant from its own artifact makes it, from the
    calibration inputs."""
    request = VariantRequest(precision, precision, calibration)
    makers: List[Maker] = []
    for name, entry in manifest.formats.items():
        fmt = FORMATS[entry.format_name or name]
        make = fmt.variants.get(precision)
        if entry.variant is None and make is not None:
            makers.append((fmt, lambda make=make, entry=entry: make(root, entry, request)))
    return makers


def make_artifact(root: Path, manifest: Manifest, name: str, maker: Maker) -> Optional[VariantArtifact]:
    """Write one artifact of variant ``name`` and load it back; None when the format makes none for this export.
    An artifact that cannot be written or loaded comes back with its error, its files removed."""
    fmt, make = maker
    entry_name, before = f"{fmt.name}-{name}", set(list_files(root))
    (root / name).mkdir(exist_ok=True)
    try:
        entry = make()
        if entry is None:
            return None
        made = sorted(set(list_files(root)) - before)
        entry.format, entry.variant = fmt.name, name
        entry.files = made or list(entry.files)  # none new: it runs the fp32 files another way (bf16 hint)
        loaded = fmt.load(root, entry, torch.device(entry.device or "cpu"))
        # The gate runs the validation batches' size, which the artifact need not be built for: our own run, so
        # its pieces are not the user's business (a debug line, not a warning).
        return VariantArtifact(entry_name, entry, made, quiet_pieces(
            with_pieces(loaded, entry.batch_sizes, manifest.call_signature(), f"{entry_name} artifact")))
    except Exception as exc:  # noqa: BLE001 - a variant that cannot be made is reported; the caller decides
        _remove(root, set(list_files(root)) - before, root / name)
        return VariantArtifact(entry_name, None, [], error=f"{type(exc).__name__}: {first_line(exc)}")


def record_artifact(root: Path, manifest: Manifest, name: str, artifact: VariantArtifact,
                    gate: Optional[ParityReport], error: Optional[str] = None,
                    notes: Sequence[Note] = ()) -> Manifest:
    """``manifest`` with the artifact's outcome recorded (``gate``: its report; ``error``: why it has none), and
    the artifact kept when it passed its gate; a dropped artifact's files are removed. ``notes``: how the variant
    was made."""
    error = error or artifact.error
    passed = gate is not None and gate.passed and error is None
    outcome = VariantOutcome(artifact.entry_name, passed, gate if error is None else None, error, notes=list(notes))
    formats, files = dict(manifest.formats), dict(manifest.files)
    if passed and artifact.entry is not None:
        artifact.entry.gate = gate
        formats[artifact.entry_name] = artifact.entry
        files.update(file_infos(root, artifact.entry.files))
    else:
        _remove(root, set(artifact.files), root / name)
    variants = {**manifest.variants, name: [*manifest.variants.get(name, []), outcome]}
    return dataclasses.replace(manifest, formats=formats, files=files, variants=variants)


def finish_variant(root: Path, name: str) -> None:
    """The variant's folder, and the folders in it, removed when none of its artifacts was kept."""
    folder = root / name
    if folder.is_dir() and folder != root:
        _remove(root, (), folder)
        if not any(folder.iterdir()):
            shutil.rmtree(folder, ignore_errors=True)


def skip_variant(manifest: Manifest, name: str, reason: str) -> Manifest:
    """``manifest`` recording that variant ``name`` was not made here, and why."""
    skipped = VariantOutcome(name, False, skipped=reason)
    return dataclasses.replace(manifest, variants={**manifest.variants, name: [skipped]})


def _remove(root: Path, names: Iterable[str], folder: Path) -> None:
    """Delete the files of an artifact that was dropped, and the folders inside the variant's ``folder`` they leave
    empty; ``folder`` itself stays until every artifact of the variant was made (the next one is written there)."""
    for rel in names:
        (root / rel).unlink(missing_ok=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(sub.iterdir()):
            sub.rmdir()

