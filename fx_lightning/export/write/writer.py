"""Writing an export: every format, loaded back from where it was written and compared with the fused model
(the examples, ``check.pt`` and the comparison: :mod:`.check`).

:func:`prepare_export` checks what needs no work (formats available, the directory may be replaced, inputs
usable); inside one staging directory (:mod:`.atomic`), :func:`write_formats` writes and checks every format and
:func:`finish_export` writes the README, ``report.html`` and the
:class:`~fx_lightning.export.manifest.Manifest`; the pipeline's export step adds its variants and selection
between the two; :func:`export_fused` runs that sequence for a fused model made by hand.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch import nn

from fx_lightning.common.imports import missing_modules
from fx_lightning.common.calls import Call, run_seeded
from fx_lightning.config import FormatFailure, FuseConfig, to_container
from fx_lightning.errors import ExportError, FXLightningError, TraceError, first_line
from fx_lightning.export.write.atomic import list_files, staging_directory
from fx_lightning.export.check import CHECK_FILE, Reference, check_roundtrip, reference_for, write_check_file
from fx_lightning.formats.base import FUSED_CLASS_NAME, ExactReference, Format, FormatEntry, WriteContext
from fx_lightning.formats import FORMATS
from fx_lightning.export.write.prologue import with_prologue
from fx_lightning.export.files import file_infos
from fx_lightning.export.manifest import MANIFEST_NAME, Manifest, Preprocess, new_manifest, write_manifest
from fx_lightning.export.progress import Progress
from fx_lightning.export.write.report_html import REPORT_NAME, render_report
from fx_lightning.export.write.readme import readme_text
from fx_lightning.common.notes import NoteKind
from fx_lightning.common.notes import Note
from fx_lightning.parity.report import ParityReport
from fx_lightning.passes.graph_utils import plain_graph_module
from fx_lightning.signature.program import ExportFailed, LeafDims, export_program, signature_dims
from fx_lightning.common.provenance import Provenance
from fx_lightning.common.rows import rows_of, with_rows
from fx_lightning.signature.signature import DimKind, Observed, Signature, derive_signature, shape_problem, with_raw_input

__all__ = ["export_fused", "prepare_export", "export_errors", "finish_export", "write_formats", "make_context",
           "require_formats", "refuse_existing", "STATIC_EXPORT", "STATIC_SIZES", "NO_SAMPLE_AXIS", "static_note"]


STATIC_EXPORT = NoteKind("static_export", "exported for batch size {batch_size} only: the fused model does not take "
                                          "a dynamic batch ({reason}); load_fused runs other batch sizes as pieces of "
                                          "{batch_size}")
NOT_DYNAMIC = NoteKind("not_dynamic", "torch.export could not keep the sizes that vary dynamic ({reason}): the formats "
                                      "made with it are left out (a program fixed to one graph's sizes would take no "
                                      "other)")
STATIC_SIZES = NoteKind("static_sizes", "the formats made with torch.export take the example's sizes only: the sizes "
                                        "that varied ({sizes}) could not stay dynamic ({reason}); load_fused refuses "
                                        "other sizes for them (not a sample axis it could split or pad along); load_fused(dir) and "
                                        "serve load a format that takes them unless a selection picked another")
PROBED_FIXED = NoteKind("probed_fixed", "sizes shown to vary by experiment (a call with them resized ran) could "
                                      "not stay dynamic in torch.export ({reason}): the artifacts made with it take "
                                      "the sizes seen there; the fused graph's own formats take every size (load_fused(dir) and serve "
                                      "load one of those unless a selection picked another)")
NO_SAMPLE_AXIS = NoteKind("no_sample_axis", "no sample axis: {how}; every artifact takes its inputs whole (never split "
                                            "or padded)")


def export_fused(
    graph_module: nn.Module,
    directory: Union[str, "os.PathLike[str]"],
    *,
    example_inputs: Any,
    config: FuseConfig,
    report: Any = None,
    parity: Union[ParityReport, Dict[str, object], None] = None,
    extra: Union[Provenance, Dict[str, object], None] = None,
) -> Path:
    """Write ``graph_module`` in ``config.export.formats`` plus ``manifest.json`` into ``directory``.

    ``graph_module`` is the fused model (``FuseResult.graph_module``: a symbolic-trace GraphModule or an
    unlifted ``torch.export`` module); ``example_inputs`` are forward's arguments (the batch dimension is
    dim 0 of every tensor). ``report`` (a FuseReport), ``parity`` (a ParityReport or its dict) and ``extra``
    (where the model came from: a :class:`~fx_lightning.common.provenance.Provenance` or its dict) go into the manifest. Honours
    ``export.overwrite`` and ``export.dynamic_batch``. Returns the directory's path.

    Atomic: the export appears complete or not at all, and an existing export is replaced only by a
    complete one. Raises :class:`ExportError` naming the cause. Under ``torch.distributed`` (world size > 1)
    only rank zero writes; the other ranks wait for it, then return the path or raise its error.
    """
    final = Path(os.path.abspath(os.fspath(directory)))
    error: Optional[BaseException] = None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
        try:
            ctx = prepare_export(graph_module, example_inputs, config, final)
            provenance = extra if isinstance(extra, Provenance) else Provenance.from_dict(extra)
            if parity is not None and not isinstance(parity, ParityReport):
                parity = ParityReport.from_dict(parity)
            with export_errors(final), staging_directory(final) as staging:
                manifest = write_formats(staging, ctx, config, report=report, parity=parity, provenance=provenance)
                finish_export(staging, manifest, final)
        except Exception as exc:  # noqa: BLE001 - every rank raises it, after rank zero tells them
            error = exc
    _wait_for_rank_zero(error)
    if error is not None:
        raise error
    return final


@contextlib.contextmanager
def export_errors(final: Path) -> Iterator[None]:
    """Any failure inside the block as the export's: an fx-lightning error with ``final`` named in front, another
    (a writer's or the filesystem's own) as an :class:`ExportError` naming it."""
    try:
        yield
    except FXLightningError as exc:
        raise exc.within(f"export to {final} failed")
    except Exception as exc:  # noqa: BLE001 - a writer's or the filesystem's own failure, with the directory named
        raise ExportError(f"export to {final} failed: {type(exc).__name__}: {exc}") from exc


def finish_export(staging: Path, manifest: Manifest, final: Path, progress: Optional[Progress] = None) -> None:
    """The last files of an export in ``staging``: the README (every format kept, variants included), ``report.html``
    (what the manifest holds, drawn) and the manifest itself."""
    progress = progress if progress is not None else Progress()
    (staging / "README.md").write_text(readme_text(manifest.formats), encoding="utf-8")
    with progress.step(f"{REPORT_NAME} and manifest.json"):
        (staging / REPORT_NAME).write_text(render_report(manifest, f"fx-lightning export: {final.name}"),
                                           encoding="utf-8")
        manifest.files.update(file_infos(staging, ["README.md", REPORT_NAME]))
        write_manifest(staging, manifest)


def prepare_export(graph_module: nn.Module, example_inputs: Any, config: FuseConfig, final: Path,
                   **context: Any) -> WriteContext:
    """Everything that can be checked before writing: the model and inputs, the formats' dependencies, and
    whether ``final`` may be replaced. Returns the context every writer gets (``context``: the keywords of
    :func:`make_context`). Raises :class:`ExportError`."""
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
        return make_context(graph_module, args, config, **context)
    except TraceError as exc:  # not a GraphModule, or inputs the formats cannot take: the export's condition
        raise ExportError(exc.message) from exc


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


def _wait_for_rank_zero(error: Optional[BaseException]) -> None:
    """Under ``torch.distributed``, every rank returns only once rank zero's write finished (a rank that reads the
    path at once would find nothing there), and raises rank zero's error as an ExportError when it failed."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    message = [None if error is None else f"{type(error).__name__}: {first_line(error)}"]
    dist.broadcast_object_list(message, src=0)
    if message[0] is not None and dist.get_rank() != 0:
        raise ExportError(f"rank 0 failed to write the export: {message[0]}")


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


