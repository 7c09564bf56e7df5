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
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.batches import (
    InputRule,
    as_args,
    as_example_inputs,
    detached,
    extract_input,
    identity_rule,
    model_device_dtype,
    to_model,
)
from fx_lightning.capture import eval_copy
from fx_lightning.config import FormatFailure, FuseConfig, ParityConfig, Selection
from fx_lightning.engine import FuseResult, fuse
from fx_lightning.errors import ConfigError, ExportError, FXLightningError, ParityError, PassError, TraceError
from fx_lightning.export.atomic import staging_directory
from fx_lightning.export.manifest import Manifest, write_manifest
from fx_lightning.export.selection import bench_export, select_fastest, with_selection
from fx_lightning.export.variants import add_variant
from fx_lightning.export.writer import prepare_export, write_formats
from fx_lightning.notes import Note, NoteKind
from fx_lightning.parity.gate import ParityState, judge_parity, measure_parity
from fx_lightning.parity.report import ParityReport
from fx_lightning.passes import PassContext, Stage, plan_passes, run_pass
from fx_lightning.pipeline.targets import load_buffers, own_rng, resolve_target, target_example_inputs, whole_model_with
from fx_lightning.provenance import Provenance, WeightsInfo

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
    "select_artifact",
    "PARITY_DISABLED",
    "EXAMPLE_INPUTS_USED",
    "KWARGS_NOT_CAPTURED",
    "FORMAT_NOT_EXPORTED",
    "VARIANT_GATED",
    "VARIANT_FAILED",
    "SELECTED",
    "NOTHING_SELECTED",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class Step(str, Enum):
    """The pipeline's steps, as errors and reports name them."""

    parity_input = "parity input"  # the batches, and what the target receives from them
    capture = "capture"
    passes = "passes"
    parity = "parity"
    export = "export"
    variants = "variants"
    selection = "selection"


# The error type of each step's condition, for a foreign exception that leaves it.
_STEP_ERRORS = {Step.parity_input: ConfigError, Step.capture: TraceError, Step.passes: PassError,
                Step.parity: ParityError, Step.export: ExportError, Step.variants: ExportError,
                Step.selection: ExportError}

PARITY_DISABLED = NoteKind("parity_disabled", "parity check disabled (parity.enabled: false): the fused model was "
                                              "not verified")
EXAMPLE_INPUTS_DICT = NoteKind("example_inputs_dict", "example_inputs is a dict (keyword arguments): not used")
EXAMPLE_INPUTS_USED = NoteKind("example_inputs_used", "no data batches: used the example inputs instead")
KWARGS_NOT_CAPTURED = NoteKind("kwargs_not_captured", "the target is called with keyword arguments ({names}); they "
                                                      "are not part of the example inputs given to capture")
FORMAT_NOT_EXPORTED = NoteKind("format_not_exported", "format {format} not exported ({reason})")
VARIANT_GATED = NoteKind("variant_gated", "{artifact} {verdict} (top-1 agreement {top1_agreement}, accuracy drop "
                                          "{accuracy_drop}, worst cosine {cosine_similarity_min}){consequence}")
VARIANT_FAILED = NoteKind("variant_failed", "{artifact} could not be made: {error}; the fp32 artifacts stand")
SELECTED = NoteKind("selected", "load_fused selects {format}: {why}{speedup}")
NOTHING_SELECTED = NoteKind("nothing_selected", "export.select: fastest: no artifact passed its check; load_fused "
                                                "falls back to the order of preference")


@dataclass
class Batches:
    """Data batches for parity and where they came from."""

    items: List[Any]
    source: str = "given"  # val | train | example | given
    notes: List[Note] = field(default_factory=list)  # which batches were read and why


@dataclass
class Source:
    """What the driver works on in one process: the model (never changed), its data, where to work, and what
    loading them proved and found out."""

    model: nn.Module
    batches: Batches
    example_inputs: Any = None  # forward's arguments of the whole model, when there are no batches
    device: Optional[torch.device] = None  # where the working copy is fused, checked and exported
    buffers: Optional[Mapping[str, torch.Tensor]] = None  # loaded into the working copy (rank zero's, under DDP)
    buffers_differ: bool = False  # this process's buffers differed from the ones loaded
    calibration: Optional[Batches] = None  # for the variant passes (int8); default the parity batches
    weights: Optional[WeightsInfo] = None
    checked: List[str] = field(default_factory=list)  # what loading proved (the preflight's checks)
    notes: List[Note] = field(default_factory=list)


