"""Checks for the module-stage passes: a submodule replaced before capture must compute what it did.

Each candidate's input is recorded on the example inputs (one forward of the working copy), and the
replacement is run on it beside the original; a replacement whose output moves beyond a tolerance is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import nn

from fx_lightning.common.batches import detached
from fx_lightning.common.tolerance import MODULE_CHECK_RTOL
from fx_lightning.parity.compare import Comparison, compare_outputs
from fx_lightning.passes.base import PassOptions

__all__ = ["ModuleCheckOptions", "record_module_inputs", "output_change"]

Recorded = Tuple[tuple, dict]


@dataclass
class ModuleCheckOptions(PassOptions):
    """Options of a pass that replaces submodules before capture."""

    # A replacement whose output moves by more than this (max|after - before| / max|before|, on the input the
    # module received) is refused: the module is left, or put back, as it was.
    rtol: float = MODULE_CHECK_RTOL

    def check(self) -> None:
        if not math.isfinite(self.rtol) or self.rtol < 0:
            raise ValueError(f"rtol: must be a finite number >= 0, got {self.rtol}.")


def record_module_inputs(
    root: nn.Module, wanted: Callable[[nn.Module], bool], example_inputs: Optional[tuple]
) -> Dict[int, Recorded]:
    """The first (args, kwargs) each submodule for which ``wanted`` holds receives when ``root`` runs on
    ``example_inputs`` (keyed by ``id(module)``; empty without inputs)."""
    seen: Dict[int, Recorded] = {}
    if example_inputs is None:
        return seen

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault(id(mod), (args, kwargs))

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in root.modules() if wanted(m)]
    if not handles:
        return seen
    try:
        with torch.no_grad():
            root(*example_inputs)
    finally:
        for h in handles:
            h.remove()
    return seen


def output_change(before: nn.Module, after: Callable[[], nn.Module], recorded: Optional[Recorded],
                  rtol: float) -> Tuple[nn.Module, Optional[Comparison]]:
    """Run ``before`` on its recorded input, build the replacement (``after()``, which may change ``before`` in
    place) and run it on the same input: ``(replacement, its outputs compared with the old ones at rtol)``,
    structure first (count, nesting, shapes, dtypes); the comparison is None without a recorded input (then
    nothing is run)."""
    with torch.no_grad():
        old = detached(before(*recorded[0], **recorded[1])) if recorded is not None else None
        new_module = after()
        if recorded is None:
            return new_module, None
        return new_module, compare_outputs(new_module(*recorded[0], **recorded[1]), old, rtol=rtol)
