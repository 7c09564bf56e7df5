"""Where a BatchNorm can fold into the layer that produces its input: planned here, applied by the passes.

Three shapes: the conv/linear right before it; a concatenation of convs along the channels (each conv takes its
slice); a conv/linear followed by layout operations (:mod:`.bn_layout`: transpose, reshape, unsqueeze, slicing,
copying pads) that keep each of its output features on one BatchNorm channel. A plan is a list of
:class:`ChannelFold`; a refusal is a reason that says what in the mathematics stands in the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx

from fx_lightning.passes.bn_layout import axis_labels, index_map, layout_inputs, run_layout
from fx_lightning.passes.bn_views import (
    BatchNorm,
    ChannelFold,
    Layer,
    Refused,
    bn_input,
    bn_reader,
    describe,
    feature_axis,
    layer_kind,
    match_layer,
    weights_refusal,
)
from fx_lightning.passes.base import PassContext
from fx_lightning.passes.graph_utils import known_shape, node_arg, node_shape, value_users

__all__ = ["FoldPlan", "only_feeds", "op_names", "walk_back", "plan_into_producer", "picked_scale_shift",
           "concat_parts"]


@dataclass
class FoldPlan:
    """The folds that replace one BatchNorm, and how the change is recorded."""

    folds: List[ChannelFold]
    what: str
    into: str
    kind: str


def only_feeds(node: fx.Node, user: fx.Node) -> Optional[str]:
    """Why folding would change other readers of ``node``'s values (shape-only readers do not count)."""
    others = [describe(u) for u in value_users(node) if u is not user]
    if others:
        return f"the output of {describe(node)} also feeds {', '.join(others)}; folding would change them"
    return None


def op_names(nodes: Sequence[fx.Node]) -> str:
    """``transpose, reshape``: the operations' names, for a record."""
    names = []
    for n in nodes:
        target = getattr(n.target, "__name__", None) or str(n.target)
        names.append(target.split(".")[0] if n.op == "call_function" else target)
    return ", ".join(names)


def walk_back(gm: fx.GraphModule, value: object) -> Tuple[object, List[fx.Node]]:
    """(the first node before ``value`` that is not a one-input layout operation, the layout operations between,
    in graph order)."""
    chain: List[fx.Node] = []
    while isinstance(value, fx.Node):
        inputs = layout_inputs(gm, value)
        if inputs is None or len(inputs) != 1 or concat_parts(value) is not None:
            break
        chain.append(value)
        value = inputs[0]
    return value, chain[::-1]


