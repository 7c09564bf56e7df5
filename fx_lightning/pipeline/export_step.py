"""The export step: every format (each loaded back and checked), the variants and the selection, written in one
staging directory renamed into place once, and the notes the export's manifest gives the user.

    export            the whole step, one sequence in one staging directory             -> Exported
      write_formats (export.writer), add_variants, select_artifact, finish_export (export.writer): its parts

The variants are the verified fused model made lossy (int8, bf16: :mod:`fx_lightning.variants`): the variant's own
model in the torch formats, each exported format's own variant beside it, each gated loaded back
(:func:`fx_lightning.pipeline.steps.gate_variant`) and kept only when it passes.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple, Union


import torch

from fx_lightning.config import FuseConfig, ParityConfig, Selection
from fx_lightning.errors import ExportError, FXLightningError, first_line, require_inputs
from fx_lightning.export.files import file_infos
from fx_lightning.export.manifest import Manifest, VariantOutcome
from fx_lightning.export.write.prologue import behind_prologue
from fx_lightning.export.select.selection import bench_export, select_by_strategy, with_selection
from fx_lightning.export.select.sweep import REHEARSAL_SWEEP, SweepSettings
from fx_lightning.export.write.variants import (Maker, finish_variant, format_variant_makers, make_artifact,
                                               record_artifact, skip_variant, torch_variant_formats, variant_makers)
from fx_lightning.export.write.atomic import staging_directory
from fx_lightning.export.write.writer import export_errors, finish_export, prepare_export, write_formats
from fx_lightning.common.machine import cpu_info
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.parity.report import ParityReport
from fx_lightning.pipeline import raw_input
from fx_lightning.export.progress import Progress
from fx_lightning.pipeline.records import Exported, Fused, FusedForms
from fx_lightning.pipeline.forms_step import FORM_EXPORTED, FORM_NOT_EXPORTED, how_called
from fx_lightning.signature.forms import CallForm
from fx_lightning.pipeline.steps import Step, gate_variant, in_step, other_sizes
from fx_lightning.common.provenance import Provenance
from fx_lightning.common.rows import with_rows
from fx_lightning.signature.value_guards import GUARDS_FILE
from fx_lightning.variants import MadeVariant, Variant, VariantContext, VariantOptions, enabled_variants

__all__ = [
    "export",
    "add_variants",
    "select_artifact",
    "export_notes",
    "FORMAT_NOT_EXPORTED",
    "VARIANT_PASSED",
    "VARIANT_MISSED",
    "VARIANT_MISSED_UNTRAINED",
    "VARIANT_FAILED",
    "VARIANT_SKIPPED",
    "SELECTED",
    "NOTHING_SELECTED",
]

FORMAT_NOT_EXPORTED = NoteKind("format_not_exported", "format {format} not exported ({reason})")
_FIGURES = "top-1 agreement {top1_agreement}, accuracy drop {accuracy_drop}, worst cosine {cosine_min}"
VARIANT_PASSED = NoteKind("variant_passed", "{artifact} passed its gate (" + _FIGURES + ")")
VARIANT_MISSED = NoteKind("variant_missed", "{artifact} missed its gate: {failures} (" + _FIGURES + "); the fp32 "
                                            "artifacts stand")
VARIANT_MISSED_UNTRAINED = NoteKind("variant_missed_untrained", "{artifact} missed its gate on the untrained model: "
                                                                "{failures} (" + _FIGURES + "); the gate applies "
                                                                "after training")
VARIANT_FAILED = NoteKind("variant_failed", "{artifact} could not be made: {error}; the fp32 artifacts stand")
VARIANT_SKIPPED = NoteKind("variant_skipped", "{variant} variants not made: {reason}")
SELECTED = NoteKind("selected", "load_fused selects {format}: {why}{speedup}")
NOTHING_SELECTED = NoteKind("nothing_selected", "export.select: fastest: no artifact passed its check; load_fused "
                                                "falls back to the order of preference")


def export(fused: Fused, config: FuseConfig, parity: Optional[ParityReport], directory: Path,
           provenance: Provenance, *, rehearsal: bool, progress: Progress, forms: Optional[FusedForms] = None
           ) -> Exported:
    """Write the fused model: every format (each loaded back and checked), the variants and the selection, all in
    one staging directory renamed to ``directory`` (made absolute) at the end, so the export appears complete or
    not at all. ``rehearsal`` (the preflight): as the end of fit will (a format that cannot be written is skipped
    with a note under ``export.on_format_failure: skip``), except that a variant or the selection that cannot run
    is an error, a variant's gate is measured but not required, and the selection times each artifact once.
    ``progress``: where each part (a format, a variant, the timing, the sweep) says it started and ended. ``forms``:
    the call forms proven (:func:`~fx_lightning.pipeline.forms_step.fuse_forms`), each exported as one of its own
    under ``forms/<argument>=<value>`` and listed in the signature; one that cannot be written is left out, noted."""
    require_inputs(fused.example_inputs is not None, "the exporter to write the fused model with",
                   key=f"export to {directory}")
    directory = Path(os.path.abspath(directory))
    with in_step(Step.export), progress.step("prepare the export (torch.export program)"):
        example, reference = raw_input.export_inputs(fused)  # raw inputs with a prologue (export.preprocess)
        ctx = prepare_export(fused.result.graph_module, example, config, directory, preprocess=fused.contract.preprocess,
                             normalised_dtype=raw_input.normalised_dtype(fused), reference=reference,
                             signature=fused.signature, other_inputs=_other_inputs(fused), fixed=_fixed(fused),
                             no_program=_no_program(fused))

    # The one export sequence, in one staging directory renamed into place at the end: the formats, the contract of
    # raw inputs, the variants, the selection, then the README, report.html and the manifest.
    with in_step(Step.export), export_errors(directory), staging_directory(directory) as staging:
        manifest = write_formats(staging, ctx, config, report=fused.result.report, parity=parity,
                                 provenance=provenance, progress=progress)
        manifest = _with_value_guards(staging, manifest, fused)
        manifest = raw_input.with_contract(manifest, fused.contract)
        manifest = add_variants(staging, manifest, fused, config, rehearsal=rehearsal, progress=progress)
        if config.export.select is Selection.fastest:
            manifest = select_artifact(staging, manifest, fused, config, rehearsal=rehearsal, progress=progress)
        manifest = _export_forms(staging, manifest, forms, provenance, rehearsal=rehearsal, progress=progress)
        finish_export(staging, manifest, directory, progress)
    steps = [Step.export.value] + ([Step.variants.value] if manifest.variants else []) + (
        [Step.selection.value] if config.export.select is Selection.fastest else [])
    return Exported(directory, manifest, export_notes(manifest, rehearsal), steps)


def _export_forms(staging: Path, manifest: Manifest, forms: Optional[FusedForms], provenance: Provenance, *,
                  rehearsal: bool, progress: Progress) -> Manifest:
    """Each proven call form exported under ``forms/<argument>=<value>`` (an export of its own, with its manifest)
    and listed in the signature, so load_fused sends its calls there; one that cannot be written is noted."""
    written: List[CallForm] = []
    if forms is None:
        return manifest
    manifest.notes += forms.notes
    for made in forms.made:  # each form fused as it is asked for, exported, then let go before the next
        if isinstance(made, Note):
            manifest.notes.append(made)
            continue
        form = dataclasses.replace(made.form, directory=f"forms/{made.form.slug}")
        try:
            with progress.step(f"export of call form {form.name}"):  # its parts nested under its name
                export(made.fused, made.config, made.parity, staging / form.directory, provenance,
                       rehearsal=rehearsal, progress=progress)
        except FXLightningError as exc:
            manifest.notes.append(FORM_NOT_EXPORTED(form=form.name, reason=first_line(exc), how=how_called(form)))
            continue
        finally:
            del made
        written.append(form)
        manifest.notes.append(FORM_EXPORTED(form=form.name, directory=form.directory, how=how_called(form)))
    if (written or forms.defaults) and manifest.signature is not None:  # the defaults: the artifact's own forms
        manifest.signature = dataclasses.replace(manifest.signature, forms=[*forms.defaults, *written])
    return manifest


def _with_value_guards(staging: Path, manifest: Manifest, fused: Fused) -> Manifest:
    """The guard program of the branches on tensor values every observed call took one way, written beside the
    artifacts and listed in the manifest: every artifact's interface runs it first (signature.value_guards)."""
    branches = fused.result.value_branches
    if branches is None or branches.guards is None:
        return manifest
    torch.export.save(branches.guards, str(staging / GUARDS_FILE))
    manifest.files.update(file_infos(staging, [GUARDS_FILE]))
    return manifest


