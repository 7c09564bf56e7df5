"""``export_fused``: write a fused model in the configured formats plus ``manifest.json``, atomically.

Every format is written into a temporary sibling directory, loaded back from there and compared with the
fused model (batch sizes of the example and 1), and only then is the directory renamed into place. A
failure removes the temporary directory and raises :class:`~fx_lightning.errors.ExportError`; an existing
export is replaced only by a complete one.
"""

from __future__ import annotations

import copy
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from fx_lightning._imports import missing_modules
from fx_lightning.batches import (
    batch_at_least_two,
    batch_size_of,
    flat_tensors,
    map_tensors,
    take_rows,
    with_batch_size,
)
from fx_lightning.config import FormatFailure, FuseConfig, to_container
from fx_lightning.errors import ExportError, TraceError, first_line
from fx_lightning.export.atomic import list_files, staging_directory
from fx_lightning.export.base import FUSED_CLASS_NAME, Format, WriteContext
from fx_lightning.export.formats import FORMATS
from fx_lightning.passes.graph_utils import plain_graph_module
from fx_lightning.export.manifest import MANIFEST_NAME, build_manifest, readme_text, sha256_file, write_manifest

__all__ = ["CHECK_FILE", "Reference", "export_fused", "make_context", "require_formats", "refuse_existing",
           "write_check_file"]

# A few example inputs and their fp64 reference outputs, saved beside the artifacts.
CHECK_FILE = "check.pt"

# Round-trip tolerance (max|loaded - fused| / max|fused|): the formats rerun the same arithmetic, so
# anything beyond float rounding means the artifact is not the model.
_ROUNDTRIP_RTOL = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def export_fused(
    graph_module: nn.Module,
    directory: Union[str, "os.PathLike[str]"],
    *,
    example_inputs: Any,
    config: FuseConfig,
    report: Any = None,
    parity: Optional[dict] = None,
    extra: Optional[dict] = None,
) -> Path:
    """Write ``graph_module`` in ``config.export.formats`` plus ``manifest.json`` into ``directory``.

    ``graph_module`` is the fused model (``FuseResult.graph_module``: a symbolic-trace GraphModule or an
    unlifted ``torch.export`` module); ``example_inputs`` are forward's arguments (the batch dimension is
    dim 0 of every tensor). ``report`` (a FuseReport), ``parity`` (a dict with ``passed`` and ``metrics``) and
    ``extra`` go into the manifest as given (made JSON-safe). Honours ``export.overwrite`` and
    ``export.dynamic_batch``. Returns the directory's path.

    Atomic: the export appears complete or not at all, and an existing export is replaced only by a
    complete one. Raises :class:`ExportError` naming the cause. Under ``torch.distributed`` (world size > 1)
    only rank zero writes: other ranks return the path at once.
    """
    final = Path(os.path.abspath(os.fspath(directory)))
    if _rank() != 0:
        return final
    if not isinstance(graph_module, nn.Module):
        raise ExportError(f"export_fused() takes the fused nn.Module, got {type(graph_module).__name__}.")
    if example_inputs is None:
        raise ExportError("export_fused() needs example_inputs: the formats are traced and checked with them.")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    formats = [FORMATS[f.value] for f in config.export.formats]
    if not formats:
        raise ExportError("export.formats is empty: nothing to write.")
    require_formats(formats)
    refuse_existing(final, config.export.overwrite)
    try:
        ctx = make_context(graph_module, args, config)
    except TraceError as exc:  # not a GraphModule, or inputs the formats cannot take
        raise ExportError(str(exc)) from exc
    metadata = {"config": to_container(config), "report": report, "parity": parity, "extra": extra}
    strict = config.export.on_format_failure is FormatFailure["raise"]
    try:
        with staging_directory(final) as staging:
            _write_all(staging, ctx, formats, metadata, strict)
    except ExportError as exc:
        raise ExportError(f"export to {final} failed: {exc}") from exc
    except Exception as exc:
        raise ExportError(f"export to {final} failed: {type(exc).__name__}: {exc}") from exc
    return final


def require_formats(formats: List[Format]) -> None:
    """Raise :class:`ExportError` naming the format and what to install when a writer's needs are missing."""
    for fmt in formats:
        missing = missing_modules(fmt.requires)
        if not missing and fmt.unavailable is not None:
            missing = [m for m in [fmt.unavailable()] if m]
        if missing:
            raise ExportError(
                f"export.formats has {fmt.name!r} but {', '.join(missing)} is not installed: "
                f"{fmt.install_hint}, or drop {fmt.name} from export.formats."
            )


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def refuse_existing(final: Path, overwrite: bool) -> None:
    """Refuse before any work: an existing export with overwrite off, or a directory that is not ours."""
    if not (final.exists() or final.is_symlink()):
        return
    if not final.is_dir() or final.is_symlink():
        raise ExportError(f"{final}: exists and is not a directory; choose another export.dir.")
    if not overwrite:
        raise ExportError(f"{final}: already exists and export.overwrite is false; remove it or set it true.")
    if any(final.iterdir()) and not (final / MANIFEST_NAME).is_file():
        raise ExportError(
            f"{final}: exists and is not an fx-lightning export (no {MANIFEST_NAME}); refusing to replace it."
        )


