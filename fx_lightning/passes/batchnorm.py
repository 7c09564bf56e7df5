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
from typing import Any, Callable, List, Optional, Tuple, Union

import torch
import torch.fx as fx

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, RemainingBatchNorm, builtin_pass
from fx_lightning.passes.bn_views import (
    BatchNorm,
    Layer,
    Refused,
    apply_layer_weights,
    describe,
    bn_input,
    bn_reader,
    is_batchnorm_node,
    layer_kind,
    match_bn,
    match_layer,
    node_arg,
    remove_batchnorm,
    weights_refusal,
)
from fx_lightning.passes.fold_math import fold_bn_into_input, fold_bn_into_output
from fx_lightning.passes.graph_utils import delete_unused_attributes, node_shape, value_users

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
        producer = bn_input(node)
        if "linear" in kinds and _flattened(producer) is not None:
            _fold_through_flatten(gm, ctx, result, node, bn, producer, options)
            continue
        if "conv" in kinds and _concat_parts(producer) is not None:
            _fold_into_concat(gm, ctx, result, node, bn, producer, options)
            continue
        layer = match_layer(gm, producer)
        if layer is None:
            continue
        if isinstance(layer, Refused):
            if layer_kind(gm, producer) in kinds:
                result.skip(node.name, f"follows {describe(producer)}, which cannot be folded: {layer.reason}")
            continue
        if layer.kind not in kinds:
            continue
        if isinstance(bn, Refused):
            result.skip(node.name, bn.reason)
            continue
        reason = _common_checks(bn, layer) or check(gm, ctx, bn, layer)
        if reason is None:
            reason = _fold_output(gm, layer, bn, dtype, options)
        if reason is not None:
            result.skip(node.name, reason, into=describe(producer))
            continue
        remove_batchnorm(gm, bn, producer)
        result.change(node.name, "folded", into=describe(producer), kind=layer.kind)
    if result.changed:
        delete_unused_attributes(gm)


def _fold_output(gm: fx.GraphModule, layer: Layer, bn: BatchNorm, dtype: torch.dtype, options: Any,
                 channels: Optional[slice] = None) -> Optional[str]:
    """Fold ``bn`` (its ``channels`` slice, for one input of a concatenation) into the layer's outputs."""
    scale, shift = bn.scale_shift(dtype)
    if channels is not None:
        scale, shift = scale[channels], shift[channels]
    w, b = fold_bn_into_output(
        layer.weight, layer.bias, scale.to(layer.weight.device), shift.to(layer.weight.device),
        transposed=layer.kind == "conv_transpose", groups=layer.groups,
    )
    return apply_layer_weights(gm, layer, w, b, options.copy_shared_modules)


def _only_feeds(node: fx.Node, user: fx.Node) -> Optional[str]:
    """Why folding would change other readers of ``node``'s values (shape-only readers do not count)."""
    others = [describe(u) for u in value_users(node) if u is not user]
    if others:
        return f"the output of {describe(node)} also feeds {', '.join(others)}; folding would change them"
    return None


def _common_checks(bn: BatchNorm, layer: Layer) -> Optional[str]:
    reason = _only_feeds(layer.node, bn_reader(bn.node))
    if reason is None and layer.out_channels != bn.num_features:
        reason = f"{describe(layer.node)} has {layer.out_channels} output channels, the BatchNorm {bn.num_features}"
    return reason


# ---------------------------------------------------------------- Linear -> flatten -> BatchNorm1d

_RESHAPES = {"flatten", "reshape", "view"}
_ATEN_RESHAPES = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default,
                  torch.ops.aten.flatten.using_ints}