def _fixed(fused: Fused) -> Optional[str]:
    """Why the fused graph is fixed to its capture's sizes (None: it is not)."""
    if fused.result.static_shapes is None:
        return None
    return "its capture is fixed to these sizes: " + next(
        (str(n) for n in fused.result.report.notes if n.kind.name == "static_batch_capture"), "see the fuse report")


def _no_program(fused: Fused) -> Optional[str]:
    """Why torch.export is not tried again (its capture showed it cannot follow the model), else None."""
    note = next((n for n in fused.result.report.notes if n.kind.name == "captured_keeping_whole"), None)
    return None if note is None else f"torch.export could not capture the model: {note['export']}"


def _other_inputs(fused: Fused) -> List[tuple]:
    """The graph's inputs on the steps of other sizes than the first (raw with a prologue): the sizes that vary,
    which every dynamic artifact must take."""
    preprocess = fused.contract.preprocess
    calls = other_sizes(fused.steps) + fused.signature.examples  # observed, and made by the size experiments
    return [raw_input.example_raw(fused.graph_inputs(call), preprocess) for call in calls]


def add_variants(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                 rehearsal: bool, progress: Progress) -> Manifest:
    """Make each enabled lossy variant (int8, bf16) of the verified fused model: its own model in the torch
    formats, and each exported format's own variant (OpenVINO through NNCF, ONNX Runtime); keep the artifacts that
    pass the variant's gate, loaded back. Every outcome is recorded in the manifest, and a variant this CPU cannot
    run fast is skipped with the reason. A variant that cannot be made is an error in the rehearsal (which runs the
    accuracy-aware search on one layer, to prove it runs), and a recorded outcome after training (the fp32
    artifacts stand)."""
    for variant, options in enabled_variants(config.passes):
        key = f"passes.{variant.key}"
        lacking = variant.lacks(cpu_info()) if options.require_cpu_features else None
        if lacking is not None:
            figure = None if rehearsal else variant.measured_here(fused.result.graph_module, _one_example(fused))
            lacking += f" ({figure})" if figure else ""
            manifest = skip_variant(manifest, variant.name, f"{lacking}; {key}.require_cpu_features: false makes "
                                                            "it anyway")
            continue
        gate_config, preprocess = options.gate_of(config.parity), fused.contract.preprocess
        if torch_variant_formats(config, variant.name):
            with progress.step(f"variant {variant.name}: make it from the fused model",
                               "calibration" if variant.name == "int8" else "") as end:
                made = _make_variant(variant, options, fused, gate_config, key, rehearsal, progress)
                end.result = "not made" if isinstance(made, VariantOutcome) else "made"
            if isinstance(made, VariantOutcome):
                manifest = dataclasses.replace(manifest, variants={**manifest.variants, variant.name: [made]})
            else:
                with in_step(Step.variants):
                    makers = variant_makers(
                        staging, variant.name, made.model, raw_input.example_raw(tuple(fused.example_inputs or ()),
                                                                                 preprocess),
                        config, imports=variant.imports, preprocess=preprocess,
                        normalised_dtype=raw_input.normalised_dtype(fused), signature=fused.signature,
                        other_inputs=_other_inputs(fused), fixed=_fixed(fused))
                manifest = _gated(staging, manifest, fused, variant.name, makers, gate_config, key, made.notes,
                                  progress)
        with in_step(Step.variants):
            makers = format_variant_makers(staging, manifest, variant.name,
                                           [raw_input.example_raw(c, preprocess) for c in fused.calibration])
        manifest = _gated(staging, manifest, fused, variant.name, makers, gate_config, key, (), progress)
    return manifest


