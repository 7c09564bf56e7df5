"""The pipeline's steps, each a named function that takes what it needs and returns a typed result:

    fuse_target    a working copy of the model, the target's inputs, capture + passes  -> Fused
    measure        parity measured on this process's batches (no verdict, no collective) -> ParityState
    judge          the gate, once, on the (merged) measurements                         -> ParityReport
    export         the formats, the variants and the selection, written in one staging directory and renamed into
                   place once                                                            -> Exported
      write_formats (export.writer), add_variants, select_artifact: the parts of the export

:func:`fx_lightning.pipeline.driver.run_pipeline` runs them for the callback, the CLI and the preflight. An error
leaving a step names the step (``FXLightningError.step``); a foreign exception is wrapped once, in the error type
of the step's condition.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from fx_lightning.batches import model_device_dtype
from fx_lightning.calls import Call, tree_of_call
from fx_lightning.capture import eval_copy
from fx_lightning.config import FuseConfig, ParityConfig, Selection
from fx_lightning.engine import FuseResult, fuse
from fx_lightning.errors import (
    ConfigError,
    ExportError,
    FXLightningError,
    PassError,
    TraceError,
    first_line,
)
from fx_lightning.export.interface import for_sizes
from fx_lightning.export.manifest import Manifest, Preprocess, VariantOutcome
from fx_lightning.export.selection import bench_export, select_fastest, with_selection
from fx_lightning.export.variants import (
    add_format_variants,
    add_variant,
    skip_variant,
    torch_variant_formats,
)
from fx_lightning.export.writer import prepare_export, write_export
from fx_lightning.machine import cpu_info
from fx_lightning.notes import Note, NoteKind
from fx_lightning.parity.gate import ParityState, judge_parity, measure_parity
from fx_lightning.parity.report import ParityReport
from fx_lightning.passes import PassContext, PassSpec, Stage, plan_passes, run_pass
from fx_lightning.passes.lossy import LossyOptions, MadeVariant
from fx_lightning.pipeline import raw_input
from fx_lightning.pipeline.inputs import calibration_steps, signature_for, target_steps
from fx_lightning.pipeline.records import Batches, Exported, Fused, ObservedStep, Source
from fx_lightning.pipeline.targets import load_buffers, own_rng, resolve_target, whole_model_with
from fx_lightning.provenance import Provenance
from fx_lightning.signature import Signature

__all__ = [
    "Step",
    "Batches",
    "Source",
    "Fused",
    "Exported",
    "in_step",
    "fuse_target",
    "measure",
    "judge",
    "export",
    "add_variants",
    "calibration_batch_count",
    "select_artifact",
    "PARITY_DISABLED",
    "FORMAT_NOT_EXPORTED",
    "VARIANT_PASSED",
    "VARIANT_MISSED",
    "VARIANT_MISSED_UNTRAINED",
    "VARIANT_FAILED",
    "VARIANT_SKIPPED",
    "SELECTED",
    "NOTHING_SELECTED",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Step(str, Enum):
    """The stages errors and reports name: the preflight's checks that need no model, then the pipeline's steps."""

    device = "device"
    target = "target"
    weights = "weights"
    export_directory = "export directory"
    export_dependencies = "export dependencies"
    preprocess = "export.preprocess"  # the input normalisation to compile into the export, and where it came from
    parity_input = "parity input"  # the batches, and what the target receives from them
    capture = "capture"
    passes = "passes"
    parity = "parity"
    export = "export"
    variants = "variants"
    selection = "selection"


# The error type of the condition a foreign exception leaving a step means; a crash elsewhere (the model's own
# forward while parity runs, say) is none of ours: FXLightningError, with the step named.
_STEP_ERRORS = {Step.capture: TraceError, Step.passes: PassError, Step.export: ExportError,
                Step.variants: ExportError, Step.selection: ExportError}

PARITY_DISABLED = NoteKind("parity_disabled", "parity check disabled (parity.enabled: false): the fused model was "
                                              "not verified")
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
SELECTED = NoteKind("selected", "load_fused selects {format}: {why}; {speedup}x eager")
NOTHING_SELECTED = NoteKind("nothing_selected", "export.select: fastest: no artifact passed its check; load_fused "
                                                "falls back to the order of preference")


@contextlib.contextmanager
def in_step(step: Step) -> Iterator[None]:
    """Name ``step`` in an error leaving the block (unless it names one already); a foreign exception is wrapped
    once in the error type of the step's condition."""
    try:
        yield
    except FXLightningError as exc:
        exc.step = exc.step or step.value
        raise
    except Exception as exc:
        error = _STEP_ERRORS.get(step, FXLightningError)(f"{type(exc).__name__}: {exc}")
        error.step = step.value
        raise error from exc


