"""``export.preprocess`` and ``export.labels`` in the pipeline's steps (:mod:`.steps` calls these in a line each).

With a prologue every artifact takes the raw input a client sends: the export's example inputs are the example
batch turned back into raw pixels, judged against the fp64 normalisation of those pixels and an fp64 copy of the
original model (:class:`~fx_lightning.export.write.raw_reference.NormalisedReference`); parity also sends its batches as raw
pixels through the exported graph (:func:`measure_raw_path`, gated in :func:`judge_raw_path`); the lossy
variants are made and gated on raw pixels; the eager baseline timed beside the artifacts runs the prologue too.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

import torch
from torch import nn

from fx_lightning.common.batches import detached
from fx_lightning.formats.base import FUSED_CLASS_NAME, ExactReference
from fx_lightning.export.write.input_contract import InputContract, labels_for_output, preprocess_note
from fx_lightning.export.manifest import Manifest, Preprocess
from fx_lightning.export.write.prologue import ThroughRaw, behind_prologue, check_prologue_input, raw_args, with_prologue
from fx_lightning.common.notes import Note, NoteKind
from fx_lightning.export.write.raw_reference import NormalisedReference, compare_raw_path
from fx_lightning.parity.report import ParityReport
from fx_lightning.passes.graph_utils import plain_graph_module
from fx_lightning.pipeline.records import Fused


__all__ = ["RAW_PATH_PASSED", "RAW_PATH_MISSED", "RAW_REFERENCE", "export_inputs",
           "measure_raw_path", "judge_raw_path", "with_contract", "variant_gate_models",
           "example_raw", "normalised_dtype"]

_PATH = ("{batches} parity batch(es) sent as raw {input_dtype} {layout} {channel_order} pixels through the exported "
         "graph (prologue + fused) against fp64 normalisation + the original model: relative error "
         "{relative_error:.3g} (allowed {tolerance:.1e})")
RAW_PATH_PASSED = NoteKind("raw_path_passed", "raw input path: " + _PATH)
RAW_PATH_MISSED = NoteKind("raw_path_missed", "raw input path FAILED: " + _PATH + ": {failure}")
RAW_REFERENCE = "the raw inputs normalised in fp64, then an fp64 copy of the original (unfused) model"
_RAW_METRIC = "raw_path_relative_max_error"


def export_inputs(fused: "Fused") -> Tuple[tuple, Optional[ExactReference]]:
    """The example inputs the export traces and checks with (raw with a prologue), and what the artifacts are
    judged against (None: an fp64 copy of the fused model)."""
    example = tuple(detached(fused.example_inputs))
    preprocess = fused.contract.preprocess
    if preprocess is None:
        return example, None
    check_prologue_input(example, preprocess)
    return raw_args(example, preprocess), ExactReference(NormalisedReference(fused.reference, preprocess),
                                                         RAW_REFERENCE)


def measure_raw_path(fused: "Fused", min_agreement: float) -> Optional[Note]:
    """Parity's batches as raw pixels: the exported graph (prologue + fused) against fp64 normalisation + the
    original model; the figure as a note (None: no prologue)."""
    preprocess = fused.contract.preprocess
    if preprocess is None:
        return None
    raw = [raw_args(inputs, preprocess)[0] for inputs in _target_inputs(fused, preprocess)]
    exported = with_prologue(plain_graph_module(fused.result.graph_module, FUSED_CLASS_NAME), preprocess,
                             normalised_dtype(fused))
    comparison = compare_raw_path(exported, fused.reference, raw, preprocess, min_agreement)
    facts = dict(batches=len(raw), **preprocess.client_input(), relative_error=comparison.relative_error,
                 tolerance=comparison.tolerance)
    if comparison.passed:
        return RAW_PATH_PASSED(**facts)
    return RAW_PATH_MISSED(failure=comparison.describe(), **facts)


def normalised_dtype(fused: "Fused") -> torch.dtype:
    """The dtype the fused target takes its (normalised) image in: the prologue's output dtype."""
    first = (fused.example_inputs or (None,))[0]
    return first.dtype if isinstance(first, torch.Tensor) and first.is_floating_point() else torch.float32


def _target_inputs(fused: "Fused", preprocess: Preprocess) -> List[tuple]:
    """The fused graph's inputs on each parity step (each checked to fit the prologue)."""
    inputs = [fused.graph_inputs(step.target) for step in fused.steps]
    for args in inputs:
        check_prologue_input(args, preprocess)
    return inputs


def judge_raw_path(report: Optional[ParityReport]) -> Optional[ParityReport]:
    """The raw-path figure in the report's metrics (the worst over the ranks), and a failure when it missed."""
    if report is None:
        return None
    notes = [n for n in report.notes if n.kind in (RAW_PATH_PASSED, RAW_PATH_MISSED)]
    if not notes:
        return report
    report.metrics[_RAW_METRIC] = max(float(n["relative_error"]) for n in notes)  # type: ignore[arg-type]
    report.thresholds[_RAW_METRIC] = max(float(n["tolerance"]) for n in notes)  # type: ignore[arg-type]
    missed = [n for n in notes if n.kind == RAW_PATH_MISSED]
    report.failures += [n for n in missed if n not in report.failures]
    report.notes = [n for n in report.notes if n not in missed]
    report.passed = report.passed and not missed
    return report


def with_contract(manifest: Manifest, contract: InputContract) -> Manifest:
    """The manifest with the input contract: the raw input's prologue and the labels that fit the first output."""
    first = manifest.outputs[0].get("shape") if manifest.outputs else None
    width = first[-1] if first is not None and len(first) == 2 and isinstance(first[-1], int) else None
    labels, notes = labels_for_output(contract, width)
    if contract.preprocess is not None:
        notes.insert(0, preprocess_note(contract.preprocess))
    return dataclasses.replace(manifest, preprocess=contract.preprocess, labels=labels,
                               notes=[*manifest.notes, *notes])


def variant_gate_models(reference: nn.Module, loaded: nn.Module,
                        preprocess: Optional[Preprocess]) -> Tuple[nn.Module, nn.Module]:
    """The fp32 reference and a variant's artifact as its gate runs them on parity batches: with a prologue the
    artifact takes raw pixels, so both get the same pixels (the reference behind its own prologue)."""
    if preprocess is None:
        return reference, loaded
    return ThroughRaw(behind_prologue(reference, preprocess), preprocess), ThroughRaw(loaded, preprocess)


def example_raw(example: Any, preprocess: Optional[Preprocess]) -> Any:
    """Example (or calibration) inputs as the artifacts take them (raw with a prologue)."""
    return example if preprocess is None or example is None else raw_args(tuple(example), preprocess)

