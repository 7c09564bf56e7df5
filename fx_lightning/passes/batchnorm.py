"""BatchNorm folding: ``fuse_conv_bn``, ``fuse_linear_bn`` and ``fuse_bn_into_next``.

A BatchNorm folds into the conv/linear that produces its input, or into the Linear or unpadded conv that
consumes its output (a padded conv would pad the *normalised* input with zeros, which is not the same as
padding the raw input, so those are left alone). The arithmetic is :mod:`.fold_math`, the node views
:mod:`.bn_views`. A module called at several sites gets one fused copy per site; the original stays for the
other sites, so no call site is ever changed by folding another.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, builtin_pass
from fx_lightning.passes.bn_views import (
    BatchNorm,
    Layer,
    apply_layer_weights,
    describe,
    is_batchnorm_node,
    layer_kind,
    match_bn,
    match_layer,
    remove_batchnorm,
)
from fx_lightning.passes.fold_math import fold_bn_into_input, fold_bn_into_output
from fx_lightning.passes.graph_utils import delete_unused_attributes, node_shape

__all__ = [
    "FoldDtype",
    "FuseConvBNOptions",
    "FuseLinearBNOptions",
    "FuseBNIntoNextOptions",
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

def _dtype(fold: Any) -> torch.dtype:
    return torch.float64 if FoldDtype(fold) is FoldDtype.float64 else torch.float32


# -------------------------------------------------------------------------------------------- passes


def _fold_producer(
    gm: fx.GraphModule, ctx: PassContext, result: PassResult, kinds: Tuple[str, ...], options: Any,
    check: Callable[[fx.GraphModule, PassContext, BatchNorm, Layer], Optional[str]],
) -> None:
    dtype = _dtype(options.fold_dtype)
    for node in list(gm.graph.nodes):
        bn = match_bn(gm, node)
        if bn is None:
            continue
        producer = node.args[0] if node.args else None
        layer = match_layer(gm, producer)
        if layer is None:
            continue
        if isinstance(layer, str):
            if layer_kind(gm, producer) in kinds:
                result.skip(node.name, f"follows {describe(producer)}, which cannot be folded: {layer}")
            continue
        if layer.kind not in kinds:
            continue
        if isinstance(bn, str):
            result.skip(node.name, bn)
            continue
        reason = _common_checks(bn, layer) or check(gm, ctx, bn, layer)
        if reason is None:
            scale, shift = bn.scale_shift(dtype)
            w, b = fold_bn_into_output(
                layer.weight, layer.bias, scale.to(layer.weight.device), shift.to(layer.weight.device),
                transposed=layer.kind == "conv_transpose", groups=layer.groups,
            )
            reason = apply_layer_weights(gm, layer, w, b, options.copy_shared_modules)
        if reason is not None:
            result.skip(node.name, reason, into=describe(producer))
            continue
        remove_batchnorm(gm, bn, producer)
        result.change(node.name, "folded", into=describe(producer), kind=layer.kind)
    if result.changed:
        delete_unused_attributes(gm)


def _common_checks(bn: BatchNorm, layer: Layer) -> Optional[str]:
    if len(layer.node.users) != 1:
        others = [u.name for u in layer.node.users if u is not bn.node]
        return f"the output of {describe(layer.node)} also feeds {', '.join(others)}; folding would change them"
    if layer.out_channels != bn.num_features:
        return f"{describe(layer.node)} has {layer.out_channels} output channels, the BatchNorm {bn.num_features}"
    return None


def _conv_check(gm: fx.GraphModule, ctx: PassContext, bn: BatchNorm, layer: Layer) -> Optional[str]:
    shape = node_shape(layer.node)
    if shape is not None and len(shape) != layer.weight.dim():
        return f"unbatched conv output of rank {len(shape)}: the BatchNorm's channel axis is not the conv's"
    return None


def _linear_check(gm: fx.GraphModule, ctx: PassContext, bn: BatchNorm, layer: Layer) -> Optional[str]:
    ctx.ensure_shapes(gm)
    shape = node_shape(layer.node)
    if shape is None:
        return (
            "the Linear's output rank is unknown, and BatchNorm1d normalises axis 1, which is the Linear's "
            "output axis only for 2-D outputs: pass example_inputs to fuse() (the callback does) so shapes are known"
        )
    if len(shape) != 2:
        return (
            f"BatchNorm1d normalises axis 1 of the Linear's rank-{len(shape)} output {list(shape)}, but the "
            "Linear's outputs are on the last axis: not foldable"
        )
    return None


@builtin_pass("fuse_conv_bn", position=30, options=FuseConvBNOptions)
def fuse_conv_bn(gm: fx.GraphModule, options: FuseConvBNOptions, ctx: PassContext) -> PassResult:
    """Fold every BatchNorm that follows a Conv/ConvTranspose (any groups) into it."""
    result = PassResult()
    _fold_producer(gm, ctx, result, ("conv", "conv_transpose"), options, _conv_check)
    return result


@builtin_pass("fuse_linear_bn", position=40, options=FuseLinearBNOptions)
def fuse_linear_bn(gm: fx.GraphModule, options: FuseLinearBNOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm1d that follows a Linear, when the shapes show it normalises the Linear's outputs."""
    result = PassResult()
    _fold_producer(gm, ctx, result, ("linear",), options, _linear_check)
    return result


