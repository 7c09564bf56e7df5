"""Options dataclasses of the built-in passes.

They live in one small module, free of graph code, so that the config schema can import them without
importing the passes themselves. Each pass module re-exports its own options class.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = [
    "FoldDtype",
    "PassOptions",
    "FuseConvBNOptions",
    "FuseLinearBNOptions",
    "FuseBNIntoNextOptions",
    "RemoveDropoutOptions",
    "RemoveIdentityOptions",
    "EliminateDeadCodeOptions",
]


class FoldDtype(str, Enum):
    """Precision in which BatchNorm statistics are folded before casting back to the parameter dtype."""

    float64 = "float64"
    float32 = "float32"


@dataclass
class PassOptions:
    enabled: bool = True


@dataclass
class FuseConvBNOptions(PassOptions):
    # fp64 folding keeps fp32 results within rounding of an fp64 reference; fp32 is for devices without fp64.
    fold_dtype: FoldDtype = FoldDtype.float64
    # A conv called at several sites gets one fused copy per site; off: such sites are skipped.
    copy_shared_modules: bool = True


@dataclass
class FuseLinearBNOptions(PassOptions):
    fold_dtype: FoldDtype = FoldDtype.float64
    copy_shared_modules: bool = True


@dataclass
class FuseBNIntoNextOptions(PassOptions):
    """Fold a BatchNorm into the Linear or unpadded conv that consumes it (pre-activation blocks)."""

    fold_dtype: FoldDtype = FoldDtype.float64
    copy_shared_modules: bool = True


@dataclass
class RemoveDropoutOptions(PassOptions):
    # F.dropout(x, training=True) is active even in eval mode: removing it changes outputs, so it is
    # left alone (and reported) unless asked for.
    remove_active_functional: bool = False


@dataclass
class RemoveIdentityOptions(PassOptions):
    pass


@dataclass
class EliminateDeadCodeOptions(PassOptions):
    pass