def write_formats(staging: Path, ctx: WriteContext, config: FuseConfig, *, report: Any = None,
                  parity: Optional[ParityReport] = None, provenance: Optional[Provenance] = None,
                  progress: Optional[Progress] = None) -> Manifest:
    """Write and check each configured format in ``staging``, then ``check.pt``; returns the manifest (not
    written: :func:`finish_export`). A format that fails is dropped with its reason, or fails the export when
    ``export.on_format_failure`` is ``raise``."""
    strict = config.export.on_format_failure is FormatFailure["raise"]
    progress = progress if progress is not None else Progress()
    reference = reference_for(ctx)
    entries: Dict[str, FormatEntry] = {}
    failed: Dict[str, str] = {}
    for fmt in (FORMATS[f.value] for f in config.export.formats):
        before = set(list_files(staging))
        try:
            with progress.step(f"format {fmt.name}: written and checked") as end:
                entries[fmt.name] = _write_checked(staging, ctx, fmt, reference, before,
                                                   config.parity.min_discrete_agreement)
                end.result = _written(staging, entries[fmt.name])
        except ExportError as exc:
            if strict:
                raise exc.within(f"format {fmt.name!r}")
            for name in set(list_files(staging)) - before:  # what the failed format left
                (staging / name).unlink()
            failed[fmt.name] = exc.message
            warnings.warn(f"export: format {fmt.name!r}: {exc.message} This format is left out "
                          "(export.on_format_failure: skip).", UserWarning, stacklevel=4)
    if not entries:
        # No advice: dropping a format cannot help when every one failed, and no other is known to work (a graph
        # torch.export cannot capture may not load back as a GraphModule either); each reason is the advice.
        raise ExportError("no format could be written: " + "; ".join(f"format {n!r}: {r}" for n, r in failed.items()),
                          fix="")
    write_check_file(staging, reference)
    manifest = new_manifest(ctx, entries, config=to_container(config),
                            report=report.to_dict() if hasattr(report, "to_dict") else report, parity=parity,
                            provenance=provenance or Provenance())
    manifest.files = file_infos(staging, list_files(staging))
    manifest.failed_formats = failed
    manifest.check_file = CHECK_FILE
    return manifest


