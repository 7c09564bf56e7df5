"""The records the pipeline's steps pass along (:mod:`.steps` makes them, :mod:`.driver` and
:mod:`.raw_input` read them): the data batches, what one process works on, its fused model, and what was
exported."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Mapping, Optional

import torch
from torch import nn

from fx_lightning.batches import InputRule
from fx_lightning.engine import FuseResult
from fx_lightning.export.input_contract import InputContract
from fx_lightning.export.manifest import Manifest
from fx_lightning.notes import Note
from fx_lightning.provenance import WeightsInfo

__all__ = ["Batches", "Source", "Fused", "Exported"]


@dataclass
class Batches:
    """Data batches for parity and where they came from."""

    items: List[Any]
    source: str = "given"  # val | train | example | given
    notes: List[Note] = field(default_factory=list)  # which batches were read and why
    # Batches the lossy variants are calibrated on (the training data, so the gate judges them on data they have
    # not seen); empty: the first parity batches.
    calibration: List[Any] = field(default_factory=list)


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
    # True: parity runs the whole model on ``data``; False: ``data`` is what the target itself received (recorded
    # while the LightningModule's own step ran), and parity compares the target alone.
    through_whole: bool = True
    contract: InputContract = field(default_factory=InputContract)  # the prologue and labels to export


@dataclass
class Exported:
    directory: Path
    manifest: Optional[Manifest] = None
    notes: List[Note] = field(default_factory=list)
    steps: List[str] = field(default_factory=list)
