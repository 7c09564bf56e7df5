"""Parity: does the fused model give the same answers as the original? Measured with torchmetrics.

Usable on its own::

    from fx_lightning.parity import check_parity
    report = check_parity(model, fused, val_loader, {"max_batches": 4})
    assert report.passed, report.failures

Two levels are measured. On the *target* (the module that was fused): relative max error
``max|fused - ref| / max|ref|``, mean absolute error and per-sample cosine similarity. On the *whole
model* (when ``whole_reference``/``whole_candidate`` are given, or the target itself when not): top-1
agreement and, when the batch carries integer labels, the accuracy of each and the drop. Everything is
compared in float64. ``metrics`` holds the metrics (functional core + Metric), ``compare`` the one comparison
of an output with its reference (structure, then relative error), ``gate`` measure / merge / judge.

The gate's names are imported on first use: ``compare`` sits below the passes and capture, which the config
schema (imported by the gate) is derived from.
"""

from __future__ import annotations

import importlib
from typing import Any

from fx_lightning.parity.compare import Comparison, compare_outputs
from fx_lightning.parity.metrics import RelativeMaxError, SampleCosineSimilarity

__all__ = [
    "LOW_PRECISION_FACTOR",
    "Comparison",
    "ParityReport",
    "ParityState",
    "RelativeMaxError",
    "SampleCosineSimilarity",
    "check_parity",
    "compare_outputs",
    "judge_parity",
    "measure_parity",
    "merge_parity_states",
]

_GATE = {"LOW_PRECISION_FACTOR", "ParityReport", "ParityState", "check_parity", "judge_parity", "measure_parity",
         "merge_parity_states"}


def __getattr__(name: str) -> Any:
    if name not in _GATE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.gate"), name)