def _written(staging: Path, entry: FormatEntry) -> str:
    """What a format step says when it ends: its size and its check."""
    size = sum((staging / name).stat().st_size for name in entry.files if (staging / name).is_file())
    check = entry.check
    verdict = ("check passed" if check.passed else "check FAILED") if check is not None else "not checked"
    return f"{size / 1e6:.1f} MB, {verdict}"


def _write_checked(staging: Path, ctx: WriteContext, fmt: Format, reference: Reference, before: set,
                   min_agreement: float) -> FormatEntry:
    try:
        entry = fmt.write(staging, ctx)
    except ExportError:
        raise
    except Exception as exc:  # noqa: BLE001 - the cause; write_formats names the format
        raise ExportError(f"writing failed: {type(exc).__name__}: {first_line(exc)}") from exc
    entry.format = fmt.name
    entry.files = sorted(set(list_files(staging)) - before)
    entry.device = entry.device or str(ctx.device)
    sizes, entry.built_shapes = ctx.built_for(fmt)
    entry.batch_sizes = entry.batch_sizes or sizes
    entry.check = check_roundtrip(staging, fmt, entry, reference, ctx.takes_other_sizes(fmt), min_agreement)
    return entry


# --------------------------------------------------------------------------------------- normalising


def make_context(graph_module: nn.Module, example_inputs: Tuple[Any, ...], config: FuseConfig, *,
                 preprocess: Optional[Preprocess] = None, normalised_dtype: torch.dtype = torch.float32,
                 reference: Optional[ExactReference] = None, signature: Optional[Signature] = None,
                 other_inputs: Sequence[Tuple[Any, ...]] = (), fixed: Optional[str] = None,
                 no_program: Optional[str] = None) -> WriteContext:
    """The plain fused model, the example inputs and how the artifacts are called, made once for every writer.
    ``fixed``: why the fused model itself is fixed to the example's sizes (a capture that could not stay dynamic):
    its artifacts are then built for those sizes too. ``no_program``: why no torch.export program is tried (its
    capture showed torch.export cannot follow the model): the formats made with one are left out with that reason.

    ``signature``: what the observed calls showed (the sample axis, the sizes that vary); without one it is derived
    here from the example (dim 0 is the sample axis only when an experiment shows that rows are independent).
    The program is dynamic on the sample axis (``export.dynamic_batch``) and on every size that varied, when
    torch.export can keep it so (:func:`fx_lightning.signature.program.export_program`), and checked on ``other_inputs``
    (examples of other sizes); otherwise it is built for the example's sizes, and a note says why: ``load_fused``
    runs another number of samples as pieces only along a proven sample axis, and refuses other sizes elsewhere.
    ``preprocess``: the raw-input prologue spliced in front of the model, one graph for every writer
    (``example_inputs`` are then raw inputs; ``normalised_dtype``: the dtype the model takes its input in);
    ``reference``: what the artifacts are judged against (None: an fp64 copy of the model)."""
    plain = plain_graph_module(graph_module, FUSED_CLASS_NAME)
    if preprocess is not None:
        plain = with_prologue(plain, preprocess, normalised_dtype)
    args = tuple(example_inputs)
    placeholders = [n.name for n in plain.graph.nodes if n.op == "placeholder"]
    if signature is None:  # the experiment on the model as given: an export capture's guards show a fixed size
        signature = _signature_of(plain if preprocess is not None else graph_module, args, placeholders)
    elif preprocess is not None:
        signature = with_raw_input(signature, args[0], preprocess.layout == "NHWC")
    # One name per input for every runtime, the manifest and the server: the signature's (forward's parameters,
    # as users write them), not the graph's (fx renames `input` to `input_1`).
    names = [leaf.name for leaf in signature.inputs] if len(signature.inputs) == len(placeholders) else placeholders
    ctx = WriteContext(plain, args, signature, names,
                       onnx_opset=config.export.onnx_opset, reference=reference,
                       dynamic_samples=config.export.dynamic_batch,
                       check_args=[tuple(a) for a in other_inputs if _leaf_shapes(a) != _leaf_shapes(args)][:3])
    axes = signature.input_axes()
    rows = rows_of(args, axes) if signature.batched else None
    if rows == 0:
        raise ExportError("example_inputs: a tensor argument has batch size 0; give at least one sample.")
    if signature.batched:
        ctx.aoti_batch_sizes = list(config.export.aoti_batch_sizes)
    dims = signature_dims(signature, dynamic_samples=config.export.dynamic_batch)
    if not signature.batched:
        ctx.notes.append(NO_SAMPLE_AXIS(how=signature.sample.how))
    ctx.graph_fixed = fixed is not None
    if no_program is not None:
        ctx.program_refused = no_program
        return ctx
    # Along a sample axis where the first rows alone do not run the same, only padding to the size seen is exact.
    padded_only = signature.batched and not signature.sample.any_size and config.export.dynamic_batch
    if padded_only:
        ctx.aoti_batch_sizes = [int(rows)] if rows is not None else []
    if not any(dims) or fixed is not None:
        return _static_program(ctx, rows, (fixed or signature.sample.how) if any(dims) or padded_only else None)
    if padded_only:
        ctx.notes.append(static_note(signature, args, signature.sample.how))
    return _with_dynamic_program(ctx, dims, rows, config.export.dynamic_batch)


