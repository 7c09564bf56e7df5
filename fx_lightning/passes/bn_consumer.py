"""Where a BatchNorm can fold into the layers that read its output: planned here, applied by ``fuse_bn_into_next``.

From the BatchNorm, its values are followed through layout operations (:mod:`.bn_layout`: transpose, reshape,
unsqueeze/squeeze, slicing and chunks, reflect/replicate/circular padding, concatenation with other values) to
every place they reach. The fold is exact when every such place is a Linear or conv reading them as its input,
each of its input features carries one BatchNorm channel (or none: another part of a concatenation), and a conv
pads nothing or pads by copying values (a zero padding is not normalised). Then each layer takes the per-channel
affine map on its input features, ``b' = b + W @ shift`` (:func:`~.fold_math.fold_bn_into_input`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Union

import torch
import torch.fx as fx

from fx_lightning.passes.base import PassContext
from fx_lightning.passes.bn_layout import COPYING_PAD_MODES, along_axis, axis_labels, layout_inputs, run_layout
from fx_lightning.passes.bn_producer import FoldPlan, picked_scale_shift
from fx_lightning.passes.bn_views import (
    BatchNorm,
    ChannelFold,
    Layer,
    Refused,
    describe,
    feature_axis,
    match_layer,
    weights_refusal,
)
from fx_lightning.passes.graph_utils import known_shape, value_users

__all__ = ["Reach", "reach", "plan_into_consumers", "plan_layers", "plan_layer"]


@dataclass
class Reach:
    """Where a BatchNorm's values go: the layout operations they pass, the layers that read them as input, and
    every other reader (with the value it reads), which stops a forward fold."""

    layout: List[fx.Node] = field(default_factory=list)
    layers: List[fx.Node] = field(default_factory=list)
    stops: List[fx.Node] = field(default_factory=list)


def _reads_as_input(node: fx.Node, value: fx.Node, region: set) -> bool:
    """``node`` reads ``value`` as its data input (argument 0) and no other region value in another argument."""
    if not node.args or node.args[0] is not value:
        return False
    others: List[fx.Node] = []
    fx.node.map_arg((node.args[1:], node.kwargs), others.append)
    return not any(o in region for o in others)


def reach(gm: fx.GraphModule, node: fx.Node) -> Reach:
    """Follow ``node``'s values through layout operations to the first reader of each that is not one."""
    out = Reach()
    region = {node}
    todo = [node]
    while todo:
        value = todo.pop()
        for user in value_users(value):
            if user in region or user in out.layers or user in out.stops:
                continue
            inputs = layout_inputs(gm, user)
            if inputs is not None and value in inputs:
                region.add(user)
                out.layout.append(user)
                todo.append(user)
            elif match_layer(gm, user) is not None and _reads_as_input(user, value, region):
                out.layers.append(user)
            else:
                out.stops.append(user)
    # A layer met early may read another of these values in a later argument (F.linear(x, weight=x.t())).
    late = [n for n in out.layers if not _reads_as_input(n, n.args[0], region)]
    out.layers = [n for n in out.layers if n not in late]
    out.stops += late
    return out


def plan_into_consumers(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, copy_shared: bool,
                        dtype: torch.dtype) -> Union[FoldPlan, str]:
    """How ``node`` (a BatchNorm) folds into every layer its values reach, or the reason it cannot."""
    found = reach(gm, node)
    if found.stops:
        return f"its output reaches {', '.join(describe(s) for s in found.stops)}, not a linear layer"
    if not found.layers:
        return "nothing reads its output"
    planned = plan_layers(gm, ctx, node, bn, found, copy_shared, dtype)
    refusal = planned if isinstance(planned, str) else next((f for f in planned if isinstance(f, str)), None)
    if refusal is not None:
        return refusal
    folds = [f for f in planned if isinstance(f, ChannelFold)]
    kinds = sorted({f.layer.kind for f in folds})
    return FoldPlan(folds, "folded forward", ", ".join(describe(f.layer.node) for f in folds), "+".join(kinds))


def plan_layers(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, found: Reach, copy_shared: bool,
                dtype: torch.dtype) -> Union[List[Union[ChannelFold, str]], str]:
    """For each layer ``found`` reaches, its fold of ``node`` (a BatchNorm) or why it cannot take it; or why the
    BatchNorm's channel cannot be followed to them at all."""
    ctx.ensure_shapes(gm)
    shape = known_shape(node)
    if shape is None or len(shape) < 2:
        return "the BatchNorm's output shape is unknown: pass example_inputs so shapes are known"
    labels = run_layout(gm, node, axis_labels(shape, 1), found.layout)
    if isinstance(labels, str):
        return labels
    return [plan_layer(gm, bn, consumer, labels[consumer.args[0]], copy_shared, dtype) for consumer in found.layers]


def plan_layer(gm: fx.GraphModule, bn: BatchNorm, consumer: fx.Node, arrived: object, copy_shared: bool,
              dtype: torch.dtype) -> Union[ChannelFold, str]:
    """The fold of ``bn`` into ``consumer``'s input features, given the labels that ``arrived`` at its input (each
    element's BatchNorm channel, or FOREIGN), or why that layer cannot take it."""
    layer = match_layer(gm, consumer)
    if isinstance(layer, Refused):
        return f"{describe(consumer)} cannot take it: {layer.reason}"
    assert isinstance(layer, Layer)
    if layer.kind == "conv_transpose":
        return (f"{describe(consumer)} is a ConvTranspose: a BatchNorm before it does not fold exactly (its border "
                "outputs see fewer inputs, so the shift does not become one bias)")
    if not isinstance(arrived, torch.Tensor) or arrived.dim() == 0:
        return f"the input of {describe(consumer)} could not be followed"
    axis = feature_axis(layer, arrived.dim())
    if axis < 0 or arrived.shape[axis] != layer.in_channels:
        return f"{describe(consumer)} reads an input whose feature axis does not match its {layer.in_channels} inputs"
    channel_of = along_axis(arrived, axis)
    if channel_of is None:
        return (f"each input feature of {describe(consumer)} mixes several BatchNorm channels, or a channel with "
                "other values (the operations between them move the channel to another axis), so no per-feature "
                "scale reproduces the BatchNorm")
    if not layer.zero_padding and layer.padding_mode not in COPYING_PAD_MODES and bool((channel_of >= 0).any()):
        return (f"{describe(consumer)} pads its input with zeros: the padding would see un-normalised zeros "
                "where the BatchNorm gives its shift")
    reason = weights_refusal(gm, layer, copy_shared)
    if reason is not None:
        return reason
    return ChannelFold(layer, *picked_scale_shift(bn, dtype, channel_of), "input")