def _write_all(staging: Path, ctx: WriteContext, formats: List[Format], metadata: Dict[str, Any],
               strict: bool) -> None:
    """Write and check each format; one that fails is dropped with its reason (``strict``: the export fails)."""
    reference = _reference(ctx)
    entries: Dict[str, Dict[str, Any]] = {}
    failed: Dict[str, str] = {}
    for fmt in formats:
        before = set(list_files(staging))
        try:
            entries[fmt.name] = _write_checked(staging, ctx, fmt, reference, before)
        except ExportError as exc:
            if strict:
                raise
            for name in set(list_files(staging)) - before:  # what the failed format left
                (staging / name).unlink()
            failed[fmt.name] = str(exc)
            warnings.warn(f"export: {exc} The other formats are exported (export.on_format_failure: skip).",
                          UserWarning, stacklevel=4)
    if not entries:
        raise ExportError("no format could be written: " + "; ".join(failed.values()))
    write_check_file(staging, reference)
    (staging / "README.md").write_text(readme_text(entries), encoding="utf-8")
    files = {name: {"size": (staging / name).stat().st_size, "sha256": sha256_file(staging / name)}
             for name in list_files(staging)}
    manifest = build_manifest(ctx, entries, files, metadata)
    manifest["failed_formats"] = failed
    manifest["check"] = {"path": CHECK_FILE, "batch_size": batch_size_of(reference.batches[0]),
                         "fused_error": reference.fused_error}
    write_manifest(staging, manifest)


