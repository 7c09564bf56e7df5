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
import itertools
import os
import warnings
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.batches import (
    InputRule,
    as_args,
    as_example_inputs,
    describe,
    extract_input,
    identity_rule,
    model_device_dtype,
    record_calls,
    to_model,
)
from fx_lightning.capture import eval_copy
from fx_lightning.config import FormatFailure, FuseConfig, ParityConfig, Selection
from fx_lightning.engine import fuse
from fx_lightning.errors import (
    ConfigError,
    ExportError,
    FXLightningError,
    ModelError,
    PassError,
    TraceError,
    first_line,
)
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
from fx_lightning.passes import PassContext, Stage, plan_passes, run_pass
from fx_lightning.pipeline import raw_input
from fx_lightning.pipeline.records import Batches, Exported, Fused, Source
from fx_lightning.pipeline.targets import load_buffers, own_rng, resolve_target, target_example_inputs, whole_model_with
from fx_lightning.provenance import Provenance

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
    "EXAMPLE_INPUTS_USED",
    "KWARGS_NOT_CAPTURED",
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
EXAMPLE_INPUTS_DICT = NoteKind("example_inputs_dict", "example_inputs is a dict (keyword arguments): not used")
EXAMPLE_INPUTS_USED = NoteKind("example_inputs_used", "no data batches: used the example inputs instead")
KWARGS_NOT_CAPTURED = NoteKind("kwargs_not_captured", "the target is called with keyword arguments ({names}); they "
                                                      "are not part of the example inputs given to capture")
STEP_INPUTS = NoteKind("step_inputs", "forward's input could not be taken out of the batches ({batch}), so the "
                                      "LightningModule's {step} ran on them and parity compared the target on the "
                                      "{calls} input(s) it received")
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
    """A working copy of ``source.model`` (eval, on ``source.device``, with ``source.buffers``), the target's
    inputs on the first batch, and the target captured and passed through the configured passes."""
    path, _ = resolve_target(source.model, config.target)
    with own_rng(source.model, source.device), torch.no_grad():
        with in_step(Step.capture):
            reference_whole = eval_copy(source.model, source.device)
            if source.buffers:
                load_buffers(reference_whole, source.buffers)
        reference = reference_whole.get_submodule(path) if path else reference_whole
        with in_step(Step.parity_input):
            data, rule, data_source, data_notes = _parity_data(config, source.batches, source.example_inputs)
            try:
                target_inputs, input_notes = _first_target_inputs(reference_whole, reference, data, rule)
                through_whole = True
            except Exception as exc:  # noqa: BLE001 - the batch is not forward's input: ask the module's own step
                if config.parity.input is not None or not data:
                    raise
                data, input_notes = _inputs_from_step(reference_whole, reference, data, exc)
                target_inputs, rule, through_whole = data[0], identity_rule, False
        with in_step(Step.capture):  # the engine's own errors name capture or passes themselves
            try:
                result = fuse(reference, config, example_inputs=target_inputs)
            except PassError as exc:
                exc.step = exc.step or Step.passes.value
                raise
        with in_step(Step.parity_input):
            calibration = _calibration_inputs(config, reference_whole, reference, source.batches.calibration or data,
                                              rule) if through_whole else list(data[:calibration_batch_count(config)])
    contract = raw_input.contract_for(source.contract, config)
    notes = [*source.notes, *source.batches.notes, *data_notes, *input_notes, *contract.notes]
    if not config.parity.enabled:
        notes.append(PARITY_DISABLED())
    return Fused(path, result, reference, reference_whole, whole_model_with(reference_whole, path, result.graph_module),
                 target_inputs, data, rule, data_source, calibration, notes, through_whole, contract)


def _parity_data(config: FuseConfig, batches: Batches,
                 example_inputs: Any) -> Tuple[List[Any], InputRule, str, List[Note]]:
    """The batches parity reads, the rule that takes forward's inputs out of them, their source, and notes."""
    wanted = config.parity.max_batches if config.parity.enabled else 1
    data = list(itertools.islice(iter(batches.items), wanted))
    notes: List[Note] = []
    if isinstance(example_inputs, Mapping):
        # Lightning allows a dict of keyword arguments here; capture and export take positional ones.
        notes.append(EXAMPLE_INPUTS_DICT())
        example_inputs = None
    model_inputs = as_example_inputs(example_inputs)
    if not data and model_inputs is not None:
        if batches.source != "example":
            notes.append(EXAMPLE_INPUTS_USED())
        return [model_inputs], identity_rule, "example", notes
    return data, config.parity.input, batches.source, notes


