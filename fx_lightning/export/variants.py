"""Serving variants of an export: lossy models (int8) written beside the exact artifacts, in a subfolder
named after the variant, and kept only when the artifact itself, loaded back, passes the caller's gate.

A variant's manifest entry is named ``<format>-<variant>`` (``aoti-int8``) and says which format it is; its gate
report replaces the round-trip check (a lossy model is not expected to match the fp32 one).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import torch
from torch import nn

from fx_lightning.config import FuseConfig
from fx_lightning.errors import first_line
from fx_lightning.export.atomic import list_files
from fx_lightning.export.formats import FORMATS
from fx_lightning.export.manifest import read_manifest, replace_manifest, sha256_file
from fx_lightning.export.writer import make_context, require_formats

__all__ = ["VARIANT_FORMATS", "add_variant"]

# The formats a variant is written in: those that run it through Inductor (a quantised graph run eagerly is
# slow). pt2 also serves load_fused(dir, compile=True).
VARIANT_FORMATS = ("pt2", "aoti")

Gate = Callable[[nn.Module], Any]  # loaded artifact -> a report with .passed, .failures and .to_dict()


def add_variant(root: Path, name: str, module: nn.Module, example_inputs: tuple, config: FuseConfig,
                gate: Gate, imports: Sequence[str] = ()) -> Dict[str, Any]:
    """Write ``module`` as variant ``name`` in the configured formats that serve variants (pt2 when none is
    configured), gate each loaded artifact, keep those that pass; returns ``{entry name: gate report dict}``
    (kept or not) and records the kept ones in the manifest. ``imports``: modules a process must import to load
    the variant (the ones that register its ops)."""
    wanted = [f.value for f in config.export.formats if f.value in VARIANT_FORMATS] or ["pt2"]
    formats = [FORMATS[f] for f in wanted]
    require_formats(formats)
    folder = root / name
    folder.mkdir(exist_ok=True)
    ctx = make_context(module, example_inputs, config)
    outcome: Dict[str, Any] = {}
    kept: Dict[str, Dict[str, Any]] = {}
    for fmt in formats:
        entry_name = f"{fmt.name}-{name}"
        before = set(list_files(folder))
        try:
            entry = fmt.write(folder, ctx)
            entry.update(path=f"{name}/{entry['path']}", format=fmt.name, variant=name, imports=list(imports),
                         files=[f"{name}/{f}" for f in sorted(set(list_files(folder)) - before)],
                         device=entry.get("device", str(ctx.device)))
            report = gate(fmt.load(root, entry, torch.device(entry["device"])))
        except Exception as exc:  # noqa: BLE001 - a variant that cannot be written or run is reported, not fatal
            outcome[entry_name] = {"passed": False, "failures": [f"{type(exc).__name__}: {first_line(exc)}"]}
            _remove(folder, set(list_files(folder)) - before)
            continue
        outcome[entry_name] = report.to_dict()
        if report.passed:
            entry["gate"] = report.to_dict()
            kept[entry_name] = entry
        else:
            _remove(folder, set(list_files(folder)) - before)
    if not kept:
        shutil.rmtree(folder, ignore_errors=True)
    _record(root, name, kept, outcome)
    return outcome


def _remove(folder: Path, names: set) -> None:
    for rel in names:
        (folder / rel).unlink(missing_ok=True)
    for sub in sorted((p for p in folder.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        if not any(sub.iterdir()):
            sub.rmdir()


def _record(root: Path, name: str, kept: Dict[str, Dict[str, Any]], outcome: Dict[str, Any]) -> None:
    manifest = read_manifest(root)
    for entry_name, entry in kept.items():
        manifest["formats"][entry_name] = entry
        for rel in entry["files"]:
            manifest["files"][rel] = {"size": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}
    manifest.setdefault("variants", {})[name] = outcome
    replace_manifest(root, manifest)
