"""Serving variants of an export: lossy models (int8) written beside the exact artifacts, in a subfolder
named after the variant, and kept only when the artifact itself, loaded back, passes the caller's gate.

A variant's manifest entry is named ``<format>-<variant>`` (``aoti-int8``) and says which format it is; its gate
report replaces the round-trip check (a lossy model is not expected to match the fp32 one). Variants are written
into the export's staging directory, before the export is renamed into place.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Callable, List, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.config import FuseConfig
from fx_lightning.errors import first_line
from fx_lightning.export.atomic import list_files
from fx_lightning.export.formats import FORMATS
from fx_lightning.export.manifest import Manifest, VariantOutcome, file_infos
from fx_lightning.export.writer import make_context, require_formats
from fx_lightning.parity.report import ParityReport

__all__ = ["VARIANT_FORMATS", "Gate", "add_variant"]

# The formats a variant is written in: those that run it through Inductor (a quantised graph run eagerly is
# slow). pt2 also serves load_fused(dir, compile=True).
VARIANT_FORMATS = ("pt2", "aoti")

Gate = Callable[[nn.Module], ParityReport]  # the loaded artifact -> its gate report


def add_variant(root: Path, manifest: Manifest, name: str, module: nn.Module, example_inputs: tuple,
                config: FuseConfig, gate: Gate, imports: Sequence[str] = ()) -> Tuple[Manifest, List[VariantOutcome]]:
    """Write ``module`` as variant ``name`` in the configured formats that serve variants (pt2 when none is
    configured), gate each artifact loaded back, keep those that pass. Returns the manifest with the kept
    entries, their files and every outcome recorded, and the outcomes (an artifact that cannot be written, loaded
    or run has an ``error`` and no gate). ``imports``: modules a process must import to load the variant (the
    ones that register its ops)."""
    wanted = [f.value for f in config.export.formats if f.value in VARIANT_FORMATS] or ["pt2"]
    formats = [FORMATS[f] for f in wanted]
    require_formats(formats)
    folder = root / name
    folder.mkdir(exist_ok=True)
    ctx = make_context(module, example_inputs, config)
    outcomes: List[VariantOutcome] = []
    formats_out, files_out = dict(manifest.formats), dict(manifest.files)
    for fmt in formats:
        entry_name = f"{fmt.name}-{name}"
        before = set(list_files(folder))
        try:
            entry = fmt.write(folder, ctx)
            entry.path, entry.format, entry.variant, entry.imports = f"{name}/{entry.path}", fmt.name, name, list(imports)
            entry.files = [f"{name}/{f}" for f in sorted(set(list_files(folder)) - before)]
            entry.device = entry.device or str(ctx.device)
            report = gate(fmt.load(root, entry, torch.device(entry.device)))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be made is reported; the caller decides
            outcomes.append(VariantOutcome(entry_name, False, error=f"{type(exc).__name__}: {first_line(exc)}"))
            _remove(folder, set(list_files(folder)) - before)
            continue
        outcomes.append(VariantOutcome(entry_name, report.passed, report))
        if report.passed:
            entry.gate = report
            formats_out[entry_name] = entry
            files_out.update(file_infos(root, entry.files))
        else:
            _remove(folder, set(list_files(folder)) - before)
    if not any(o.kept for o in outcomes):
        shutil.rmtree(folder, ignore_errors=True)
    variants = {**manifest.variants, name: outcomes}
    return dataclasses.replace(manifest, formats=formats_out, files=files_out, variants=variants), outcomes


def _remove(folder: Path, names: set) -> None:
    for rel in names:
        (folder / rel).unlink(missing_ok=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(sub.iterdir()):
            sub.rmdir()
