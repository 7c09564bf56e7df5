"""The records the pipeline's steps pass along (:mod:`.steps` makes them, :mod:`.driver` and
:mod:`.raw_input` read them): the data batches, what one process works on, its fused model, and what was
exported."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, List, Mapping, Optional, Tuple, Union

import torch
from torch import nn

from fx_lightning.common.calls import Call
from fx_lightning.config import FuseConfig
from fx_lightning.pipeline.engine import FuseResult
from fx_lightning.export.write.input_contract import InputContract
from fx_lightning.export.manifest import Manifest
from fx_lightning.common.notes import Note
from fx_lightning.common.provenance import WeightsInfo
from fx_lightning.parity.report import ParityReport
from fx_lightning.signature.forms import CallForm
from fx_lightning.signature.signature import Signature

__all__ = ["Batches", "ObservedStep", "Observations", "Source", "Fused", "FusedForm", "FusedForms", "Exported"]


@dataclass
class Batches:
    """Data batches for parity and where they came from."""

    items: List[Any]
    source: str = "given"  # val | train | example | given
    notes: List[Note] = field(default_factory=list)  # which batches were read and why
    # Batches the lossy variants are calibrated on (the training data, so the gate judges them on data they have
    # not seen); empty: the first parity batches.
    calibration: List[Any] = field(default_factory=list)
    # The number of samples in each item, as its loader says (None: it does not say).
    samples: List[Optional[int]] = field(default_factory=list)


@dataclass
class ObservedStep:
    """One step's call of the target: its arguments, the whole model's call in the same step (None: the step
    did not call the model's forward), the number of samples in the step's batch, and the batch's integer tensors
    that may be its labels (:func:`~fx_lightning.common.batches.label_candidates`)."""

    target: Call
    whole: Optional[Call] = None
    samples: Optional[int] = None
    labels: Tuple[torch.Tensor, ...] = ()


@dataclass
class Observations:
    """What the target received while the model's own steps ran (the callback records them): ``steps`` with their
    values (validation calls when there are any), ``shapes`` of more calls (each input leaf's shape and the
    batch's sample count: evidence of which sizes vary), training ``calibration`` calls, and where they came from."""

    target: str  # the target's dotted path ("": the whole LightningModule)
    steps: List[ObservedStep] = field(default_factory=list)
    shapes: List[Tuple[List[Tuple[int, ...]], Optional[int]]] = field(default_factory=list)
    calibration: List[ObservedStep] = field(default_factory=list)
    stage: str = "validation"
    notes: List[Note] = field(default_factory=list)


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
    weights: Optional[WeightsInfo] = None
    checked: List[str] = field(default_factory=list)  # what loading proved (the preflight's checks)
    notes: List[Note] = field(default_factory=list)
    contract: Optional[InputContract] = None  # export.preprocess/labels with what was found; None: the config's
    observed: Optional[Observations] = None  # the target's calls recorded during fit (the callback)


@dataclass
class Fused:
    """One process's fused model before any verdict, with what the later steps need."""

    target: str  # dotted path of the fused submodule; "" when the whole model was fused
    result: FuseResult
    reference: nn.Module  # the unfused target (eval copy): parity's reference, the eager baseline when timing
    reference_whole: nn.Module  # the whole model's eval copy
    fused_model: nn.Module  # the whole model (eval mode) with the fused target in place
    # The graph's inputs on the first step (what capture and export trace with: the leaves, for a flat interface).
    example_inputs: Optional[tuple]
    steps: List[ObservedStep]  # what parity compares on: the target's calls (and the whole model's)
    signature: Signature  # how the artifact is called, from the calls observed
    source: str
    candidate: nn.Module  # the fused model as parity runs it, called as the original target is
    calibration: List[tuple] = field(default_factory=list)  # the graph's inputs on calibration steps
    notes: List[Note] = field(default_factory=list)
    # True: parity runs the whole model on each step's whole call; False: it compares the target alone on its calls.
    through_whole: bool = True
    contract: InputContract = field(default_factory=InputContract)  # the prologue and labels to export

    def graph_inputs(self, call: Call) -> tuple:
        """A call of the target as the fused graph takes it (one tensor per leaf, for a flat interface)."""
        interface = self.result.interface
        return interface.leaves_of(call).args if interface is not None else call.args


@dataclass
class FusedForm:
    """A call form (:mod:`~fx_lightning.signature.forms`) fused and proven on the observed calls given that form,
    with the config it is exported with (its own formats, no variants or selection)."""

    form: CallForm
    fused: Fused
    parity: Optional[ParityReport]
    config: FuseConfig


@dataclass
class FusedForms:
    """The call forms (``made``: each fused and proven, or the note why it is left out, made as it is asked for so
    one form's fused copy is held at a time), why others were not made (``notes``), and forward's defaults the
    artifact's own calls left out (``defaults``: a call giving one explicitly is the artifact's own call)."""

    made: Iterator[Union[FusedForm, Note]] = field(default_factory=lambda: iter(()))  # read once, by the export
    notes: List[Note] = field(default_factory=list)
    defaults: List[CallForm] = field(default_factory=list)


@dataclass
class Exported:
    directory: Path
    manifest: Optional[Manifest] = None
    notes: List[Note] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)