def _first_target_inputs(whole: nn.Module, target: nn.Module, data: List[Any],
                         rule: InputRule) -> Tuple[Optional[tuple], List[Note]]:
    """The target's arguments on the first batch (what capture and export trace with), and a note when it also
    takes keyword arguments."""
    if not data:
        return None, []
    device, dtype = model_device_dtype(whole)
    first = as_args(to_model(extract_input(data[0], rule), device, dtype))
    args, kwargs = target_example_inputs(whole, target, first)
    return args, [KWARGS_NOT_CAPTURED(names=tuple(kwargs))] if kwargs else []


def _inputs_from_step(whole: nn.Module, target: nn.Module, data: List[Any],
                      failure: Exception) -> Tuple[List[tuple], List[Note]]:
    """What ``target`` receives while the model's own validation (else training) step runs on each batch: how
    two-view, dict, dataclass and multi-input batches reach it, with no configuration. Raises a ConfigError that
    says what was tried, with the batch's types and shapes, when that does not work either."""
    step_errors: List[str] = []
    for name in ("validation_step", "training_step"):
        step = getattr(whole, name, None)
        if not callable(step):
            continue
        try:
            calls = [args for i, batch in enumerate(data) for args, _ in _step_calls(whole, target, step, batch, i)]
        except Exception as exc:  # noqa: BLE001 - the user's own step; said below
            step_errors.append(f"{name} raised {type(exc).__name__}: {first_line(exc)}")
            continue
        if calls:
            return calls, [STEP_INPUTS(batch=describe(data[0]), step=name, calls=len(calls))]
        step_errors.append(f"{name} never called the target")
    if any(e.startswith(f"{name} raised {type(failure).__name__}: {first_line(failure)}")
           for e in step_errors for name in ("validation_step", "training_step")):
        raise ModelError(  # the model's own step fails the same way: the data is right, the model cannot run
            f"the model's own forward raises on the data ({describe(data[0])}), in its steps too: "
            f"{type(failure).__name__}: {first_line(failure)}") from failure
    raise ConfigError(
        f"parity.input: forward's input could not be taken out of the batch ({describe(data[0])}): "
        f"{type(failure).__name__}: {first_line(failure)}"
        + (f"; and on the batch, the LightningModule's {'; its '.join(step_errors)}" if step_errors else "")
        + ". Set parity.input to the key, index or 'pkg.module:function' that gives forward's input."
    ) from failure


def _step_calls(whole: nn.Module, target: nn.Module, step: Any, batch: Any, index: int) -> List[Tuple[tuple, dict]]:
    """Run ``step(batch, index)`` on the working copy with no trainer attached (its ``self.log`` warns and returns)
    and return the ``(args, kwargs)`` of every call of ``target``."""
    device, dtype = model_device_dtype(whole)
    attached = getattr(whole, "_trainer", None)
    with record_calls(target) as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if attached is not None:
                whole._trainer = None
            step(to_model(batch, device, dtype), index)
        finally:
            if attached is not None:
                whole._trainer = attached
    return [(args, kwargs) for args, kwargs, _ in calls]


def calibration_batch_count(config: FuseConfig) -> int:
    """How many batches the enabled variant passes calibrate on (0: none is enabled)."""
    wanted = [options for spec, options in plan_passes(config.passes) if spec.stage is Stage.variant]
    return max((getattr(options, "calibration_batches", 1) for options in wanted), default=0)


def _calibration_inputs(config: FuseConfig, whole: nn.Module, target: nn.Module, data: List[Any],
                        rule: InputRule) -> List[tuple]:
    """The target's inputs on the parity batches, for the variant passes (int8) when one is enabled."""
    count = calibration_batch_count(config)
    if not count:
        return []
    device, dtype = model_device_dtype(whole)
    return [target_example_inputs(whole, target, as_args(to_model(extract_input(b, rule), device, dtype)))[0]
            for b in data[:count]]


# --------------------------------------------------------------------------------------------- verify