def picked_scale_shift(bn: BatchNorm, dtype: torch.dtype, channels: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """The BatchNorm's scale and shift picked per feature by ``channels`` (a channel index; < 0: untouched)."""
    scale, shift = bn.scale_shift(dtype)
    index = channels.to(scale.device).clamp_min(-1)  # -1: the identity appended after the channels
    return torch.cat([scale, scale.new_ones(1)])[index], torch.cat([shift, shift.new_zeros(1)])[index]


def plan_into_producer(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: Union[BatchNorm, Refused],
                       kinds: Tuple[str, ...], copy_shared: bool,
                       dtype: torch.dtype) -> Union[FoldPlan, str, None]:
    """How ``node`` (a BatchNorm) folds into a producer of one of ``kinds``: a plan, the reason it cannot, or None
    when no such producer is there."""
    producer, chain = walk_back(gm, bn_input(node))
    if "conv" in kinds and not chain and concat_parts(producer) is not None:
        return _plan_concat(gm, ctx, node, bn, producer, copy_shared, dtype)  # type: ignore[arg-type]
    layer = match_layer(gm, producer)
    if layer is None:
        return None
    if isinstance(layer, Refused):
        if layer_kind(gm, producer) in kinds:
            return f"follows {describe(producer)}, which cannot be folded: {layer.reason}"
        return None
    if layer.kind not in kinds:
        return None
    if isinstance(bn, Refused):
        return bn.reason
    if chain:
        return _plan_chain(gm, ctx, node, bn, layer, chain, copy_shared, dtype)
    reason = _common_checks(bn, layer) or _kind_check(gm, ctx, layer) or weights_refusal(gm, layer, copy_shared)
    if reason is not None:
        return reason
    scale, shift = bn.scale_shift(dtype)
    return FoldPlan([ChannelFold(layer, scale, shift, "output")], "folded", describe(producer), layer.kind)


def _common_checks(bn: BatchNorm, layer: Layer) -> Optional[str]:
    reason = only_feeds(layer.node, bn_reader(bn.node))
    if reason is None and layer.out_channels != bn.num_features:
        reason = f"{describe(layer.node)} has {layer.out_channels} output channels, the BatchNorm {bn.num_features}"
    return reason


def _kind_check(gm: fx.GraphModule, ctx: PassContext, layer: Layer) -> Optional[str]:
    if layer.kind != "linear":
        shape = node_shape(layer.node)
        if shape is not None and len(shape) != layer.weight.dim():
            return f"unbatched conv output of rank {len(shape)}: the BatchNorm's channel axis is not the conv's"
        return None
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


# ------------------------------------------------------------------------- through layout operations


def _plan_chain(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, layer: Layer,
                chain: List[fx.Node], copy_shared: bool, dtype: torch.dtype) -> Union[FoldPlan, str]:
    """layer -> layout operations -> BatchNorm: each output feature of the layer must land on one channel."""
    path = [layer.node] + chain
    for value, reader in zip(path, path[1:] + [bn_reader(node)]):
        reason = only_feeds(value, reader)
        if reason is not None:
            return reason
    ctx.ensure_shapes(gm)
    out = known_shape(layer.node)
    if out is None:
        return "shapes unknown around the layout operations: pass example_inputs so they are known"
    axis = feature_axis(layer, len(out))
    if axis < 0:
        return f"the output of {describe(layer.node)} has no feature axis (shape {list(out)})"
    labels = run_layout(gm, layer.node, axis_labels(out, axis), chain)
    if isinstance(labels, str):
        return labels
    arrived = labels[chain[-1]]
    through = op_names(chain)
    if not isinstance(arrived, torch.Tensor) or arrived.dim() < 2 or arrived.shape[1] != bn.num_features:
        return f"after {through}, the BatchNorm's channel axis is not {bn.num_features} long"
    if arrived.numel() == 0 or arrived.min() < 0 or arrived.max() >= layer.out_channels:
        return f"{through} bring(s) values that {describe(layer.node)} does not produce to the BatchNorm"
    channel_of = index_map(arrived, axis_labels(arrived.shape, 1), layer.out_channels)
    if channel_of is None:
        return (f"{through} spread each output feature of {describe(layer.node)} over several BatchNorm channels "
                "(the channel is mixed with another axis), so no per-feature scale reproduces the BatchNorm")
    reason = weights_refusal(gm, layer, copy_shared)
    if reason is not None:
        return reason
    scale, shift = picked_scale_shift(bn, dtype, channel_of)
    return FoldPlan([ChannelFold(layer, scale, shift, "output")], f"folded through {through}", describe(layer.node),
                    layer.kind)


# -------------------------------------------------------------------- concat of convs -> BatchNorm

_CATS = {torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default}


def concat_parts(node: object) -> Optional[Tuple[list, object]]:
    """(inputs, dim) of a ``torch.cat`` call, else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _CATS or not node.args:
        return None
    parts = node.args[0]
    if not isinstance(parts, (list, tuple)):
        return None
    return list(parts), node_arg(node, 1, "dim", 0)


def _plan_concat(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: Union[BatchNorm, Refused], cat: fx.Node,
                 copy_shared: bool, dtype: torch.dtype) -> Union[FoldPlan, str, None]:
    """cat([conv_a, conv_b, ...], dim=channels) -> BatchNorm: each conv owns a slice of the channels, and that
    slice of the BatchNorm folds into it exactly."""
    parts, dim = concat_parts(cat)  # type: ignore[misc]
    matched = [match_layer(gm, p) for p in parts]
    layers = [x for x in matched if isinstance(x, Layer) and x.kind in ("conv", "conv_transpose")]
    if not layers or len(layers) != len(matched):
        return None  # not all convs: the reasons for what is left describe it
    if isinstance(bn, Refused):
        return bn.reason
    reason = _concat_refusal(gm, ctx, node, bn, cat, layers, dim, copy_shared)
    if reason is not None:
        return reason
    scale, shift = bn.scale_shift(dtype)
    sizes = [layer.out_channels for layer in layers]  # each conv's slice of the channels, in order
    folds = [ChannelFold(layer, s, t, "output") for layer, s, t in zip(layers, scale.split(sizes), shift.split(sizes))]
    return FoldPlan(folds, "folded into a concatenation", ", ".join(describe(x.node) for x in layers), "conv")


def _concat_refusal(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, cat: fx.Node,
                    layers: List[Layer], dim: object, copy_shared: bool) -> Optional[str]:
    for layer in layers:
        reason = only_feeds(layer.node, cat) or weights_refusal(gm, layer, copy_shared)
        if reason is not None:
            return reason
    reason = only_feeds(cat, bn_reader(node))
    if reason is not None:
        return reason
    channels = sum(x.out_channels for x in layers)
    if channels != bn.num_features:
        return f"the concatenated convs have {channels} channels, the BatchNorm {bn.num_features}"
    ctx.ensure_shapes(gm)
    shape = node_shape(cat)
    if shape is None:
        return "shapes unknown: pass example_inputs so the concatenation axis can be checked"
    if not isinstance(dim, int) or dim % len(shape) != 1 or len(shape) != layers[0].weight.dim():
        return f"the concatenation (dim={dim}, output rank {len(shape)}) is not along the channels"
    return None
