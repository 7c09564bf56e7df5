"""Parity: does the fused model give the same answers as the original? Measured with torchmetrics.

Usable on its own::

    from fx_lightning.parity.gate import check_parity
    report = check_parity(model, fused, val_loader, {"max_batches": 4})
    assert report.passed, report.failures

Two levels are measured. On the *target* (the module that was fused): relative max error
``max|fused - ref| / max|ref|``, mean absolute error and per-sample cosine similarity. On the *whole
model* (when ``whole_reference``/``whole_candidate`` are given, or the target itself when not): top-1
agreement and, when the batch carries integer labels, the accuracy of each and the drop. Everything is
compared in float64. ``metrics`` holds the metrics (functional core + Metric), ``compare`` the one comparison
of an output with its reference (structure, then relative error), ``report`` the verdict's record, ``options`` the
gate's thresholds and the ``parity`` config section, ``gate`` measure / merge / judge.

This package's own namespace holds the low parts only (the comparison, the metrics, the report): the passes and
capture import the comparison through it, so it stays light; ``options`` and ``gate`` are imported by module name.
"""

from __future__ import annotations

from fx_lightning.parity.compare import Comparison, compare_outputs
from fx_lightning.common.tolerance import LOW_PRECISION_FACTOR
from fx_lightning.parity.metrics import RelativeMaxError, SampleCosineSimilarity
from fx_lightning.parity.report import ParityReport

__all__ = [
    "LOW_PRECISION_FACTOR",
    "Comparison",
    "ParityReport",
    "RelativeMaxError",
    "SampleCosineSimilarity",
    "compare_outputs",
]
