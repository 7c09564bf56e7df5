"""Parity metrics: a functional core per metric and a thin torchmetrics ``Metric`` around it.

``relative_max_error``: ``max|preds - target| / max|target|`` (relative to the reference's scale, not
elementwise: a correct fusion of a large network shows large absolute but tiny relative error).
``sample_cosine``: cosine similarity of each sample's flattened output, two zero rows counting as equal.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.regression import MeanAbsoluteError
from torchmetrics.utilities import dim_zero_cat

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
    "sample_error_parts",
    "SampleErrors",
    "PER_OUTPUT_PREFIX",
    "QUANTILES",
    "error_quantiles",
    "log_histogram",
]

# compute() would be a collective under torch.distributed, called in an order that depends on each rank's data
# (and not at all by a rank that failed): ranks merge their states explicitly instead (merge_parity_states), so
# compute() must stay local. These go to the constructor: torchmetrics reads sync_on_compute in __init__ only
# (setting the attribute afterwards leaves compute() syncing, which hangs a rank that computes alone).
LOCAL_ONLY: Dict[str, bool] = {"sync_on_compute": False, "dist_sync_on_step": False}

OUTPUT_KEYS: Tuple[str, ...] = ("relative_max_error", "mean_absolute_error", "cosine_similarity", "cosine_similarity_min")
DISCRETE_KEY = "discrete_agreement"
CLASSIFICATION_KEYS: Tuple[str, ...] = ("top1_agreement", "top1_agreement_strict", "accuracy_reference", "accuracy_fused")
QUANTILES: Tuple[Tuple[str, float], ...] = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))
PER_OUTPUT_PREFIX = "output_error."  # ParityState.metrics keys of the per-output errors: "output_error.<position>"


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


def sample_error_parts(preds: torch.Tensor, target: torch.Tensor, axis: Optional[int] = 0
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per sample (along ``axis``; None or a 0-d output: one sample), ``(max|preds - target|, max|target|)`` in
    float64: what the distribution of per-sample relative errors is made of."""
    diff, ref = (preds.double() - target.double()).abs(), target.double().abs()
    if axis is None or diff.dim() == 0 or axis >= diff.dim():
        return diff.max().reshape(1), ref.max().reshape(1)
    if diff.numel() == 0:  # no rows (a detector that kept no box), or rows of nothing
        return diff.new_zeros(diff.shape[axis]), ref.new_zeros(ref.shape[axis])
    diff, ref = diff.movedim(axis, 0).reshape(diff.shape[axis], -1), ref.movedim(axis, 0).reshape(ref.shape[axis], -1)
    if diff.shape[1] == 0:
        return diff.new_zeros(diff.shape[0]), ref.new_zeros(ref.shape[0])
    return diff.amax(dim=1), ref.amax(dim=1)


def error_quantiles(errors: torch.Tensor) -> Dict[str, float]:
    """``QUANTILES`` of per-sample errors (NaN propagates: a NaN sample makes every quantile NaN, as the gate fails)."""
    if errors.numel() == 0:
        return {}
    if bool(torch.isnan(errors).any()):
        return {name: math.nan for name, _ in QUANTILES}
    # "higher": each figure is a sample's own error (no interpolation towards an inf neighbour), max the largest.
    values = torch.quantile(errors.double(), torch.tensor([q for _, q in QUANTILES], dtype=torch.float64),
                            interpolation="higher")
    return {name: float(v) for (name, _), v in zip(QUANTILES, values)}


def log_histogram(errors: torch.Tensor, bins: int = 12) -> Tuple[List[float], List[int], int]:
    """``(edges, counts, zeros)``: the finite non-zero errors in ``bins`` log-spaced bins between the smallest and
    the largest (log-spaced: errors spread over decades), and how many were exactly zero."""
    finite = errors[torch.isfinite(errors)].double()
    zeros, positive = int((finite == 0).sum()), finite[finite > 0]
    if positive.numel() == 0:
        return [], [], zeros
    low, high = math.log10(float(positive.min())), math.log10(float(positive.max()))
    high = max(high, low + 1e-6)  # one value: one narrow bin holds it all
    edges = torch.logspace(low, high, bins + 1, dtype=torch.float64)
    index = ((positive.log10() - low) / (high - low) * bins).floor().clamp(0, bins - 1).long()
    counts = torch.bincount(index, minlength=bins)
    return [float(e) for e in edges], [int(c) for c in counts], zeros


def sample_cosine(preds: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample cosine similarity of the flattened outputs, in float64; two zero rows count as 1, one as 0."""
    a = preds.double().flatten(1) if preds.dim() >= 2 else preds.double().reshape(1, -1)  # [0, k] stays [0, k]
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
        if cos.numel():  # an output with no rows (a detector that kept no box) has no sample to compare
            self.minimum = torch.minimum(self.minimum, cos.min())  # propagates NaN

    def compute(self) -> torch.Tensor:
        if self.reduction == "min":
            return self.minimum
        return self.total / self.count.clamp_min(1)


class SampleErrors(Metric):
    """The relative error of each sample of one output: its ``max|preds - target|`` over the output's
    ``max|target|`` over everything seen (the scale :class:`RelativeMaxError` uses, so the largest is that output's
    relative error). The per-sample maxima are kept (``cat`` across ranks): parity sees a few batches, so that is
    a few numbers per sample. ``name`` and ``shape`` (of the first output seen) say which output it is."""

    full_state_update = False
    is_differentiable = False
    higher_is_better = False

    diffs: List[torch.Tensor]
    scales: List[torch.Tensor]

    def __init__(self, name: str = "output_0", axis: Optional[int] = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name, self.axis = name, axis
        self.shape: List[int] = []
        self.add_state("diffs", [], dist_reduce_fx="cat")
        self.add_state("scales", [], dist_reduce_fx="cat")

    def update(self, preds: torch.Tensor, target: torch.Tensor) -> None:
        if target.numel() == 0:
            return
        self.shape = self.shape or list(target.shape)
        diff, ref = sample_error_parts(preds, target, self.axis)
        self.diffs.append(diff)
        self.scales.append(ref)

    def compute(self) -> torch.Tensor:
        if not self.diffs:
            return torch.zeros(0, dtype=torch.float64)
        return relative_max_error(dim_zero_cat(self.diffs), dim_zero_cat(self.scales).max())  # one scale, the output's


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
    metrics: Dict[str, Metric] = {
        "relative_max_error": RelativeMaxError(**LOCAL_ONLY),
        "mean_absolute_error": MeanAbsoluteError(**LOCAL_ONLY),
        "cosine_similarity": SampleCosineSimilarity("mean", **LOCAL_ONLY),
        "cosine_similarity_min": SampleCosineSimilarity("min", **LOCAL_ONLY),
    }
    # MeanAbsoluteError keeps float32 sums and does not upcast its inputs.
    return {key: metric.set_dtype(torch.float64) for key, metric in metrics.items()}


def classification_metrics(num_classes: int) -> Dict[str, Metric]:
    """Top-1 agreement (tolerant of near ties, and strict) and accuracy of each model (``CLASSIFICATION_KEYS``)."""
    # average="micro": the fraction of samples; torchmetrics' default "macro" averages per class.
    return {key: MulticlassAccuracy(num_classes=num_classes, average="micro", validate_args=False, **LOCAL_ONLY)
            for key in CLASSIFICATION_KEYS}