@dataclass
class Fused:
    """One process's fused model before any verdict, with what the later steps need."""

    target: str  # dotted path of the fused submodule; "" when the whole model was fused
    result: FuseResult
    reference: nn.Module  # the unfused target (eval copy): parity's reference, the eager baseline when timing
    reference_whole: nn.Module  # the whole model's eval copy
    fused_model: nn.Module  # the whole model (eval mode) with the fused target in place
    example_inputs: Optional[tuple]  # the target's inputs on the first batch (capture and export trace with them)
    data: List[Any]  # the parity batches, and the rule taking forward's inputs out of them
    input_rule: InputRule
    source: str
    calibration: List[tuple] = field(default_factory=list)  # the target's inputs on calibration batches
    notes: List[Note] = field(default_factory=list)


@dataclass
class Exported:
    directory: Path
    manifest: Optional[Manifest] = None
    notes: List[Note] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)


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
        error = _STEP_ERRORS[step](f"{type(exc).__name__}: {exc}")
        error.step = step.value
        raise error from exc


# ----------------------------------------------------------------------------------------------- fuse


def fuse_target(source: Source, config: FuseConfig) -> Fused:
    """A working copy of ``source.model`` (eval, on ``source.device``, with ``source.buffers``), the target's
    inputs on the first batch, and the target captured and passed through the configured passes."""
    path, _ = resolve_target(source.model, config.target)
    notes = list(source.notes) + list(source.batches.notes)
    with own_rng(source.model, source.device), torch.no_grad():
        reference_whole = eval_copy(source.model, source.device)
        if source.buffers:
            load_buffers(reference_whole, source.buffers)
        reference = reference_whole.get_submodule(path) if path else reference_whole
        with in_step(Step.parity_input):
            data, rule, data_source = _parity_data(config, source.batches, source.example_inputs, notes)
            target_inputs = _first_target_inputs(reference_whole, reference, data, rule, notes)
        try:
            result = fuse(reference, config, example_inputs=target_inputs)
        except FXLightningError as exc:
            exc.step = exc.step or (Step.passes if isinstance(exc, PassError) else Step.capture).value
            raise
        with in_step(Step.parity_input):
            calibration = _calibration_inputs(config, reference_whole, reference, source.calibration, data, rule)
    if not config.parity.enabled:
        notes.append(PARITY_DISABLED())
    return Fused(path, result, reference, reference_whole, whole_model_with(reference_whole, path, result.graph_module),
                 target_inputs, data, rule, data_source, calibration, notes)


def _parity_data(config: FuseConfig, batches: Batches, example_inputs: Any,
                 notes: List[Note]) -> Tuple[List[Any], InputRule, str]:
    """The batches parity reads, the rule that takes forward's inputs out of them, and their source."""
    wanted = config.parity.max_batches if config.parity.enabled else 1
    data = list(itertools.islice(iter(batches.items), wanted))
    if isinstance(example_inputs, Mapping):
        # Lightning allows a dict of keyword arguments here; capture and export take positional ones.
        notes.append(EXAMPLE_INPUTS_DICT())
        example_inputs = None
    model_inputs = as_example_inputs(example_inputs)
    if not data and model_inputs is not None:
        if batches.source != "example":
            notes.append(EXAMPLE_INPUTS_USED())
        return [model_inputs], identity_rule, "example"
    return data, config.parity.input, batches.source


def _first_target_inputs(whole: nn.Module, target: nn.Module, data: List[Any], rule: InputRule,
                         notes: List[Note]) -> Optional[tuple]:
    """The target's arguments on the first batch (what capture and export trace with)."""
    if not data:
        return None
    device, dtype = model_device_dtype(whole)
    first = as_args(to_model(extract_input(data[0], rule), device, dtype))
    args, kwargs = target_example_inputs(whole, target, first)
    if kwargs:
        notes.append(KWARGS_NOT_CAPTURED(names=", ".join(kwargs)))
    return args


