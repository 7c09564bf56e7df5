"""What every lossy variant pass (int8, bf16) is configured with: the gate it must pass on validation data, and
whether it is made only where the CPU runs it fast.

The gate, declared once here: top-1 agreement with the fp32 model and the accuracy drop against labels on the
parity batches (validation data, the held-out split), and a floor on each sample's cosine similarity with the
fp32 outputs (catches scores that drift while the top class holds: regression heads, embeddings). The defaults
are what a user serving a classifier expects: the lossy model agrees with fp32 on 99% of samples and loses at
most half a point of accuracy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional, Tuple

import torch
from torch import nn

from fx_lightning.calls import Call
from fx_lightning.notes import Note, NoteKind
from fx_lightning.passes.base import PassOptions, PassResult
from fx_lightning.program import Program, export_program, signature_dims
from fx_lightning.rows import rows_of, with_rows
from fx_lightning.signature import Signature

__all__ = ["LossyOptions", "MadeVariant", "export_variant", "VARIANT_STATIC"]

VARIANT_STATIC = NoteKind("variant_static", "the {variant} model exports for the example's sizes only ({reason})")


def export_variant(model: nn.Module, inputs: Tuple[Any, ...], signature: Optional[Signature]) -> Program:
    """A variant's model exported with the dimensions the signature says vary (the sample axis repeated to two
    samples when the example has one), else for the example's sizes: a model that fixes a size is fixed in its
    variants too."""
    if signature is None:  # no observed calls (a pass run by hand): dim 0 of every tensor
        dims = [{0: torch.export.Dim("batch", min=1)} if isinstance(a, torch.Tensor) and a.dim() else None
                for a in inputs]
        axes = [0 if d else None for d in dims]
    else:
        dims, axes = signature_dims(signature), (signature.input_axes() if signature.batched else [])
    dynamic_inputs = tuple(with_rows(inputs, axes, 2)) if axes and rows_of(inputs, axes) == 1 else inputs
    return export_program(model, Call(dynamic_inputs), dims if any(dims) else None, allow_static=True,
                          static_call=Call(tuple(inputs)))


@dataclass
class MadeVariant(PassResult):
    """What a variant pass returns besides its edits: the lossy ``model`` it made from the fused graph (which it
    leaves as it was), the ``precision`` that names its artifacts (``aoti-int8``), the ``imports`` a process needs
    to load it (the modules that register its ops) and ``notes`` on how it was made (layers kept in float...).
    Graph passes return a plain :class:`~fx_lightning.passes.base.PassResult`: only variants make a new model."""

    model: Any = None
    precision: str = ""
    imports: List[str] = field(default_factory=list)
    notes: List[Note] = field(default_factory=list)


@dataclass
class LossyOptions(PassOptions):
    PRECISION: ClassVar[str] = ""  # what the variant computes in ("int8", "bf16"): names its artifacts

    enabled: bool = False
    min_top1_agreement: float = 0.99
    # A fraction: 0.005 = half a point of accuracy.
    max_accuracy_drop: float = 0.005
    min_cosine: float = 0.99
    # Made only where the CPU has the instructions that make it fast (int8: VNNI or AMX-INT8; bf16: AVX512-BF16
    # or AMX-BF16); elsewhere skipped with the reason. false: made and judged anyway (a model trained here to be
    # served on another CPU).
    require_cpu_features: bool = True

    def calibration_needed(self) -> int:
        """How many data batches the variant is made from (besides its gate): one by default (its example)."""
        return 1

    def for_rehearsal(self) -> "LossyOptions":
        """The options the preflight makes the variant with on the untrained model (which misses any gate): enough
        to prove that making it runs. By default the same."""
        return self

    def check(self) -> None:
        if not 0.0 <= self.min_top1_agreement <= 1.0:
            raise ValueError(f"min_top1_agreement: must be in [0, 1], got {self.min_top1_agreement}.")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine: must be in [-1, 1], got {self.min_cosine}.")
        if not math.isfinite(self.max_accuracy_drop) or self.max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop: must be a finite number >= 0, got {self.max_accuracy_drop}.")
