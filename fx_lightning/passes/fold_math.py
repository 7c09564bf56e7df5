"""The arithmetic of folding an eval-mode BatchNorm into a conv/linear.

In eval mode a BatchNorm is the per-channel affine map ``y = x * s + t`` with
``s = gamma / sqrt(running_var + eps)`` and ``t = beta - running_mean * s``. It folds exactly into
  - the conv/linear that produces its input (scale the output channels of W, ``b' = b * s + t``);
  - the Linear or unpadded conv that consumes its output (scale the input channels of W,
    ``b' = b + W @ t``).
The statistics are folded in fp64 (by default) and the results cast back to the weight's dtype.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["bn_scale_shift", "fold_bn_into_output", "fold_bn_into_input"]


def bn_scale_shift(
    running_mean: torch.Tensor,
    running_var: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    dtype: torch.dtype = torch.float64,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The eval-mode BatchNorm as ``x * scale + shift``, computed in ``dtype``."""
    mean = running_mean.detach().to(dtype)
    scale = torch.rsqrt(running_var.detach().to(dtype) + eps)
    if weight is not None:
        scale = scale * weight.detach().to(dtype)
    shift = -mean * scale
    if bias is not None:
        shift = shift + bias.detach().to(dtype)
    return scale, shift


def fold_bn_into_output(
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    transposed: bool,
    groups: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fold a per-output-channel affine map into a conv/linear; returns (weight, bias) in the input dtype.

    Conv and Linear weights put output channels on axis 0. ConvTranspose weights are
    ``[in, out/groups, *k]``: output channel ``g * out/groups + j`` lives at ``[g-th block of in, j]``.
    """
    w, scale_w = _weight_work(weight, scale)
    b = bias.detach().to(scale.dtype) if bias is not None else torch.zeros_like(shift)
    if transposed:
        in_ch, out_per_group = w.shape[0], w.shape[1]
        k = w.shape[2:]
        view = w.reshape(groups, in_ch // groups, out_per_group, *k)
        s = scale_w.reshape(groups, 1, out_per_group, *([1] * len(k)))
        new_w = (view * s).reshape(w.shape)
    else:
        new_w = w * scale_w.reshape(-1, *([1] * (w.dim() - 1)))
    new_b = b * scale + shift
    return new_w.to(weight.dtype), new_b.to(weight.dtype)


def fold_bn_into_input(
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    groups: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Fold a per-input-channel affine map into the Linear / unpadded conv that consumes it.

    Conv weights are ``[out, in/groups, *k]``; output channel ``o`` of group ``g`` reads input
    channels ``g * in/groups + j``. Linear is the ``groups=1``, no-kernel case.
    """
    work = scale.dtype
    w, scale_w = _weight_work(weight, scale)
    out_ch, in_per_group = w.shape[0], w.shape[1]
    view = w.reshape(groups, out_ch // groups, in_per_group, -1)
    s = scale_w.reshape(groups, 1, in_per_group, 1)
    t = shift.reshape(groups, 1, in_per_group, 1)
    new_w = (view * s).reshape(w.shape)
    # The bias term sums over the kernel: do it in the fold dtype, where cancellation is harmless.
    extra = (view.to(work) * t).sum(dim=(2, 3)).reshape(out_ch)
    b = bias.detach().to(work) if bias is not None else torch.zeros(out_ch, dtype=work, device=w.device)
    return new_w.to(weight.dtype), (b + extra).to(weight.dtype)


def _weight_work(weight: torch.Tensor, scale: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The weight and the scale in the dtype for the elementwise weight product.

    The per-channel statistics are folded in the fold dtype (fp64 by default); the product with the
    weight needs only one rounding, so it runs in max(weight dtype, fp32): converting every weight to
    fp64 would double the time and memory of fusing a large model for no measurable gain.
    """
    dtype = torch.promote_types(weight.dtype, torch.float32)
    return weight.detach().to(dtype), scale.to(dtype)