def _calibration_inputs(config: FuseConfig, whole: nn.Module, target: nn.Module, calibration: Optional[Batches],
                        data: List[Any], rule: InputRule) -> List[tuple]:
    """The target's inputs on the calibration batches, when a variant pass (int8) is enabled."""
    wanted = [options for spec, options in plan_passes(config.passes) if spec.stage is Stage.variant]
    if not wanted:
        return []
    count = max(getattr(options, "calibration_batches", 8) for options in wanted)
    items = calibration.items if calibration is not None and calibration.items else data
    rule = config.parity.input if calibration is not None and calibration.items else rule
    device, dtype = model_device_dtype(whole)
    return [target_example_inputs(whole, target, as_args(to_model(extract_input(b, rule), device, dtype)))[0]
            for b in items[:count]]


# --------------------------------------------------------------------------------------------- verify


def measure(fused: Fused, config: FuseConfig) -> Optional[ParityState]:
    """Parity of the fused target against the reference on this process's batches (None when disabled)."""
    if not config.parity.enabled:
        return None
    with in_step(Step.parity), own_rng(fused.reference_whole), torch.no_grad():
        _, dtype = model_device_dtype(fused.reference_whole)
        precise = copy.deepcopy(fused.reference).double() if dtype in _LOW_PRECISION else None
        whole = bool(fused.target)
        return measure_parity(
            fused.reference, fused.result.graph_module, fused.data, config.parity,
            whole_reference=fused.reference_whole if whole else None,
            whole_candidate=fused.fused_model if whole else None,
            input_rule=fused.input_rule, source=fused.source, precise_reference=precise,
        )


def judge(state: Optional[ParityState], config: FuseConfig) -> Optional[ParityReport]:
    """The gate on ``state`` (one process's, or the merge of every rank's); None when parity is disabled."""
    if state is None:
        return None
    with in_step(Step.parity):
        return judge_parity(state, config.parity)


# --------------------------------------------------------------------------------------------- export


def export(fused: Fused, config: FuseConfig, parity: Optional[ParityReport], directory: Path,
           provenance: Provenance, *, rehearsal: bool = False) -> Exported:
    """Write the fused model: every format (each loaded back and checked), the variants and the selection, all in
    one staging directory renamed to ``directory`` at the end, so the export appears complete or not at all.
    ``rehearsal`` (the preflight): a format, a variant or the selection that cannot run is an error, a variant's
    gate is measured but not required, and the selection times each artifact once."""
    if fused.example_inputs is None:
        raise ConfigError(f"export to {directory}: no example inputs (no data batches and no example_inputs); the "
                          "exporter needs them to write the fused model")
    if rehearsal:
        config = dataclasses.replace(config, export=dataclasses.replace(
            config.export, on_format_failure=FormatFailure["raise"]))
    with in_step(Step.export):
        ctx = prepare_export(fused.result.graph_module, tuple(detached(fused.example_inputs)), config, directory)
    exported = Exported(directory, steps=[Step.export.value])
    try:
        with staging_directory(directory) as staging:
            with in_step(Step.export):
                manifest = write_formats(staging, ctx, config, report=fused.result.report, parity=parity,
                                         provenance=provenance)
            exported.notes += [FORMAT_NOT_EXPORTED(format=name, reason=reason.split(": ", 1)[-1])
                               for name, reason in manifest.failed_formats.items()]
            manifest, notes = add_variants(staging, manifest, fused, config, rehearsal=rehearsal)
            exported.notes += notes
            exported.steps += [Step.variants.value] if manifest.variants else []
            if config.export.select is Selection.fastest:
                manifest, note = select_artifact(staging, manifest, fused, config, rehearsal=rehearsal)
                exported.notes.append(note)
                exported.steps.append(Step.selection.value)
            write_manifest(staging, manifest)
    except FXLightningError as exc:
        exc.message = f"export to {directory} failed: {exc.message}"
        raise
    exported.manifest = manifest
    return exported


def add_variants(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                 rehearsal: bool = False) -> Tuple[Manifest, List[Note]]:
    """Make each enabled variant (int8) of the verified fused model, write it beside the fp32 artifacts and keep
    the artifacts that pass the variant's gate. Returns the manifest and a note per artifact."""
    notes: List[Note] = []
    ctx = PassContext(capture_mode=fused.result.report.capture_mode, example_inputs=fused.example_inputs,
                      calibration=fused.calibration)
    for spec, options in plan_passes(config.passes):
        if spec.stage is not Stage.variant:
            continue
        with in_step(Step.variants):
            made = run_pass(spec, fused.result.graph_module, options, ctx)
            gate_config = dataclasses.replace(config.parity, min_cosine=options.min_cosine,
                                              min_top1_agreement=options.min_top1_agreement,
                                              max_accuracy_drop=options.max_accuracy_drop)
            key = f"passes.{spec.name}"
            manifest, outcomes = add_variant(
                staging, manifest, made.variant_name, made.variant, tuple(fused.example_inputs or ()), config,
                lambda loaded: _gate_variant(fused, loaded, gate_config, key), imports=made.variant_imports)
        for outcome in outcomes:
            if outcome.error is not None:
                if rehearsal:  # a variant that cannot be made now cannot be made after training either
                    raise _variant_error(outcome.entry, outcome.error)
                notes.append(VARIANT_FAILED(artifact=outcome.entry, error=outcome.error))
                continue
            notes.append(_variant_note(outcome.entry, outcome.gate, rehearsal))
    return manifest, notes