def _gated(staging: Path, manifest: Manifest, fused: Fused, name: str, makers: Sequence[Maker],
           gate_config: ParityConfig, key: str, notes: Sequence[Note], progress: Progress) -> Manifest:
    """Each artifact of variant ``name`` made, loaded back, gated against the fused model on the parity steps (it
    takes raw pixels when the export has the prologue) and recorded: kept when it passed."""
    with in_step(Step.variants):
        for maker in makers:
            with progress.step(f"{maker[0].name}-{name}: made and gated") as end:
                artifact = make_artifact(staging, manifest, name, maker)
                if artifact is None:
                    end.result = "not made for this artifact"
                    continue
                report, error = None, artifact.error
                if artifact.loaded is not None:
                    try:
                        report = gate_variant(fused, artifact.loaded, gate_config, key, fused.contract.preprocess)
                    except Exception as exc:  # noqa: BLE001 - an artifact that cannot run is recorded, not raised
                        error = f"{type(exc).__name__}: {first_line(exc)}"
                manifest = record_artifact(staging, manifest, name, artifact, report, error, notes)
                end.result = (f"could not be made: {error.split(':')[0]}" if error is not None else
                              "kept: passed its gate" if report is not None and report.passed else
                              "dropped: missed its gate")
        finish_variant(staging, name)
    return manifest


def _one_example(fused: Fused) -> Tuple[Any, ...]:
    """One sample of the example inputs (all of them without a sample axis)."""
    inputs = tuple(fused.example_inputs or ())
    return tuple(with_rows(inputs, fused.signature.input_axes(), 1)) if fused.signature.batched else inputs