def _with_dynamic_program(ctx: WriteContext, dims: List[LeafDims], rows: Optional[int], dynamic_samples: bool) -> WriteContext:
    """``ctx`` with a program dynamic on ``dims``; where the graph fixes a size, one for the example's sizes (or
    none, where the sizes that vary could not stay dynamic), with a note saying why."""
    signature, args = ctx.exported_signature, ctx.args
    dynamic_args = tuple(with_rows(args, signature.input_axes(), 2)) if rows == 1 and dynamic_samples else args
    try:
        ctx.program = export_program(ctx.export_model, Call(dynamic_args), dims, allow_static=False,
                                     check=[Call(a) for a in ctx.check_args])
        ctx.args = dynamic_args
        return ctx
    except ExportFailed as exc:  # the graph fixes a size: export it for the example's
        reason = first_line(exc.first, with_type=True)
    if signature.probed:  # sizes only shown to vary by experiment: fixed again for the program, the rest tried once
        # more; the fused graph's own formats (graph_module, code) still take them, as the export's signature says.
        ctx.program_signature = signature.fixing_probed()
        ctx.check_args = [a for a in ctx.check_args if _fits(ctx.program_signature, a)]
        ctx.notes.append(PROBED_FIXED(reason=reason))
        return _with_dynamic_program(ctx, signature_dims(ctx.program_signature, dynamic_samples=dynamic_samples), rows,
                                     dynamic_samples)
    if any(d.kind is DimKind.variable for leaf in signature.inputs for d in leaf.dims):
        # Fixed to sizes that vary (a graph's node count), a program would take no other input: the formats made
        # with torch.export are left out with this reason; the fused graph's own formats take every size.
        ctx.notes.append(NOT_DYNAMIC(reason=reason))
        ctx.program_refused = f"the sizes that vary could not stay dynamic in torch.export ({reason})"
        return ctx
    return _static_program(ctx, rows, reason)