def measure(fused: Fused, config: FuseConfig) -> Optional[ParityState]:
    """Parity of the fused target against the reference on this process's batches (None when disabled)."""
    if not config.parity.enabled:
        return None
    with in_step(Step.parity), own_rng(fused.reference_whole), torch.no_grad():
        _, dtype = model_device_dtype(fused.reference_whole)
        precise = copy.deepcopy(fused.reference).double() if dtype in _LOW_PRECISION else None
        whole = bool(fused.target) and fused.through_whole
        state = measure_parity(
            fused.reference, fused.result.graph_module, fused.data, config.parity,
            whole_reference=fused.reference_whole if whole else None,
            whole_candidate=fused.fused_model if whole else None,
            input_rule=fused.input_rule, label_rule=None if fused.through_whole else _no_labels,
            source=fused.source, precise_reference=precise,
        )
        raw_path = raw_input.measure_raw_path(fused)  # with a prologue: the batches as raw pixels, too
        state.notes += [raw_path] if raw_path is not None else []
        return state


def _no_labels(_: Any) -> None:
    """The target's own inputs carry no labels."""
    return None


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
    not at all. ``rehearsal`` (the preflight): a format, a variant or the selection that cannot run is an error,
    a variant's gate is measured but not required, and the selection times each artifact once."""
    if fused.example_inputs is None:
        raise ConfigError(f"export to {directory}: no example inputs (no data batches and no example_inputs); the "
                          "exporter needs them to write the fused model")
    directory = Path(os.path.abspath(directory))
    if rehearsal:
        config = dataclasses.replace(config, export=dataclasses.replace(
            config.export, on_format_failure=FormatFailure["raise"]))
    with in_step(Step.export):
        example, reference = raw_input.export_inputs(fused)  # raw inputs with a prologue (export.preprocess)
        ctx = prepare_export(fused.result.graph_module, example, config, directory, preprocess=fused.contract.preprocess,
                             normalised_dtype=raw_input.normalised_dtype(fused), reference=reference)

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
        precision = getattr(options, "PRECISION", "") or spec.name
        lacking = cpu_info().lacks(precision) if getattr(options, "require_cpu_features", False) else None
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
                        staging, manifest, made.variant_name, made.variant,
                        raw_input.example_raw(tuple(fused.example_inputs or ()), preprocess), config, artifact_gate,
                        imports=made.variant_imports, notes=made.variant_notes, preprocess=preprocess,
                        normalised_dtype=raw_input.normalised_dtype(fused))
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


def _run_variant_pass(spec: Any, options: Any, fused: Fused, gate: Any, rehearsal: bool) -> Any:
    """The variant pass's result, or (after training) the outcome recording why it could not be made."""
    if rehearsal and hasattr(options, "max_float_layers"):
        # The untrained model misses any gate: prove the accuracy-aware search runs, on one layer and one batch.
        options = dataclasses.replace(options, max_float_layers=min(options.max_float_layers, 1), ranking_batches=1)
    ctx = PassContext(capture_mode=fused.result.report.capture_mode, example_inputs=fused.example_inputs,
                      calibration=fused.calibration, gate=gate)
    try:
        with in_step(Step.variants):
            return run_pass(spec, fused.result.graph_module, options, ctx)
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
    """A lossy variant against the fp32 fused model on the parity batches: cosine, top-1 agreement, accuracy drop.
    ``preprocess``: ``loaded`` takes raw pixels (an artifact with the prologue)."""
    through = bool(fused.target) and fused.through_whole
    reference, loaded = raw_input.variant_gate_models(fused.result.graph_module, loaded, preprocess)
    whole = whole_model_with(fused.fused_model, fused.target, loaded) if through else loaded
    whole_reference = fused.fused_model if preprocess is None else whole_model_with(fused.fused_model, fused.target,
                                                                                    reference)
    state = measure_parity(reference, loaded, fused.data, config, whole_reference=whole_reference if through else None,
                           whole_candidate=whole if through else None, input_rule=fused.input_rule,
                           label_rule=None if fused.through_whole else _no_labels, source=fused.source, nested=False)
    return judge_parity(state, config, lossy=True, config_key=config_key)


def select_artifact(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                    rehearsal: bool = False) -> Manifest:
    """Time the export's artifacts against the unfused target (eager) and record the table and the fastest that
    passed its check. ``rehearsal``: one round each, proving every artifact loads and runs at the batch sizes
    timed, and an error when nothing could be selected (nothing would be after training either)."""
    size = config.export.select_batch_size
    rounds, warmup, finalists = (1, 0, 0) if rehearsal else (15, 3, 3)
    with in_step(Step.selection):
        table = bench_export(staging, manifest=manifest, batch_sizes=sorted({1, size}),
                             baselines={"eager": raw_input.eager_baseline(fused.reference, fused.contract.preprocess)},
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