def _variant_error(entry: str, error: str) -> ExportError:
    exc = ExportError(f"{entry} could not be made: {error}")
    exc.step = Step.variants.value
    return exc


def _variant_note(entry: str, gate: Optional[ParityReport], rehearsal: bool) -> Note:
    metrics = gate.metrics if gate is not None else {}
    passed = gate is not None and gate.passed
    verdict = "passed its gate" if passed else "missed its gate: " + "; ".join(str(f) for f in (gate.failures if gate else []))
    consequence = "" if passed else ("; measured on the untrained model, the gate applies after training" if rehearsal
                                     else "; the fp32 artifacts stand")
    figure = lambda key: f"{metrics[key]:.4g}" if key in metrics else "n/a"  # noqa: E731
    return VARIANT_GATED(artifact=entry, verdict=verdict, top1_agreement=figure("top1_agreement"),
                         accuracy_drop=figure("accuracy_drop"), cosine_similarity_min=figure("cosine_similarity_min"),
                         consequence=consequence, passed=passed)


def _gate_variant(fused: Fused, loaded: nn.Module, config: ParityConfig, config_key: str) -> ParityReport:
    """A lossy variant against the fp32 fused model on the parity batches: cosine, top-1 agreement, accuracy drop."""
    whole = whole_model_with(fused.fused_model, fused.target, loaded) if fused.target else loaded
    state = measure_parity(fused.result.graph_module, loaded, fused.data, config,
                           whole_reference=fused.fused_model if fused.target else None,
                           whole_candidate=whole if fused.target else None, input_rule=fused.input_rule,
                           source=fused.source, nested=False)
    return judge_parity(state, config, lossy=True, config_key=config_key)


def select_artifact(staging: Path, manifest: Manifest, fused: Fused, config: FuseConfig, *,
                    rehearsal: bool = False) -> Tuple[Manifest, Note]:
    """Time the export's artifacts against the unfused target (eager) and record the fastest that passed its
    check. ``rehearsal``: one round each, proving every artifact loads and runs at the timed batch sizes."""
    size = config.export.select_batch_size
    rounds, warmup = (1, 0) if rehearsal else (15, 3)
    with in_step(Step.selection):
        table = bench_export(staging, manifest=manifest, batch_sizes=sorted({1, size}),
                             baselines={"eager": fused.reference}, rounds=rounds, warmup=warmup)
        selected = select_fastest(table, size)
        if rehearsal and selected is None:  # after training, nothing would be selected either
            why = [f"{n}: check failed ({c.reason})" for n, c in table.checks.items() if not c.passed]
            why += [f"{f.artifact} at batch {f.batch_size}: {f.reason}" for f in table.failures if f.artifact != "eager"]
            raise ExportError(f"export.select: fastest: no artifact can be selected at export.select_batch_size "
                              f"{size}: " + ("; ".join(why) or "none was timed"))
    manifest = with_selection(manifest, table, selected)
    if selected is None:
        return manifest, NOTHING_SELECTED()
    eager = table.median("eager", size)
    speedup = f", {eager / selected.median_ms:.2f}x eager" if eager else ""
    return manifest, SELECTED(format=selected.format, why=selected.why, speedup=speedup)


def provenance_for(fused: Fused, source: Source, base: Provenance) -> Provenance:
    """What the manifest records about where the model came from: ``base`` (the caller's), the target and the
    weights this process fused."""
    return dataclasses.replace(base, target=fused.target, weights=source.weights or base.weights)


def sequence_steps(*groups: Sequence[str]) -> List[str]:
    """Steps in order, each once."""
    return list(dict.fromkeys(s for g in groups for s in g))
