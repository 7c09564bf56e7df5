"""The pipeline's steps, each a named function that takes what it needs and returns a typed result:

    fuse_target    a working copy of the model, the target's inputs, capture + passes  -> Fused
    measure        parity measured on this process's batches (no verdict, no collective) -> ParityState
    judge          the gate, once, on the (merged) measurements                         -> ParityReport
    export         (:mod:`.export_step`) the formats, the variants and the selection     -> Exported

Here too: the step names and the error type each step's failures become (:func:`in_step`), and
:func:`gate_variant` (a lossy variant measured and judged on the same steps as parity).

:func:`fx_lightning.pipeline.driver.run_pipeline` runs them for the callback, the CLI and the preflight. An error
leaving a step names the step (``FXLightningError.step``); a foreign exception is wrapped once, in the error type
of the step's condition.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from enum import Enum
from operator import attrgetter
from typing import Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.common.batches import model_device_dtype
from fx_lightning.common.calls import Call, run_seeded, tree_of_call
from fx_lightning.capture.working_copy import eval_copy
from fx_lightning.config import FuseConfig, ParityConfig
from fx_lightning.pipeline.engine import FuseResult, fuse
from fx_lightning.errors import (
    ExportError,
    FXLightningError,
    PassError,
    TraceError,
    first_line,
    require_inputs,
)
from fx_lightning.export.load.interface import ArtifactInterface, for_sizes
from fx_lightning.export.write.input_contract import resolve_input_contract
from fx_lightning.export.manifest import Preprocess
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.parity.gate import ParityState, judge_parity, measure_parity
from fx_lightning.parity.report import ParityReport
from fx_lightning.pipeline import raw_input
from fx_lightning.pipeline.inputs import (LABELS_LEFT_OUT, TargetSteps, calibration_steps, signature_for, target_steps,
                                         with_stand_ins, without_labels)
from fx_lightning.pipeline.records import Fused, ObservedStep, Source
from fx_lightning.pipeline.targets import (deterministic_inside, inner_calls, load_buffers, own_rng,
                                          random_losses_only, resolve_target, whole_model_with)
from fx_lightning.signature.padding import padding_proven
from fx_lightning.signature.signature import Signature
from fx_lightning.variants import enabled_variants

__all__ = [
    "Step",
    "in_step",
    "fuse_target",
    "other_sizes",
    "calibration_batch_count",
    "measure",
    "judge",
    "gate_variant",
    "PARITY_DISABLED",
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
    mlflow = "export.mlflow"  # the export logged into an MLflow run (and registry) after it is written


# The error type of the condition a foreign exception leaving a step means; a crash elsewhere (the model's own
# forward while parity runs, say) is none of ours: FXLightningError, with the step named.
_STEP_ERRORS = {Step.capture: TraceError, Step.passes: PassError, Step.export: ExportError,
                Step.variants: ExportError, Step.selection: ExportError}

PROBED_FIXED_IN_CAPTURE = NoteKind("probed_fixed_in_capture", "sizes shown to vary by experiment ({dims}) could not "
                                   "stay dynamic in the capture ({reason}): every artifact takes the sizes seen and "
                                   "refuses others by name")
INNER_TARGET = NoteKind("inner_target", "every output of {outer} is a loss drawn at random (on noise it draws): "
                                       "fused {inner} inside it, which holds {held} of its {total} parameters "
                                       "and answers its calls there the same run after run (set target to choose)")
PARITY_DISABLED = NoteKind("parity_disabled", "parity check disabled (parity.enabled: false): the fused model was "
                                              "not verified")


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
        if step is Step.capture:  # not a trace failure: the capture stage's advice ("the fixes listed above") is not
            error.fix = ""        # about it, and none is known
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
            require_inputs(bool(found.steps), "capture, parity and export", key="parity.data")
            found = without_labels(found, reference)
            outer: Optional[Tuple[str, nn.Module, TargetSteps]] = None  # the default target, where it was left
            if config.target is None:  # the default target: where all it returns is a random loss, the model inside
                inside = _deterministic_inside_random(reference, path, found)
                if inside is not None:
                    outer, (path, found) = (path, reference, found), inside
                    reference, observed = reference_whole.get_submodule(path), None
            signature = signature_for(reference, found.steps, observed, config.trace.probe_sizes, path)
            signature.left_out = [name.strip() for n in found.notes if n.kind is LABELS_LEFT_OUT
                                  for name in str(n["labels"]).split(",")]
            signature, absent_notes = with_stand_ins(signature, reference, found.steps)
            found = dataclasses.replace(found, notes=[*found.notes, *absent_notes])
        capture_notes: List[Note] = []
        calls = dict(example_inputs=found.steps[0].target, observed_inputs=[s.target for s in found.steps])
        with in_step(Step.capture):  # the engine's own errors name capture or passes themselves
            try:
                retry: Optional[str] = None  # why the sizes shown to vary by experiment are fixed again
                try:
                    result = fuse(reference, config, signature=signature,
                                  check_inputs=other_sizes(found.steps) + signature.examples, **calls)
                    if result.static_shapes is not None and signature.probed:
                        retry = next((str(n["reason"]) for n in result.report.notes
                                      if n.kind.name == "static_batch_capture"), "the capture fixed them")
                except TraceError as exc:
                    if not signature.probed:
                        raise
                    retry = first_line(exc.__cause__ or exc, with_type=True)  # torch.export's own error
                if retry is not None:  # the sizes only shown to vary by experiment fixed again, samples kept dynamic
                    probed = signature.probed_dims()
                    capture_notes.append(PROBED_FIXED_IN_CAPTURE(dims=probed, reason=retry))
                    signature = signature.fixing_probed()
                    result = fuse(reference, config, signature=signature, check_inputs=other_sizes(found.steps), **calls)
            except PassError as exc:
                exc.step = exc.step or Step.passes.value
                raise
        if result.conditions:  # the branch the capture holds: other sizes are refused by name
            signature = dataclasses.replace(signature, conditions=list(result.conditions))
        signature = dataclasses.replace(signature, value_guards=result.guarded_branches)  # the other way refused
        if result.interface is not None and signature.count_dim is not None:  # counted per call, not the first's
            result.interface = result.interface.counting_samples(signature.sample_count_outputs, signature.count_dim)
        if result.interface is not None and result.interface.flat:  # the artifact takes one tensor per leaf
            signature = dataclasses.replace(signature, flat=True)
            signature = signature.with_unread(_unread_inputs(result.graph_module, signature))
        if signature.conditions and result.static_shapes is None:  # sizes refused: served padded where proven
            signature = padding_proven(signature, found.steps[0].target, lambda c: run_seeded(reference, c, 0),
                                       lambda s: ArtifactInterface(result.graph_module, s, what="the fused model",
                                                                   as_the_module=True))
        with in_step(Step.parity_input):
            at_path, at, steps = outer if outer is not None else (path, reference, found)  # the outer one's calls
            calibration, calibration_notes = calibration_steps(config, source, reference_whole, at, at_path, steps,
                                                               calibration_batch_count(config))
            if outer is not None:  # what the model inside received on them
                calibration = inner_calls(at, reference, calibration) or [s.target for s in found.steps]
    # The source's contract, else the config's alone (without Lightning nothing is searched).
    contract = source.contract if source.contract is not None else resolve_input_contract(config.export)
    notes = [*source.notes, *source.batches.notes, *found.notes, *capture_notes, *calibration_notes,
             *contract.notes]
    if not config.parity.enabled:
        notes.append(PARITY_DISABLED())
    candidate = _candidate(result, signature)
    fused = Fused(path, result, reference, reference_whole, whole_model_with(reference_whole, path, candidate),
                  result.example_inputs, found.steps, signature, found.source, candidate, notes=notes,
                  through_whole=found.through_whole, contract=contract)
    fused.calibration = [fused.graph_inputs(call) for call in calibration]
    return fused


def _deterministic_inside_random(reference: nn.Module, path: str,
                                 found: TargetSteps) -> Optional[Tuple[str, TargetSteps]]:
    """Where every output of the default target is drawn at random (denoising-diffusion-pytorch's
    ``GaussianDiffusion``: its forward is the training loss, on a timestep and noise it draws), the module inside it
    that holds nearly all its parameters and answers the same run after run (the denoiser, which sampling calls):
    its path and its calls, recorded while the target ran on its own. None: the target is kept."""
    first = found.steps[0].target
    if not random_losses_only(reference, first):
        return None
    inside = deterministic_inside(reference, first)
    if inside is None:
        return None
    name, held, total = inside
    calls = inner_calls(reference, reference.get_submodule(name), [s.target for s in found.steps])
    if calls is None:
        return None
    inner = ".".join(filter(None, (path, name)))
    note = INNER_TARGET(outer=path or "<the LightningModule>", inner=inner, held=f"{held:,}", total=f"{total:,}")
    # The outer calls' sample counts say nothing of the inner ones' (guidance doubles a batch): not evidence here.
    steps = [dataclasses.replace(s, target=c, whole=None, samples=None) for s, c in zip(found.steps, calls)]
    return inner, dataclasses.replace(found, steps=steps, through_whole=False, notes=[*found.notes, note])


def _candidate(result: FuseResult, signature: Signature) -> nn.Module:
    """The fused model as parity runs it, called as the original is: a graph fixed to its capture's sizes runs
    another number of samples as pieces of its own along a proven sample axis, and refuses other sizes by name."""
    graph: nn.Module = result.guarded
    if result.static_shapes is not None:
        graph = for_sizes(graph, signature, result.static_shapes, "the fused model (captured for these sizes only)")
    return result.interface.structured(graph) if result.interface is not None else graph


def _unread_inputs(graph_module: nn.Module, signature: Signature) -> List[str]:
    """The inputs the captured graph never reads (a placeholder whose only users are torch.export's ``_guards_fn``:
    its checks of the input's sizes, which the stand-in an unread input gets is sized to pass), by the signature's
    names."""
    graph = getattr(graph_module, "graph", None)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"] if graph is not None else []
    if len(placeholders) != len(signature.inputs):
        return []
    return [leaf.name for leaf, node in zip(signature.inputs, placeholders)
            if all(user.op == "call_module" and str(user.target) == "_guards_fn" for user in node.users)]


def other_sizes(steps: Sequence[ObservedStep]) -> List[Call]:
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
    """How many batches the enabled variants calibrate on (0: none is enabled)."""
    return max((options.calibration_needed() for _, options in enabled_variants(config.passes)), default=0)


# --------------------------------------------------------------------------------------------- verify


def measure(fused: Fused, config: FuseConfig) -> Optional[ParityState]:
    """Parity of the fused target against the reference on this process's steps (None when disabled)."""
    if not config.parity.enabled:
        return None
    with in_step(Step.parity), own_rng(fused.reference_whole), torch.no_grad():
        _, dtype = model_device_dtype(fused.reference_whole)
        precise = copy.deepcopy(fused.reference).double() if dtype in _LOW_PRECISION else None
        state = _measure_steps(fused, fused.reference, fused.candidate, fused.reference_whole, fused.fused_model,
                               config.parity, precise=precise)
        # With a prologue: the batches as raw pixels, too.
        raw_path = raw_input.measure_raw_path(fused, config.parity.min_discrete_agreement)
        state.notes += [raw_path] if raw_path is not None else []
        return state


def _measure_steps(fused: Fused, reference: nn.Module, candidate: nn.Module, whole_reference: nn.Module,
                   whole_candidate: nn.Module, cfg: ParityConfig, *, precise: Optional[nn.Module] = None,
                   nested: bool = True) -> ParityState:
    """``candidate`` against ``reference`` on the fused model's steps: through the whole models (each with its
    target in place) when the steps recorded the whole model's calls, else on the target's own calls."""
    whole = fused.through_whole
    outputs = fused.signature.outputs
    return measure_parity(
        reference, candidate, fused.steps, cfg,
        whole_reference=whole_reference if whole else None, whole_candidate=whole_candidate if whole else None,
        input_rule=attrgetter("whole" if whole else "target"), label_rule=attrgetter("labels"), source=fused.source,
        precise_reference=precise, nested=nested,
        stochastic=[i for i, leaf in enumerate(outputs) if leaf.stochastic],  # drawn at random in forward
        output_names=[leaf.name for leaf in outputs], sample_axes=[leaf.sample_axis for leaf in outputs])


def judge(state: Optional[ParityState], config: FuseConfig) -> Optional[ParityReport]:
    """The gate on ``state`` (one process's, or the merge of every rank's); None when parity is disabled."""
    if state is None:
        return None
    with in_step(Step.parity):
        return raw_input.judge_raw_path(judge_parity(state, config.parity))


def gate_variant(fused: Fused, loaded: nn.Module, config: ParityConfig, config_key: str,
                 preprocess: Optional[Preprocess] = None) -> ParityReport:
    """A lossy variant against the fp32 fused model on the parity steps: cosine, top-1 agreement, accuracy drop.
    ``preprocess``: ``loaded`` takes raw pixels (an artifact with the prologue)."""
    reference, loaded = raw_input.variant_gate_models(fused.candidate, fused.result.interface.structured(loaded)
                                                      if fused.result.interface is not None else loaded, preprocess)
    whole_reference = fused.fused_model if preprocess is None else whole_model_with(fused.fused_model, fused.target,
                                                                                    reference)
    whole_candidate = whole_model_with(fused.fused_model, fused.target, loaded)
    state = _measure_steps(fused, reference, loaded, whole_reference, whole_candidate, config, nested=False)
    return judge_parity(state, config, lossy=True, config_key=config_key)
