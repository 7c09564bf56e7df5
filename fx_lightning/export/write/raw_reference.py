"""What a raw input means to the original model: the training-time normalisation, in fp64, written here in plain
torch independently of the export's prologue (:mod:`fx_lightning.export.write.prologue`), so that comparing the two
checks the prologue rather than repeating it.

:class:`NormalisedReference` is the fp64 reference of an export with ``export.preprocess`` (``check.pt``'s expected
outputs, each artifact's round trip); :func:`compare_raw_path` is parity's raw-path comparison.
"""

from __future__ import annotations

import copy
from typing import Any, List, Sequence

import torch
from torch import nn

from fx_lightning.common.batches import flat_tensors, model_device_dtype
from fx_lightning.export.manifest import Preprocess
from fx_lightning.parity.compare import Comparison, compare_outputs, relative_error
from fx_lightning.common.tolerance import DISCRETE_AGREEMENT

__all__ = ["normalise_fp64", "NormalisedReference", "compare_raw_path"]


def normalise_fp64(raw: torch.Tensor, preprocess: Preprocess) -> torch.Tensor:
    """Raw pixels -> the normalised NCHW RGB input, in fp64, channel by channel."""
    pixels = raw.to(torch.float64)
    channel_axis = 3 if preprocess.layout == "NHWC" else 1
    count = pixels.shape[channel_axis]
    # RGB channel c of the model is channel c of the input, or channel count-1-c of a BGR input.
    order = [count - 1 - c for c in range(count)] if preprocess.channel_order == "BGR" else list(range(count))
    planes = [(pixels.select(channel_axis, source) * preprocess.scale - preprocess.mean[c]) / preprocess.std[c]
              for c, source in enumerate(order)]
    return torch.stack(planes, dim=1)


class NormalisedReference(nn.Module):
    """Raw input -> :func:`normalise_fp64` -> ``model`` (in the model's dtype: fp64 in a ``.double()`` copy)."""

    def __init__(self, model: nn.Module, preprocess: Preprocess) -> None:
        super().__init__()
        self.model = model
        self.preprocess = preprocess

    def forward(self, raw: torch.Tensor) -> Any:
        _, dtype = model_device_dtype(self.model)
        return self.model(normalise_fp64(raw, self.preprocess).to(dtype or torch.float64))


def compare_raw_path(exported: nn.Module, original: nn.Module, raw_batches: Sequence[torch.Tensor],
                     preprocess: Preprocess, min_agreement: float = DISCRETE_AGREEMENT) -> Comparison:
    """``exported`` (prologue + fused, fp32) on each raw batch against fp64 normalisation + an fp64 copy of
    ``original`` (the unfused model). Each output may differ by its dtype's rounding or a few times the error
    fp32 arithmetic costs ``original`` itself on the same inputs (the export's rule for artifacts)."""
    exact_model = NormalisedReference(copy.deepcopy(original).double(), preprocess)
    plain = NormalisedReference(original, preprocess)
    got: List[torch.Tensor] = []
    want: List[torch.Tensor] = []
    own = 0.0
    with torch.no_grad():
        for raw in raw_batches:
            outs, exact = flat_tensors(exported(raw)), flat_tensors(exact_model(raw))
            own = max([own] + [relative_error(p.double(), e) for p, e in zip(flat_tensors(plain(raw)), exact)
                               if e.is_floating_point()])
            got += outs
            want += [e.to(o.dtype) if o.is_floating_point() and e.is_floating_point() else e
                     for o, e in zip(outs, exact)]
    return compare_outputs(got, want, own_error=own, nested=False, min_agreement=min_agreement)
