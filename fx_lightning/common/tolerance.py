"""The tolerance policy, declared once: how far an output may be from its reference before it is not the model.

Every check reads it: the capture's faithfulness check, the module passes' own checks, the parity gate's defaults,
each artifact's round trip at export and the selection's check of what it loads. Machine-independent numbers only
(float rounding per dtype, factors of a measured error); the figures measured on one CPU live in
``docs/performance.md``.
"""

from __future__ import annotations

from typing import Dict

import torch

__all__ = [
    "ROUNDING_RTOL",
    "RUNTIME_FACTOR",
    "LOW_PRECISION_FACTOR",
    "DISCRETE_AGREEMENT",
    "GATE_RTOL",
    "MODULE_CHECK_RTOL",
    "LOSSY_MAX_ERROR",
    "rounding_tolerance",
]

# Relative error a rerun of the same arithmetic stays within, by dtype (the one tolerance table).
ROUNDING_RTOL: Dict[torch.dtype, float] = {
    torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2,
}
# Another runtime's kernels (ONNX Runtime, Inductor) round differently: an artifact may be this many times
# further from an fp64 reference than the fused model itself is.
RUNTIME_FACTOR = 8.0
# A low-precision model is compared against its own rounding error: a correct fusion may differ from the
# unfused model by a few times that error (fewer than another runtime: it is the same runtime).
LOW_PRECISION_FACTOR = 4.0
# Discrete outputs (labels, masks) may differ from the reference's in this small a share of elements: another
# rounding flips a value that sits on a threshold. The default of ``parity.min_discrete_agreement`` too.
DISCRETE_AGREEMENT = 0.999
# The parity gate's default (``parity.rtol``): max|fused - reference| / max|reference| over every batch.
GATE_RTOL = 1e-4
# A module-stage pass's own check of each replacement it makes, on the module's own input (``rtol`` of
# ``passes.reparameterize`` and ``passes.batchnorm_forms``).
MODULE_CHECK_RTOL = 1e-4
# A lossy variant (int8, bf16) is judged by its accuracy gate; a later check of what is loaded only asks that it
# still computes the model: a relative error this large (or NaN) means its outputs are unrelated to it.
LOSSY_MAX_ERROR = 1.0


def rounding_tolerance(dtype: torch.dtype, own_error: float = 0.0, factor: float = RUNTIME_FACTOR) -> float:
    """What an output of ``dtype`` may differ by: float rounding, or ``factor`` times a known own error."""
    return max(ROUNDING_RTOL.get(dtype, ROUNDING_RTOL[torch.float32]), factor * own_error)