# ----------------------------------------------------------------------------------------------- fuse


def fuse_target(source: Source, config: FuseConfig) -> Fused:
    """A working copy of ``source.model`` (eval, on ``source.device``, with ``source.buffers``), what the target
    receives (:mod:`.inputs`: the calls observed during fit, else taken from the batches), the signature those calls
    show, and the target captured and passed through the configured passes."""
    observed = source.observed
    path = observed.target if observed is not None else resolve_target(source.model, config.target)[0]
    with own_rng(source.model, source.device), torch.no_grad():
        with in_step(Step.capture):
            reference_whole = eval_copy(source.model, source.device)
            if source.buffers:
                load_buffers(reference_whole, source.buffers)
        reference = reference_whole.get_submodule(path) if path else reference_whole
        with in_step(Step.parity_input):
            found = target_steps(config, source, reference_whole, reference, path)
            if not found.steps:
                raise ConfigError("parity.data: no batches and no example inputs: capture, parity and export need "
                                  "the target's inputs")
            signature = signature_for(reference, found.steps, observed)
        with in_step(Step.capture):  # the engine's own errors name capture or passes themselves
            try:
                result = fuse(reference, config, example_inputs=found.steps[0].target, signature=signature,
                              check_inputs=_other_sizes(found.steps))
            except PassError as exc:
                exc.step = exc.step or Step.passes.value
                raise
        if result.interface is not None and result.interface.flat:  # the artifact takes one tensor per leaf
            signature = dataclasses.replace(signature, flat=True)
        with in_step(Step.parity_input):
            calibration = calibration_steps(config, source, reference_whole, reference, path, found,
                                            calibration_batch_count(config))
    contract = raw_input.contract_for(source.contract, config)
    notes = [*source.notes, *source.batches.notes, *found.notes, *contract.notes]
    if not config.parity.enabled:
        notes.append(PARITY_DISABLED())
    candidate = _candidate(result, signature)
    fused = Fused(path, result, reference, reference_whole, whole_model_with(reference_whole, path, candidate),
                  result.example_inputs, found.steps, signature, found.source, [], notes, found.through_whole,
                  contract, candidate)
    fused.calibration = [fused.graph_inputs(call) for call in calibration]
    return fused


def _candidate(result: FuseResult, signature: Signature) -> nn.Module:
    """The fused model as parity runs it, called as the original is: a graph fixed to its capture's sizes runs
    another number of samples as pieces of its own along a proven sample axis, and refuses other sizes by name."""
    graph: nn.Module = result.graph_module
    if result.static_shapes is not None:
        graph = for_sizes(graph, signature, result.static_shapes, "the fused model (captured for these sizes only)")
    return result.interface.structured(graph) if result.interface is not None else graph


def _other_sizes(steps: Sequence[ObservedStep]) -> List[Call]:
    """The calls whose shapes differ from the first's (and from each other's): what a capture must also take."""
    seen = {_shapes(steps[0].target)}
    out = []
    for step in steps[1:]:
        key = _shapes(step.target)
        if key not in seen:
            seen.add(key)
            out.append(step.target)
    return out


def _shapes(call: Call) -> Tuple[Tuple[int, ...], ...]:
    return tuple(tuple(t.shape) for t in tree_of_call(call).leaves(call))


def calibration_batch_count(config: FuseConfig) -> int:
    """How many batches the enabled variant passes calibrate on (0: none is enabled)."""
    wanted = [options for spec, options in plan_passes(config.passes) if spec.stage is Stage.variant]
    return max((getattr(options, "calibration_batches", 1) for options in wanted), default=0)