def _flattened(node: Any) -> Optional[fx.Node]:
    """The input of a reshape-family call (``x.flatten(0, 1)``, ``x.reshape(-1, C)``, ATen ``view``...), else None."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    reshape = (node.op == "call_method" and node.target in _RESHAPES) or (
        node.op == "call_function" and (node.target in (torch.flatten, torch.reshape) or node.target in _ATEN_RESHAPES))
    return node.args[0] if reshape else None


def _fold_through_flatten(gm: fx.GraphModule, ctx: PassContext, result: PassResult, node: fx.Node,
                          bn: Union[BatchNorm, Refused], reshape: fx.Node, options: Any) -> None:
    """Linear -> (merge the leading axes) -> BatchNorm1d: the BatchNorm normalises the Linear's output features,
    so it folds into the Linear exactly; the reshape stays."""
    layer = match_layer(gm, _flattened(reshape))
    if not isinstance(layer, Layer) or layer.kind != "linear":
        return  # not a Linear behind the reshape: unfused_batchnorm_reasons describes it
    if isinstance(bn, Refused):
        result.skip(node.name, bn.reason)
        return
    ctx.ensure_shapes(gm)
    out, flat = node_shape(layer.node), node_shape(reshape)
    reason = _only_feeds(layer.node, reshape) or _only_feeds(reshape, bn_reader(node))
    if reason is None and (out is None or flat is None):
        reason = "shapes unknown around the reshape: pass example_inputs so they are known"
    elif reason is None and not (len(flat) == 2 and flat[-1] == out[-1] == bn.num_features and len(out) >= 2):
        reason = (f"the reshape of the Linear's output {list(out)} to {list(flat)} does not keep its features "
                  f"({bn.num_features}) on the BatchNorm's channel axis")
    if reason is None:
        reason = _fold_output(gm, layer, bn, _dtype(options.fold_dtype), options)
    if reason is not None:
        result.skip(node.name, reason, into=describe(layer.node))
        return
    remove_batchnorm(gm, bn, reshape)
    result.change(node.name, "folded through a reshape", into=describe(layer.node), kind="linear")


# -------------------------------------------------------------------- concat of convs -> BatchNorm

_CATS = {torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default}


def _concat_parts(node: Any) -> Optional[Tuple[list, Any]]:
    """(inputs, dim) of a ``torch.cat`` call, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _CATS or not node.args:
        return None
    parts = node.args[0]
    if not isinstance(parts, (list, tuple)):
        return None
    return list(parts), node_arg(node, 1, "dim", 0)


def _fold_into_concat(gm: fx.GraphModule, ctx: PassContext, result: PassResult, node: fx.Node,
                      bn: Union[BatchNorm, Refused], cat: fx.Node, options: Any) -> None:
    """cat([conv_a, conv_b, ...], dim=channels) -> BatchNorm: each conv owns a slice of the channels, and that
    slice of the BatchNorm folds into it exactly."""
    parts, dim = _concat_parts(cat)  # type: ignore[misc]
    matched = [match_layer(gm, p) for p in parts]
    layers = [x for x in matched if isinstance(x, Layer) and x.kind in ("conv", "conv_transpose")]
    if not layers or len(layers) != len(matched):
        return  # not all convs: unfused_batchnorm_reasons describes it
    if isinstance(bn, Refused):
        result.skip(node.name, bn.reason)
        return
    reason = _concat_refusal(gm, ctx, node, bn, cat, layers, dim, options)
    if reason is not None:
        result.skip(node.name, reason, into=describe(cat))
        return
    start, dtype = 0, _dtype(options.fold_dtype)
    for layer in layers:
        _fold_output(gm, layer, bn, dtype, options, slice(start, start + layer.out_channels))
        start += layer.out_channels
    remove_batchnorm(gm, bn, cat)
    result.change(node.name, "folded into a concatenation", into=", ".join(describe(x.node) for x in layers),
                  kind="conv")


