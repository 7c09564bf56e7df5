"""Parity metrics: a functional core per metric and a thin torchmetrics ``Metric`` around it.

``relative_max_error``: ``max|preds - target| / max|target|`` (relative to the reference's scale, not
elementwise: a correct fusion of a large network shows large absolute but tiny relative error).
``sample_cosine``: cosine similarity of each sample's flattened output, two zero rows counting as equal.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Tuple

import torch
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError

__all__ = [
    "LOCAL_ONLY",
    "relative_max_error",
    "relative_max_error_parts",
    "sample_cosine",
    "RelativeMaxError",
    "SampleCosineSimilarity",
    "output_metrics",
    "classification_metrics",
    "OUTPUT_KEYS",
    "DISCRETE_KEY",
    "Agreement",
    "agreement_parts",
    "CLASSIFICATION_KEYS",
]

# compute() would be a collective under torch.distributed, called in an order that depends on each rank's data
# (and not at all by a rank that failed): ranks merge their states explicitly instead (merge_parity_states), so
# compute() must stay local. These go to the constructor: torchmetrics reads sync_on_compute in __init__ only
# (setting the attribute afterwards leaves compute() syncing, which hangs a rank that computes alone).
LOCAL_ONLY: Dict[str, bool] = {"sync_on_compute": False, "dist_sync_on_step": False}

OUTPUT_KEYS: Tuple[str, ...] = ("relative_max_error", "mean_absolute_error", "cosine_similarity", "cosine_similarity_min")
DISCRETE_KEY = "discrete_agreement"
CLASSIFICATION_KEYS: Tuple[str, ...] = ("top1_agreement", "top1_agreement_strict", "accuracy_reference", "accuracy_fused")


# ---------------------------------------------------------------------------------- functional core


def relative_max_error_parts(preds: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(max|preds - target|, max|target|)`` in float64: the two maxima the relative error is made of."""
    diff = (preds.double() - target.double()).abs().max()
    return diff, target.double().abs().max()


def relative_max_error(max_abs_diff: torch.Tensor, max_abs_ref: torch.Tensor) -> torch.Tensor:
    """``max_abs_diff / max_abs_ref``; an all-zero reference makes any difference infinite."""
    if max_abs_ref == 0:
        return torch.where(max_abs_diff == 0, max_abs_diff, torch.full_like(max_abs_diff, math.inf))
    return max_abs_diff / max_abs_ref


def sample_cosine(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cosine similarity of the flattened outputs, in float64; two zero rows count as 1, one as 0."""
    a = preds.double().reshape(preds.shape[0], -1) if preds.dim() >= 2 else preds.double().reshape(1, -1)
    b = target.double().reshape(a.shape)
    na, nb = a.norm(dim=1), b.norm(dim=1)
    cos = (a * b).sum(dim=1) / (na * nb)
    cos = torch.where((na == 0) & (nb == 0), torch.ones_like(cos), cos)
    return torch.where((na == 0) ^ (nb == 0), torch.zeros_like(cos), cos)


# ------------------------------------------------------------------------------------ Metric wrappers


class RelativeMaxError(Metric):
    """:func:`relative_max_error` over everything seen (the maxima reduce by ``max`` across ranks)."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    max_abs_diff: torch.Tensor
    max_abs_ref: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("max_abs_diff", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")
        self.add_state("max_abs_ref", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="max")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if target.numel() == 0:
            return
        diff, ref = relative_max_error_parts(preds, target)
        # torch.maximum propagates NaN, so a NaN output can never pass the gate.
        self.max_abs_diff = torch.maximum(self.max_abs_diff, diff)
        self.max_abs_ref = torch.maximum(self.max_abs_ref, ref)

    def compute(self) -> torch.Tensor:
        return relative_max_error(self.max_abs_diff, self.max_abs_ref)


class SampleCosineSimilarity(Metric):
    """:func:`sample_cosine` reduced by ``mean`` or ``min`` over every sample seen.

    torchmetrics' own CosineSimilarity concatenates every batch (so widths must agree) and treats a
    pair of zero vectors as 0; here two zero rows count as identical (1.0).
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    total: torch.Tensor
    count: torch.Tensor
    minimum: torch.Tensor

    def __init__(self, reduction: str = "mean", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if reduction not in ("mean", "min"):
            raise ValueError(f"reduction must be 'mean' or 'min', got {reduction!r}")
        self.reduction = reduction
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("minimum", torch.tensor(1.0, dtype=torch.float64), dist_reduce_fx="min")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        cos = sample_cosine(preds, target)
        self.total = self.total + cos.sum()
        self.count = self.count + cos.numel()
        self.minimum = torch.minimum(self.minimum, cos.min())  # propagates NaN

    def compute(self) -> torch.Tensor:
        if self.reduction == "min":
            return self.minimum
        return self.total / self.count.clamp_min(1)


def agreement_parts(preds: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(elements equal, elements)`` of a discrete output against its reference."""
    return (preds == target).sum().double(), torch.tensor(float(target.numel()), dtype=torch.float64)


class Agreement(Metric):
    """The fraction of elements of discrete outputs equal to the reference's, over everything seen."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = True

    equal: torch.Tensor
    total: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("equal", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("total", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        equal, total = agreement_parts(preds, target)
        self.equal, self.total = self.equal + equal, self.total + total

    def compute(self) -> torch.Tensor:
        return self.equal / self.total.clamp_min(1)


def output_metrics() -> Dict[str, Metric]:
    """The metrics of the fused target's outputs against the reference's (``OUTPUT_KEYS``), in float64."""
    collection = MetricCollection(
        {
            "relative_max_error": RelativeMaxError(**LOCAL_ONLY),
            "mean_absolute_error": MeanAbsoluteError(**LOCAL_ONLY),
            "cosine_similarity": SampleCosineSimilarity("mean", **LOCAL_ONLY),
            "cosine_similarity_min": SampleCosineSimilarity("min", **LOCAL_ONLY),
        },
        compute_groups=False,
    )
    # MeanAbsoluteError keeps float32 sums and does not upcast its inputs.
    collection.set_dtype(torch.float64)
    return dict(collection.items())


def classification_metrics(num_classes: int) -> Dict[str, Metric]:
    """Top-1 agreement (tolerant of near ties, and strict) and accuracy of each model (``CLASSIFICATION_KEYS``)."""

    # average="micro": the fraction of samples; torchmetrics' default "macro" averages per class.
    def accuracy() -> Metric:
        return MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False, **LOCAL_ONLY)

    return {key: accuracy() for key in CLASSIFICATION_KEYS}