# --------------------------------------------------------------------------------------------- verify


def measure(fused: Fused, config: FuseConfig) -> Optional[ParityState]:
    """Parity of the fused target against the reference on this process's steps (None when disabled)."""
    if not config.parity.enabled:
        return None
    with in_step(Step.parity), own_rng(fused.reference_whole), torch.no_grad():
        _, dtype = model_device_dtype(fused.reference_whole)
        precise = copy.deepcopy(fused.reference).double() if dtype in _LOW_PRECISION else None
        state = _measure_steps(fused, fused.reference, fused.candidate, fused.fused_model, config.parity,
                               precise=precise)
        raw_path = raw_input.measure_raw_path(fused)  # with a prologue: the batches as raw pixels, too
        state.notes += [raw_path] if raw_path is not None else []
        return state


def _measure_steps(fused: Fused, reference: nn.Module, candidate: nn.Module, whole_candidate: nn.Module,
                   cfg: ParityConfig, *, precise: Optional[nn.Module] = None, nested: bool = True) -> ParityState:
    """``candidate`` against ``reference`` on the fused model's steps: through the whole models (the candidate in
    place) when the steps recorded the whole model's calls, else on the target's own calls."""
    whole = fused.through_whole
    return measure_parity(
        reference, candidate, fused.steps, cfg,
        whole_reference=fused.reference_whole if whole else None, whole_candidate=whole_candidate if whole else None,
        input_rule=_whole_call if whole else _target_call, label_rule=_labels, source=fused.source,
        precise_reference=precise, nested=nested, stochastic=_stochastic(fused))


def _stochastic(fused: Fused) -> List[int]:
    """The target's outputs drawn at random in forward (by position among its tensors)."""
    return [i for i, leaf in enumerate(fused.signature.outputs) if leaf.stochastic]


def _whole_call(step: ObservedStep) -> Call:
    assert step.whole is not None
    return step.whole


def _target_call(step: ObservedStep) -> Call:
    return step.target


def _labels(step: ObservedStep) -> Optional[torch.Tensor]:
    return step.labels


def judge(state: Optional[ParityState], config: FuseConfig) -> Optional[ParityReport]:
    """The gate on ``state`` (one process's, or the merge of every rank's); None when parity is disabled."""
    if state is None:
        return None
    with in_step(Step.parity):
        return raw_input.judge_raw_path(judge_parity(state, config.parity))


# --------------------------------------------------------------------------------------------- export


def export(fused: Fused, config: FuseConfig, parity: Optional[ParityReport], directory: Path,
           provenance: Provenance, *, rehearsal: bool = False) -> Exported:
    """Write the fused model: every format (each loaded back and checked), the variants and the selection, all in
    one staging directory renamed to ``directory`` (made absolute) at the end, so the export appears complete or
    not at all. ``rehearsal`` (the preflight): as the end of fit will (a format that cannot be written is skipped
    with a note under ``export.on_format_failure: skip``), except that a variant or the selection that cannot run
    is an error, a variant's gate is measured but not required, and the selection times each artifact once."""
    if fused.example_inputs is None:
        raise ConfigError(f"export to {directory}: no example inputs (no data batches and no example_inputs); the "
                          "exporter needs them to write the fused model")
    directory = Path(os.path.abspath(directory))
    with in_step(Step.export):
        example, reference = raw_input.export_inputs(fused)  # raw inputs with a prologue (export.preprocess)
        ctx = prepare_export(fused.result.graph_module, example, config, directory, preprocess=fused.contract.preprocess,
                             normalised_dtype=raw_input.normalised_dtype(fused), reference=reference,
                             signature=fused.signature, other_inputs=_other_inputs(fused), fixed=_fixed(fused),
                             no_program=_no_program(fused))

    def variants_and_selection(staging: Path, manifest: Manifest) -> Manifest:
        manifest = raw_input.with_contract(manifest, fused.contract)
        manifest = add_variants(staging, manifest, fused, config, rehearsal=rehearsal)
        if config.export.select is Selection.fastest:
            manifest = select_artifact(staging, manifest, fused, config, rehearsal=rehearsal)
        return manifest

    with in_step(Step.export):
        manifest = write_export(directory, ctx, config, report=fused.result.report, parity=parity,
                                provenance=provenance, extend=variants_and_selection)
    steps = [Step.export.value] + ([Step.variants.value] if manifest.variants else []) + (
        [Step.selection.value] if config.export.select is Selection.fastest else [])
    return Exported(directory, manifest, export_notes(manifest, rehearsal), steps)


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
    return [raw_input.example_raw(fused.graph_inputs(call), preprocess) for call in _other_sizes(fused.steps)]