def _concat_refusal(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, cat: fx.Node,
                    layers: List[Layer], dim: Any, options: Any) -> Optional[str]:
    for layer in layers:
        reason = _only_feeds(layer.node, cat) or weights_refusal(gm, layer, options.copy_shared_modules)
        if reason is not None:
            return reason
    reason = _only_feeds(cat, bn_reader(node))
    if reason is not None:
        return reason
    if sum(x.out_channels for x in layers) != bn.num_features:
        return f"the concatenated convs have {sum(x.out_channels for x in layers)} channels, the BatchNorm {bn.num_features}"
    ctx.ensure_shapes(gm)
    shape = node_shape(cat)
    if shape is None:
        return "shapes unknown: pass example_inputs so the concatenation axis can be checked"
    if not isinstance(dim, int) or dim % len(shape) != 1 or len(shape) != layers[0].weight.dim():
        return f"the concatenation (dim={dim}, output rank {len(shape)}) is not along the channels"
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


@builtin_pass("fuse_conv_bn", options=FuseConvBNOptions)
def fuse_conv_bn(gm: fx.GraphModule, options: FuseConvBNOptions, ctx: PassContext) -> PassResult:
    """Fold every BatchNorm that follows a Conv/ConvTranspose (any groups), or a concatenation of them, into it."""
    result = PassResult()
    _fold_producer(gm, ctx, result, ("conv", "conv_transpose"), options, _conv_check)
    return result


@builtin_pass("fuse_linear_bn", options=FuseLinearBNOptions)
def fuse_linear_bn(gm: fx.GraphModule, options: FuseLinearBNOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm1d that follows a Linear (directly, or over its flattened leading axes) when the shapes
    show it normalises the Linear's outputs."""
    result = PassResult()
    _fold_producer(gm, ctx, result, ("linear",), options, _linear_check)
    return result


@builtin_pass("fuse_bn_into_next", options=FuseBNIntoNextOptions)
def fuse_bn_into_next(gm: fx.GraphModule, options: FuseBNIntoNextOptions, ctx: PassContext) -> PassResult:
    """Fold a BatchNorm into the Linear or unpadded conv that is its only consumer."""
    result = PassResult()
    dtype = _dtype(options.fold_dtype)
    for node in list(gm.graph.nodes):
        bn = match_bn(gm, node)
        consumers = value_users(node)
        if not isinstance(bn, BatchNorm) or len(consumers) != 1:
            continue
        (consumer,) = consumers
        layer = match_layer(gm, consumer)
        if not isinstance(layer, Layer) or consumer.args[0] is not node:
            continue
        reason = _into_next_refusal(gm, ctx, node, bn, layer)
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


def _into_next_refusal(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, layer: Layer) -> Optional[str]:
    consumer = layer.node
    if layer.kind == "conv_transpose":
        return "a BatchNorm before a ConvTranspose does not fold exactly (border taps see fewer inputs)"
    if not layer.zero_padding:
        return f"{describe(consumer)} pads its input, and the padding would see un-normalised zeros"
    if layer.in_channels != bn.num_features:
        return f"{describe(consumer)} has {layer.in_channels} input channels, the BatchNorm {bn.num_features}"
    if layer.kind == "linear":
        ctx.ensure_shapes(gm)
        shape = node_shape(node)
        if shape is None:
            return "the BatchNorm's output rank is unknown: pass example_inputs so shapes are known"
        if len(shape) != 2:
            return f"BatchNorm1d output of rank {len(shape)} feeds a Linear over another axis"
        return None
    shape = node_shape(node)
    if shape is not None and len(shape) != layer.weight.dim():
        return "unbatched input: the BatchNorm's channel axis is not the conv's"
    return None


def unfused_batchnorm_reasons(gm: fx.GraphModule) -> List[RemainingBatchNorm]:
    """For each BatchNorm still in the graph, what surrounds it (used when no pass gave a reason)."""
    out = []
    for node in gm.graph.nodes:
        bn = match_bn(gm, node)
        if bn is None:
            continue
        if isinstance(bn, Refused):
            out.append(RemainingBatchNorm(node.name, bn.reason))
            continue
        users = ", ".join(describe(u) for u in node.users)
        reason = f"follows {describe(bn.input)} (not a conv/linear it can fold into) and feeds {users}"
        out.append(RemainingBatchNorm(node.name, reason))
    return out