# After the producer folds: a BatchNorm that could fold backwards already has.
@builtin_pass("fuse_bn_into_next", position=50, options=FuseBNIntoNextOptions)
def fuse_bn_into_next(gm: fx.GraphModule, options: FuseBNIntoNextOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm into the Linear or unpadded conv that is its only consumer."""
    result = PassResult()
    dtype = _dtype(options.fold_dtype)
    for node in list(gm.graph.nodes):
        bn = match_bn(gm, node)
        if bn is None or isinstance(bn, str) or len(node.users) != 1:
            continue
        (consumer,) = node.users
        layer = match_layer(gm, consumer)
        if layer is None or isinstance(layer, str) or consumer.args[0] is not node:
            continue
        reason = None
        if layer.kind == "conv_transpose":
            reason = "a BatchNorm before a ConvTranspose does not fold exactly (border taps see fewer inputs)"
        elif not layer.zero_padding:
            reason = f"{describe(consumer)} pads its input, and the padding would see un-normalised zeros"
        elif layer.in_channels != bn.num_features:
            reason = f"{describe(consumer)} has {layer.in_channels} input channels, the BatchNorm {bn.num_features}"
        elif layer.kind == "linear":
            ctx.ensure_shapes(gm)
            shape = node_shape(node)
            if shape is None:
                reason = "the BatchNorm's output rank is unknown: pass example_inputs so shapes are known"
            elif len(shape) != 2:
                reason = f"BatchNorm1d output of rank {len(shape)} feeds a Linear over another axis"
        elif (shape := node_shape(node)) is not None and len(shape) != layer.weight.dim():
            reason = "unbatched input: the BatchNorm's channel axis is not the conv's"
        if reason is None:
            scale, shift = bn.scale_shift(dtype)
            w, b = fold_bn_into_input(
                layer.weight, layer.bias, scale.to(layer.weight.device), shift.to(layer.weight.device),
                groups=layer.groups,
            )
            reason = apply_layer_weights(gm, layer, w, b, options.copy_shared_modules)
        if reason is not None:
            result.skip(node.name, reason, into=describe(consumer))
            continue
        remove_batchnorm(gm, bn, bn.input)
        result.change(node.name, "folded forward", into=describe(consumer), kind=layer.kind)
    if result.changed:
        delete_unused_attributes(gm)
    return result


def unfused_batchnorm_reasons(gm: fx.GraphModule) -> List[Dict[str, Any]]:
    """For each BatchNorm still in the graph, what surrounds it (used when no pass gave a reason)."""
    out = []
    for node in gm.graph.nodes:
        bn = match_bn(gm, node)
        if bn is None:
            continue
        if isinstance(bn, str):
            out.append({"node": node.name, "reason": bn})
            continue
        users = ", ".join(describe(u) for u in node.users)
        out.append({
            "node": node.name,
            "reason": f"follows {describe(bn.input)} (not a conv/linear it can fold into) and feeds {users}",
        })
    return out
