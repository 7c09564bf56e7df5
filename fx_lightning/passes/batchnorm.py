"""BatchNorm folding: ``fuse_conv_bn``, ``fuse_linear_bn`` and ``fuse_bn_into_next``.

An eval-mode BatchNorm is a per-channel affine map. It folds into the conv/linear that produces its input
(:mod:`.bn_producer`: right before it, a concatenation of convs, or through layout operations that keep each
output feature on one channel), or into every Linear/conv that reads its output (:mod:`.bn_consumer`: through
layout operations, concatenations and copying pads; a zero padding would pad the *normalised* input with zeros,
so those are left alone). Every BatchNorm left gets a reason that names what stands in the way on each side
(:mod:`.bn_reasons`). The arithmetic is :mod:`.fold_math`, the node views :mod:`.bn_views`. A module called at
several sites gets one fused copy per site; the original stays for the other sites, so no call site is ever
changed by folding another.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Dict, List, Tuple, Union

import torch
import torch.fx as fx

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, RemainingBatchNorm, builtin_pass
from fx_lightning.passes.bn_consumer import plan_into_consumers
from fx_lightning.passes.bn_producer import FoldPlan, plan_into_producer
from fx_lightning.passes.bn_reasons import explain_batchnorm
from fx_lightning.passes.bn_views import (
    BatchNorm,
    Refused,
    apply_channel_fold,
    bn_input,
    describe,
    is_batchnorm_node,
    match_bn,
    remove_batchnorm,
)
from fx_lightning.passes.graph_utils import delete_unused_attributes

__all__ = [
    "FoldDtype",
    "FoldOptions",
    "is_batchnorm_node",
    "fuse_conv_bn",
    "fuse_linear_bn",
    "fuse_bn_into_next",
    "unfused_batchnorm_reasons",
]


# ------------------------------------------------------------------------------------------- options


class FoldDtype(str, Enum):
    """Precision in which BatchNorm statistics are folded before casting back to the parameter dtype."""

    float64 = "float64"
    float32 = "float32"


@dataclass
class FoldOptions(PassOptions):
    """What every BatchNorm fold takes (``fuse_conv_bn``, ``fuse_linear_bn``, ``fuse_bn_into_next``)."""

    # fp64 folding keeps fp32 results within rounding of an fp64 reference; fp32 is for devices without fp64.
    fold_dtype: FoldDtype = FoldDtype.float64
    # A layer called at several sites gets one fused copy per site; off: such sites are skipped.
    copy_shared_modules: bool = True


# -------------------------------------------------------------------------------------------- passes

Plan = Union[FoldPlan, str, None]  # what a fold side makes of one BatchNorm: a plan, why not, or nothing to try
AnyBatchNorm = Union[BatchNorm, Refused]


def _fold_all(gm: fx.GraphModule, options: FoldOptions, plan_for: Callable[[fx.Node, AnyBatchNorm, torch.dtype], Plan],
              refusal: Callable[[fx.Node, AnyBatchNorm, str], Tuple[str, Dict[str, object]]]) -> PassResult:
    """Every BatchNorm that ``plan_for`` plans a fold of, folded; each it refuses skipped with ``refusal``'s
    (reason, facts)."""
    result = PassResult()
    dtype = torch.float64 if FoldDtype(options.fold_dtype) is FoldDtype.float64 else torch.float32
    for node in list(gm.graph.nodes):
        bn = match_bn(gm, node)
        plan = plan_for(node, bn, dtype) if bn is not None else None
        if isinstance(plan, str):
            reason, facts = refusal(node, bn, plan)  # type: ignore[arg-type]
            result.skip(node.name, reason, **facts)
        if not isinstance(plan, FoldPlan):
            continue
        for fold in plan.folds:
            apply_channel_fold(gm, fold, options.copy_shared_modules)
        assert isinstance(bn, BatchNorm)
        remove_batchnorm(gm, bn, bn.input)
        result.change(node.name, plan.what, into=plan.into, kind=plan.kind)
    if result.changed:
        delete_unused_attributes(gm)
    return result


def _fold_producer(gm: fx.GraphModule, ctx: PassContext, kinds: Tuple[str, ...], options: FoldOptions) -> PassResult:
    return _fold_all(
        gm, options, lambda node, bn, dtype: plan_into_producer(gm, ctx, node, bn, kinds, options.copy_shared_modules,
                                                                dtype),
        lambda node, bn, reason: (reason, {"into": describe(bn_input(node))} if isinstance(bn, BatchNorm) else {}))


@builtin_pass("fuse_conv_bn", options=FoldOptions)
def fuse_conv_bn(gm: fx.GraphModule, options: FoldOptions, ctx: PassContext) -> PassResult:
    """Fold every BatchNorm that follows a Conv/ConvTranspose (any groups), a concatenation of them, or one through
    layout operations that keep its channels, into it."""
    return _fold_producer(gm, ctx, ("conv", "conv_transpose"), options)


@builtin_pass("fuse_linear_bn", options=FoldOptions)
def fuse_linear_bn(gm: fx.GraphModule, options: FoldOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm that follows a Linear (directly, or through layout operations such as a transpose or a
    flatten of its leading axes) when the shapes show it normalises the Linear's output features."""
    return _fold_producer(gm, ctx, ("linear",), options)


@builtin_pass("fuse_bn_into_next", options=FoldOptions)
def fuse_bn_into_next(gm: fx.GraphModule, options: FoldOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm into every Linear/conv its output reaches (through layout operations and concatenations),
    when nothing else reads it and no zero padding is in the way; every BatchNorm left gets the reason."""
    copy_shared = options.copy_shared_modules
    return _fold_all(
        gm, options, lambda node, bn, dtype: plan_into_consumers(gm, ctx, node, bn, copy_shared, dtype)
        if isinstance(bn, BatchNorm) else bn.reason,
        # the reason names what blocks a fold on both sides, not only this one
        lambda node, bn, reason: (explain_batchnorm(gm, ctx, node, copy_shared), {}))


def unfused_batchnorm_reasons(gm: fx.GraphModule) -> List[RemainingBatchNorm]:
    """For each BatchNorm still in the graph, what stands in the way of a fold on either side (used when no pass
    gave a reason)."""
    ctx = PassContext(shapes_known=True)
    return [RemainingBatchNorm(node.name, explain_batchnorm(gm, ctx, node))
            for node in gm.graph.nodes if match_bn(gm, node) is not None]