def _write_checked(staging: Path, ctx: WriteContext, fmt: Format, reference: "Reference", before: set) -> Dict[str, Any]:
    try:
        entry = fmt.write(staging, ctx)
    except ExportError as exc:
        raise ExportError(f"format {fmt.name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - name the format and the cause
        raise ExportError(f"format {fmt.name!r}: writing failed: {type(exc).__name__}: {first_line(exc)}") from exc
    entry["files"] = sorted(set(list_files(staging)) - before)
    entry.setdefault("device", str(ctx.device))
    entry["check"] = _check_roundtrip(staging, fmt, entry, reference)
    return entry


# --------------------------------------------------------------------------------------- normalising


def make_context(graph_module: nn.Module, example_inputs: Tuple[Any, ...], config: FuseConfig) -> WriteContext:
    plain = plain_graph_module(graph_module, FUSED_CLASS_NAME)
    notes: List[str] = []
    try:
        args = batch_at_least_two(example_inputs)
    except ValueError as exc:
        raise ExportError(f"example_inputs: {exc}.") from None
    dynamic = None
    if config.export.dynamic_batch:
        sizes = {a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() > 0}
        if sizes:
            # One named Dim shared by all inputs when they agree (min 1: batch 1 must load too).
            shared = torch.export.Dim("batch", min=1) if len(sizes) == 1 else None
            dims = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and a.dim() > 0:
                    dims.append({0: shared if shared is not None else torch.export.Dim(f"batch_{i}", min=1)})
                else:
                    dims.append(None)
            dynamic = tuple(dims)
        else:
            notes.append("export.dynamic_batch: no tensor input has a batch dimension; exported static shapes")
    names = [n.name for n in plain.graph.nodes if n.op == "placeholder"]
    return WriteContext(plain, args, dynamic, names, onnx_opset=config.export.onnx_opset,
                        aoti_batch_sizes=list(config.export.aoti_batch_sizes), notes=notes)


# ------------------------------------------------------------------------------------------- checking


def _outputs(model: nn.Module, args: Tuple[Any, ...]) -> List[torch.Tensor]:
    # A fixed RNG: a model that draws random numbers in eval mode must match itself, not fail the check.
    devices = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        return flat_tensors(model(*args))


@dataclass
class Reference:
    """What every artifact is judged against: an fp64 copy of the fused model (on the example batch, batch 1,
    and each batch size an AOTInductor package is built for), and the fused model's own error against it.
    Another runtime's kernels (ONNX Runtime, Inductor) round differently, so an artifact passes when its error
    is of the order of the fused model's own."""

    batches: List[Tuple[Any, ...]]
    exact: List[List[torch.Tensor]]
    fused_error: float

    def tolerance(self, dtype: torch.dtype) -> float:
        return max(_ROUNDTRIP_RTOL.get(dtype, 1e-5), ROUNDTRIP_FACTOR * self.fused_error)

    def for_batch_size(self, size: int) -> Tuple[Tuple[Any, ...], List[torch.Tensor]]:
        """The example batch of ``size`` samples and its reference outputs."""
        return next((b, e) for b, e in zip(self.batches, self.exact) if batch_size_of(b) == size)


# An artifact may be this many times further from the fp64 reference than the fused model itself is.
ROUNDTRIP_FACTOR = 8.0


def _reference(ctx: WriteContext) -> Reference:
    batches = [ctx.args] + ([take_rows(ctx.args, 1)] if ctx.dynamic_shapes is not None else [])
    sizes = {batch_size_of(b) for b in batches}
    batches += [with_batch_size(ctx.args, n) for n in ctx.aoti_batch_sizes if n not in sizes]
    fused = [_outputs(ctx.model, b) for b in batches]
    try:  # the fp64 copy is made, used and freed here: no second copy of the model lives through the export
        exact_model = copy.deepcopy(ctx.model).double()
        exact = [[t.double() for t in _outputs(exact_model, map_tensors(_as_double, b))] for b in batches]
        del exact_model
    except RuntimeError:  # no fp64 kernel for some op: judge against the fused model itself
        exact = [[t.double() for t in out] for out in fused]
    errors = [_rel_err(f, e) for out, ex in zip(fused, exact) for f, e in zip(out, ex) if e.is_floating_point()]
    return Reference(batches, exact, max(errors, default=0.0))


def _as_double(t: torch.Tensor) -> torch.Tensor:
    return t.double() if t.is_floating_point() else t


def write_check_file(root: Path, reference: Reference, samples: int = 8) -> None:
    """``check.pt``: a few example inputs and the fp64 reference outputs, so a fresh process (``fx-lightning
    bench``, a serving health check) can verify any artifact without the training code."""
    inputs = [a[:samples].detach().cpu() if isinstance(a, torch.Tensor) and a.dim() else a for a in reference.batches[0]]
    exact = [t[:samples].cpu() if t.dim() and t.shape[0] == batch_size_of(reference.batches[0]) else t.cpu()
             for t in reference.exact[0]]
    torch.save({"inputs": inputs, "expected": exact, "fused_error": reference.fused_error}, root / CHECK_FILE)


def _check_roundtrip(staging: Path, fmt: Format, entry: Dict[str, Any], reference: Reference) -> Dict[str, Any]:
    """Load ``fmt`` back and judge it against the fp64 reference on the example batch and on batch 1."""
    missing = missing_modules(fmt.runtime_requires)
    if missing:
        return {"checked": False, "reason": f"{', '.join(missing)} is not installed"}
    # Loaded where it was built, so a GPU model is checked where it runs (ONNX Runtime checks on the CPU).
    try:
        loaded = fmt.load(staging, entry, torch.device(entry["device"]))
    except Exception as exc:  # noqa: BLE001
        raise ExportError(f"format {fmt.name!r}: written but cannot be loaded back: {type(exc).__name__}: "
                          f"{first_line(exc)}") from exc
    worst, tolerance = 0.0, 0.0
    # The batch sizes the artifact is built for (an AOTInductor package per size), else the example's and 1.
    sizes = entry.get("batch_sizes") or [batch_size_of(b) for b in reference.batches]
    for size in sizes:
        batch, want = reference.for_batch_size(size)
        try:
            got = _outputs(loaded, batch)
        except Exception as exc:  # noqa: BLE001
            raise ExportError(f"format {fmt.name!r}: the loaded model fails on batch size {size}: "
                              f"{type(exc).__name__}: {first_line(exc)}") from exc
        if len(got) != len(want):
            raise ExportError(f"format {fmt.name!r}: the loaded model returns {len(got)} tensors, "
                              f"the fused model {len(want)}.")
        for g, w in zip(got, want):
            if tuple(g.shape) != tuple(w.shape):
                raise ExportError(f"format {fmt.name!r}: output shape {tuple(g.shape)} != {tuple(w.shape)} "
                                  f"on batch size {size}.")
            err = _rel_err(g, w)
            tol = reference.tolerance(g.dtype) if g.is_floating_point() else 0.0
            if not err <= tol:
                raise ExportError(
                    f"format {fmt.name!r}: the loaded model disagrees with the fused model on batch size {size}: "
                    f"relative error {err:.3e} against an fp64 copy of the fused model, where the fused model "
                    f"itself is at {reference.fused_error:.1e} (allowed: {tol:.1e})."
                )
            worst, tolerance = max(worst, err), max(tolerance, tol)
    return {"checked": True, "batch_sizes": list(sizes), "max_rel_err": worst,
            "fused_rel_err": reference.fused_error, "tolerance": tolerance,
            "against": "an fp64 copy of the fused model"}


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    g, w = got.detach().cpu().double(), want.detach().cpu().double()
    if w.numel() == 0:
        return 0.0
    return ((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item()
