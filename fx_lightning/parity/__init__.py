"""Parity: does the fused model give the same answers as the original? Measured with torchmetrics.

Usable on its own::

    from fx_lightning.parity import check_parity
    report = check_parity(model, fused, val_loader, {"max_batches": 4})
    assert report.passed, report.failures

Two levels are measured. On the *target* (the module that was fused): relative max error
``max|fused - ref| / max|ref|``, mean absolute error and per-sample cosine similarity. On the *whole
model* (when ``whole_reference``/``whole_candidate`` are given, or the target itself when not): top-1
agreement and, when the batch carries integer labels, the accuracy of each and the drop. Everything is
compared in float64. ``metrics`` holds the metrics (functional core + Metric), ``gate`` measure / merge / judge.
"""

from fx_lightning.parity.gate import (
    LOW_PRECISION_FACTOR,
    ParityReport,
    ParityState,
    check_parity,
    judge_parity,
    measure_parity,
    merge_parity_states,
)
from fx_lightning.parity.metrics import RelativeMaxError, SampleCosineSimilarity

__all__ = [
    "LOW_PRECISION_FACTOR",
    "ParityReport",
    "ParityState",
    "RelativeMaxError",
    "SampleCosineSimilarity",
    "check_parity",
    "judge_parity",
    "measure_parity",
    "merge_parity_states",
]
