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
from dataclasses import dataclass
from typing import ClassVar

from fx_lightning.passes.base import PassOptions

__all__ = ["LossyOptions"]


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

    def check(self) -> None:
        if not 0.0 <= self.min_top1_agreement <= 1.0:
            raise ValueError(f"min_top1_agreement: must be in [0, 1], got {self.min_top1_agreement}.")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine: must be in [-1, 1], got {self.min_cosine}.")
        if not math.isfinite(self.max_accuracy_drop) or self.max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop: must be a finite number >= 0, got {self.max_accuracy_drop}.")