def add_variants(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                 rehearsal: bool = False) -> Manifest:
    """Make each enabled lossy variant (int8, bf16) of the verified fused model: the variant pass's model in the
    torch formats, and each exported format's own variant (OpenVINO through NNCF, ONNX Runtime); keep the
    artifacts that pass the variant's gate, loaded back. Every outcome is recorded in the manifest, and a variant
    this CPU cannot run fast is skipped with the reason. A variant that cannot be made is an error in the
    rehearsal (which runs the accuracy-aware search on one layer, to prove it runs), and a recorded outcome after
    training (the fp32 artifacts stand)."""
    for spec, options in plan_passes(config.passes):
        if spec.stage is not Stage.variant:
            continue
        precision = options.PRECISION  # a variant pass's options are LossyOptions (declared so in the schema)
        lacking = cpu_info().lacks(precision) if options.require_cpu_features else None
        if lacking is not None:
            manifest = skip_variant(manifest, precision, f"{lacking}; passes.{spec.name}.require_cpu_features: "
                                                         "false makes it anyway")
            continue
        gate_config = dataclasses.replace(config.parity, min_cosine=options.min_cosine,
                                          min_top1_agreement=options.min_top1_agreement,
                                          max_accuracy_drop=options.max_accuracy_drop)
        key, preprocess = f"passes.{spec.name}", fused.contract.preprocess

        def gate(loaded: nn.Module, gate_config: ParityConfig = gate_config, key: str = key) -> ParityReport:
            return _gate_variant(fused, loaded, gate_config, key)

        def artifact_gate(loaded: nn.Module, gate_config: ParityConfig = gate_config, key: str = key) -> ParityReport:
            return _gate_variant(fused, loaded, gate_config, key, preprocess)  # it takes raw pixels (the prologue)

        outcomes: List[VariantOutcome] = []
        if torch_variant_formats(config, precision):
            made = _run_variant_pass(spec, options, fused, gate, rehearsal)
            if isinstance(made, VariantOutcome):
                manifest = dataclasses.replace(manifest, variants={**manifest.variants, precision: [made]})
                outcomes.append(made)
            else:
                with in_step(Step.variants):
                    manifest, made_outcomes = add_variant(
                        staging, manifest, made.precision, made.model,
                        raw_input.example_raw(tuple(fused.example_inputs or ()), preprocess), config, artifact_gate,
                        imports=made.imports, notes=made.notes, preprocess=preprocess,
                        normalised_dtype=raw_input.normalised_dtype(fused), signature=fused.signature,
                        other_inputs=_other_inputs(fused), fixed=_fixed(fused))
                outcomes += made_outcomes
        with in_step(Step.variants):
            manifest, format_outcomes = add_format_variants(
                staging, manifest, precision, raw_input.raw_calibration(fused.calibration, preprocess), artifact_gate)
        outcomes += format_outcomes
        broken = next((o for o in outcomes if o.error is not None), None)
        if rehearsal and broken is not None:
            error = ExportError(f"{broken.entry} could not be made: {broken.error}")
            error.step = Step.variants.value
            raise error
    return manifest