def _make_variant(variant: Variant, options: VariantOptions, fused: Fused, gate_config: ParityConfig, key: str,
                  rehearsal: bool, progress: Progress) -> Union[MadeVariant, VariantOutcome]:
    """The variant's model, or the outcome recording why it could not be made (``progress``: told how far a
    calibration is). Its accuracy-aware search gates candidate models against the fused one, as the artifacts are."""
    ctx = VariantContext(fused.example_inputs, list(fused.calibration), fused.signature,
                         functools.partial(gate_variant, fused, config=gate_config, config_key=key), progress)
    try:
        with in_step(Step.variants):
            return variant.build(fused.result.graph_module, options.for_rehearsal() if rehearsal else options, ctx)
    except FXLightningError as exc:  # dropped with its reason, in the preflight too: a lossy variant is never
        return VariantOutcome(variant.key, False, error=f"{type(exc).__name__}: {first_line(exc)}")  # worth a stop


def export_notes(manifest: Manifest, rehearsal: bool = False) -> List[Note]:
    """What the export's manifest tells the user: its own notes (a static batch, say), formats left out, each
    variant's verdict, the selection."""
    notes = list(manifest.notes)
    notes += [FORMAT_NOT_EXPORTED(format=name, reason=reason) for name, reason in manifest.failed_formats.items()]
    for outcomes in manifest.variants.values():
        notes.extend(dict.fromkeys(n for outcome in outcomes for n in outcome.notes))  # how it was made, once
        notes.extend(_variant_note(outcome, rehearsal) for outcome in outcomes)
    if manifest.bench is not None:
        selected = manifest.selected
        if selected is None:
            notes.append(NOTHING_SELECTED())
        else:
            eager = manifest.bench.median("eager", selected.batch_size, selected.traffic)
            speedup = f"; {eager / selected.median_ms:.2f}x eager" if eager else ""  # eager is timed at 1 and
            notes.append(SELECTED(format=selected.format, why=selected.why, speedup=speedup))  # select_batch_size
    return notes


def _variant_note(outcome: VariantOutcome, rehearsal: bool) -> Note:
    if outcome.skipped is not None:
        return VARIANT_SKIPPED(variant=outcome.entry, reason=outcome.skipped)
    if outcome.gate is None:
        return VARIANT_FAILED(artifact=outcome.entry, error=outcome.error or "not made")
    metrics = outcome.gate.metrics
    figures = {"top1_agreement": _rounded(metrics.get("top1_agreement")),
               "accuracy_drop": _rounded(metrics.get("accuracy_drop")),
               "cosine_min": _rounded(metrics.get("cosine_similarity_min"))}
    if outcome.gate.passed:
        return VARIANT_PASSED(artifact=outcome.entry, **figures)
    failures = "; ".join(str(f) for f in outcome.gate.failures)
    return (VARIANT_MISSED_UNTRAINED if rehearsal else VARIANT_MISSED)(artifact=outcome.entry, failures=failures,
                                                                       **figures)


def _rounded(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(float(value), 4)


def select_artifact(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                    rehearsal: bool, progress: Progress) -> Manifest:
    """Time the export's artifacts against the unfused target (eager), sweep the likely winners' throughput, and
    record the table and the pick of ``export.select_strategy`` among those that passed their check.
    ``rehearsal``: one round each, proving every artifact loads and runs at the batch sizes timed, and an error
    when nothing could be selected (nothing would be after training either)."""
    # Without a sample axis the example is timed as it is: one "batch size".
    size = config.export.select_batch_size if fused.signature.batched else 1
    rounds, warmup, finalists = (1, 0, 0) if rehearsal else (15, 3, 3)
    interface = fused.result.interface
    eager = interface.flattened(fused.reference) if interface is not None else fused.reference
    with in_step(Step.selection):
        table = bench_export(staging, manifest=manifest, batch_sizes=sorted({1, size}),
                             baselines={"eager": behind_prologue(eager, fused.contract.preprocess)},
                             rounds=rounds, warmup=warmup,
                             own_process_finalists=finalists,
                             sweep=REHEARSAL_SWEEP if rehearsal else SweepSettings(),
                             steps=progress)
        # The rehearsal's one round proves the sweep runs; its figures cannot judge a latency budget.
        selected = select_by_strategy(table, config.export.select_strategy, size, config.export.select_traffic,
                                      None if rehearsal else config.export.latency_budget_ms)
        if rehearsal and selected is None:
            why = [f"{n}: check failed ({c.reason})" for n, c in table.checks.items() if not c.passed]
            why += [f"{f.artifact} at batch {f.batch_size}: {f.reason}" for f in table.failures if f.artifact != "eager"]
            raise ExportError(f"export.select: fastest: no artifact can be selected at export.select_batch_size "
                              f"{size}: " + ("; ".join(why) or "none was timed"))
    return with_selection(manifest, table, selected)
