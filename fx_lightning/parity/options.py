"""The parity gate's options: :class:`GateThresholds`, the thresholds every gate has (the exact model's, under
``parity``, and each lossy variant's, under ``passes.<variant>``, with their own defaults), and
:class:`ParityConfig`, the ``parity`` section. Declared here, below the config schema that composes them, so the
gate reads its options without importing the schema (which is built from the passes, which use parity)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping, Optional, Union

from fx_lightning.common.imports import import_checked
from fx_lightning.errors import OnError, load_record, run_check
from fx_lightning.common.tolerance import DISCRETE_AGREEMENT, GATE_RTOL

__all__ = ["GateThresholds", "ParityConfig", "ParityData", "OnFailure", "load_parity"]

OnFailure = OnError  # parity.on_failure takes the same values


class ParityData(str, Enum):
    """Where parity batches come from. ``auto``: validation, else training data, else example_input_array."""

    auto = "auto"
    val = "val"
    train = "train"
    example = "example"


@dataclass(kw_only=True)  # after the sections' own fields in their constructors: ParityConfig(False) is still off
class GateThresholds:
    """The floors a candidate's outputs must meet against the reference's, on the parity batches."""

    # Per-sample cosine similarity with the reference's outputs (catches scores that drift while the top class holds).
    min_cosine: float = 0.9999
    min_top1_agreement: float = 0.999
    # Allowed accuracy drop (fraction, 0.001 = 0.1 points) when labels are in the batch.
    max_accuracy_drop: float = 0.001

    def check(self) -> None:
        if not 0.0 <= self.min_top1_agreement <= 1.0:
            raise ValueError(f"min_top1_agreement: must be in [0, 1], got {self.min_top1_agreement}.")
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine: must be in [-1, 1], got {self.min_cosine}.")
        if not math.isfinite(self.max_accuracy_drop) or self.max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop: must be a finite number >= 0, got {self.max_accuracy_drop}.")


@dataclass
class ParityConfig(GateThresholds):
    enabled: bool = True
    max_batches: int = 8
    data: ParityData = ParityData.auto
    # How to take the model input out of a batch: null = automatic (tensor; first item of a tuple/list;
    # dict key x/input/inputs/image/images), a dict key, an integer index, or "pkg.module:function". The
    # LightningModule's forward input; where it has no forward, the target's.
    input: Optional[str] = None
    # Gate: max|fused - ref| / max|ref| over all batches.
    rtol: float = GATE_RTOL
    # Discrete outputs (labels, masks, thresholded scores: integer, boolean, or only 0 and 1) are judged by the
    # fraction of elements equal to the reference's: one value on the threshold must not count as a relative error of 1.
    min_discrete_agreement: float = DISCRETE_AGREEMENT
    on_failure: OnFailure = OnFailure["raise"]

    def check(self) -> None:
        """The gate's thresholds in range; an ``input`` import path imports to a callable."""
        if self.max_batches < 1:
            raise ValueError(f"max_batches: must be >= 1, got {self.max_batches}.")
        if not math.isfinite(self.rtol) or self.rtol < 0:
            raise ValueError(f"rtol: must be a finite number >= 0, got {self.rtol}.")
        super().check()
        if not 0.0 <= self.min_discrete_agreement <= 1.0:
            raise ValueError(f"min_discrete_agreement: must be in [0, 1], got {self.min_discrete_agreement}.")
        if self.input is not None and ":" in self.input:
            import_checked(self.input, "input", callable_required=True)


def load_parity(cfg: Union[ParityConfig, Mapping[str, Any], None]) -> ParityConfig:
    """``cfg`` as a checked ParityConfig: a mapping (or None) merged into the schema, each failure a
    :class:`ConfigError` naming the key under ``parity`` (the gate's functions are entry points too)."""
    if isinstance(cfg, ParityConfig):
        return cfg
    loaded = load_record(ParityConfig, [dict(cfg or {})], "parity")
    run_check(loaded, "parity.")
    return loaded