def _static_program(ctx: WriteContext, rows: Optional[int], reason: Optional[str]) -> WriteContext:
    """``ctx`` with the program for the example's sizes, or none when torch.export cannot make one: the formats that
    need one then fail with torch.export's error (:meth:`WriteContext.export`), the others (a pickled GraphModule)
    are written. ``reason``: why sizes that could vary are fixed, for the note; AOTInductor is then built for the
    example's number of samples (what the model can run)."""
    try:
        ctx.program = export_program(ctx.export_model, Call(ctx.args), None, allow_static=True)
    except ExportFailed:
        ctx.program = None
    if reason is not None:
        ctx.notes.append(static_note(ctx.exported_signature, ctx.args, reason))
        if ctx.exported_signature.batched:
            ctx.aoti_batch_sizes = [int(rows)] if rows is not None else []
    return ctx


def _fits(signature: Signature, args: Sequence[Any]) -> bool:
    """Whether ``args`` have the sizes ``signature`` fixes (an example of other sizes still to check on)."""
    return shape_problem(signature.inputs, [a for a in args if isinstance(a, torch.Tensor)]) is None


def _leaf_shapes(args: Sequence[Any]) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))


def _signature_of(model: nn.Module, args: Tuple[Any, ...], names: List[str]) -> Signature:
    """The signature one example shows (no loader says how many samples it holds: dim 0 is tested)."""
    try:
        return derive_signature([Observed(Call(args))], lambda c: run_seeded(model, c),
                                rerun=lambda c: run_seeded(model, c, 1), root_names=names)
    except ValueError as exc:
        raise ExportError(f"example_inputs: {exc}") from exc


def static_note(signature: Signature, args: Sequence[Any], reason: str) -> Note:
    """Why the artifacts are built for the example's sizes, and what load_fused does with others."""
    if signature.batched:
        return STATIC_EXPORT(batch_size=rows_of(args, signature.input_axes()), reason=reason)
    varied = [f"{leaf.name} dim {d}" for leaf in signature.inputs for d, dim in enumerate(leaf.dims)
              if dim.kind is DimKind.variable]
    return STATIC_SIZES(sizes=", ".join(varied) or "none", reason=reason)