def _run_variant_pass(spec: PassSpec, options: LossyOptions, fused: Fused, gate: Any,
                      rehearsal: bool) -> Union[MadeVariant, VariantOutcome]:
    """The variant pass's result, or (after training) the outcome recording why it could not be made."""
    if rehearsal:
        options = options.for_rehearsal()
    ctx = PassContext(capture_mode=fused.result.report.capture_mode, example_inputs=fused.example_inputs,
                      signature=fused.signature,
                      calibration=fused.calibration, gate=gate)
    try:
        with in_step(Step.variants):
            made = run_pass(spec, fused.result.graph_module, options, ctx)
        if not isinstance(made, MadeVariant) or made.model is None:
            raise PassError(f"variant pass {spec.name!r} made no model: a variant pass returns a MadeVariant "
                            "(fx_lightning.passes.lossy) with the model it made")
        return made
    except FXLightningError as exc:
        if rehearsal:  # a variant that cannot be made now cannot be made after training either
            raise
        return VariantOutcome(spec.name, False, error=f"{type(exc).__name__}: {first_line(exc)}")


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
            notes.append(SELECTED(format=selected.format, why=selected.why,
                                  speedup=round(eager / selected.median_ms, 2) if eager else None))
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


def _gate_variant(fused: Fused, loaded: nn.Module, config: ParityConfig, config_key: str,
                  preprocess: Optional[Preprocess] = None) -> ParityReport:
    """A lossy variant against the fp32 fused model on the parity steps: cosine, top-1 agreement, accuracy drop.
    ``preprocess``: ``loaded`` takes raw pixels (an artifact with the prologue)."""
    reference, loaded = raw_input.variant_gate_models(fused.candidate, fused.result.interface.structured(loaded)
                                                      if fused.result.interface is not None else loaded, preprocess)
    whole_reference = fused.fused_model if preprocess is None else whole_model_with(fused.fused_model, fused.target,
                                                                                    reference)
    whole_candidate = whole_model_with(fused.fused_model, fused.target, loaded)
    state = measure_parity(reference, loaded, fused.steps, config,
                           whole_reference=whole_reference if fused.through_whole else None,
                           whole_candidate=whole_candidate if fused.through_whole else None,
                           input_rule=_whole_call if fused.through_whole else _target_call, label_rule=_labels,
                           source=fused.source, nested=False,
                           stochastic=_stochastic(fused))
    return judge_parity(state, config, lossy=True, config_key=config_key)


def select_artifact(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                    rehearsal: bool = False) -> Manifest:
    """Time the export's artifacts against the unfused target (eager) and record the table and the fastest that
    passed its check. ``rehearsal``: one round each, proving every artifact loads and runs at the batch sizes
    timed, and an error when nothing could be selected (nothing would be after training either)."""
    # Without a sample axis the example is timed as it is: one "batch size".
    size = config.export.select_batch_size if fused.signature.batched else 1
    rounds, warmup, finalists = (1, 0, 0) if rehearsal else (15, 3, 3)
    interface = fused.result.interface
    eager = interface.flattened(fused.reference) if interface is not None else fused.reference
    with in_step(Step.selection):
        table = bench_export(staging, manifest=manifest, batch_sizes=sorted({1, size}),
                             baselines={"eager": raw_input.eager_baseline(eager, fused.contract.preprocess)},
                             rounds=rounds, warmup=warmup,
                             own_process_finalists=finalists)
        selected = select_fastest(table, size, config.export.select_traffic)
        if rehearsal and selected is None:
            why = [f"{n}: check failed ({c.reason})" for n, c in table.checks.items() if not c.passed]
            why += [f"{f.artifact} at batch {f.batch_size}: {f.reason}" for f in table.failures if f.artifact != "eager"]
            raise ExportError(f"export.select: fastest: no artifact can be selected at export.select_batch_size "
                              f"{size}: " + ("; ".join(why) or "none was timed"))
    return with_selection(manifest, table, selected)


def provenance_for(fused: Fused, source: Source, base: Provenance) -> Provenance:
    """What the manifest records about where the model came from: ``base`` (the caller's), the target and the
    weights this process fused."""
    return dataclasses.replace(base, target=fused.target, weights=source.weights or base.weights)


def sequence_steps(*groups: Sequence[str]) -> List[str]:
    """Steps in order, each once."""
    return list(dict.fromkeys(s for g in groups for s in g))
