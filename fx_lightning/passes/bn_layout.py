"""Following a BatchNorm's channel through layout operations: transpose, permute, view/reshape/flatten,
unsqueeze/squeeze, expand, slicing and chunks, padding that copies values (reflect, replicate, circular), and
concatenation.

A layout operation moves values without changing them, so where each value goes is found by running the
operations on *labels*: a float64 tensor of the source's shape holding, at every element, its index along the
axis that is followed (a BatchNorm's channel, a layer's output feature); another input of a concatenation holds
:data:`FOREIGN`. What arrives at the far end tells, element by element, which channel it carries: a per-channel
affine map passes through exactly when each feature at that end carries one channel (:func:`index_map`).
Reshapes are run to the shape the graph recorded (ShapeProp or torch.export), so sizes computed in the graph
(``x.reshape(x.shape[0], -1)``) are followed too.
"""

from __future__ import annotations

import operator
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fx_lightning.passes.bn_views import describe
from fx_lightning.passes.graph_utils import aten_ops, known_shape, module_of, node_arg

__all__ = [
    "FOREIGN",
    "COPYING_PAD_MODES",
    "layout_inputs",
    "constant_padding",
    "run_layout",
    "axis_labels",
    "index_map",
    "along_axis",
]

# The label of a value that does not come from the followed source (another input of a concatenation).
FOREIGN = -1.0

# Operations that only reinterpret the row-major order (or broadcast): run as a reshape (expand) to the
# recorded output shape, whatever their arguments.
_RESHAPE_METHODS = {"view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unflatten, torch.squeeze, torch.unsqueeze} | aten_ops(
    "view.default", "reshape.default", "_unsafe_view.default", "flatten.using_ints", "unflatten.int", "squeeze.dim",
    "squeeze.dims", "squeeze.default", "unsqueeze.default", "_reshape_alias.default")
_RESHAPE_MODULES: Tuple[type, ...] = (nn.Flatten, nn.Unflatten)
_EXPAND_METHODS = {"expand", "expand_as"}
_EXPAND_FUNCTIONS = {torch.broadcast_to} | aten_ops("expand.default")

# Operations that move or select values with constant arguments: run as they are, on the labels.
_MOVE_METHODS = {"transpose", "permute", "movedim", "moveaxis", "swapaxes", "swapdims", "t", "contiguous", "clone",
                 "detach", "narrow", "select", "chunk", "split", "tensor_split", "unbind", "flip", "roll", "repeat",
                 "tile", "unfold"}
_MOVE_FUNCTIONS = {torch.transpose, torch.permute, torch.movedim, torch.moveaxis, torch.swapaxes, torch.swapdims,
                   torch.t, torch.narrow, torch.select, torch.chunk, torch.split, torch.tensor_split, torch.unbind,
                   torch.flip, torch.roll, torch.clone, torch.detach, torch.tile, operator.getitem} | aten_ops(
    "transpose.int", "permute.default", "movedim.int", "t.default", "swapaxes.default", "clone.default",
    "alias.default", "detach.default", "contiguous.default", "slice.Tensor", "select.int", "narrow.default",
    "chunk.default", "split.Tensor", "split_with_sizes.default", "tensor_split.sections", "tensor_split.indices",
    "unbind.int", "flip.default", "roll.default", "repeat.default", "unfold.default")
_CONCAT_FUNCTIONS = {torch.cat, torch.concat, torch.concatenate, torch.stack} | aten_ops("cat.default", "stack.default")

# Padding that copies values of the same tensor (so it commutes with a per-channel affine map) and padding with
# a constant (which does not: the constant is not normalised).
COPYING_PAD_MODES = {"reflect", "replicate", "circular"}
_COPYING_PAD_FUNCTIONS = aten_ops("reflection_pad1d.default", "reflection_pad2d.default", "reflection_pad3d.default",
                                  "replication_pad1d.default", "replication_pad2d.default",
                                  "replication_pad3d.default", "_pad_circular.default")
_COPYING_PAD_MODULES: Tuple[type, ...] = tuple(
    getattr(nn, f"{kind}Pad{d}d") for kind in ("Reflection", "Replication", "Circular") for d in (1, 2, 3)
    if hasattr(nn, f"{kind}Pad{d}d"))
_CONSTANT_PAD_FUNCTIONS = aten_ops("constant_pad_nd.default")
_CONSTANT_PAD_MODULES: Tuple[type, ...] = tuple(
    getattr(nn, f"{kind}Pad{d}d") for kind in ("Zero", "Constant") for d in (1, 2, 3) if hasattr(nn, f"{kind}Pad{d}d"))
_PAD_FUNCTIONS = {F.pad, torch.constant_pad_nd} | aten_ops("pad.default")

_INDEX_TYPES = (int, slice, type(None), type(Ellipsis))

# Averages over positions (each output the mean of some inputs, weights summing to one): a per-channel affine map
# passes through one exactly when every output averages values of one channel, which is checked on the labels by
# the maximum and minimum over the same windows.
_MEAN_FUNCTIONS = {torch.mean} | aten_ops("mean.dim", "mean.default")
_ADAPTIVE_AVERAGES = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3,
                      torch.adaptive_avg_pool1d: 1, **{op: 2 for op in aten_ops("_adaptive_avg_pool2d.default",
                                                                              "adaptive_avg_pool2d.default")},
                      **{op: 3 for op in aten_ops("_adaptive_avg_pool3d.default", "adaptive_avg_pool3d.default")},
                      **{op: 1 for op in aten_ops("adaptive_avg_pool1d.default")}}
_ADAPTIVE_AVERAGE_MODULES = {nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3}
_ADAPTIVE_MAX = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}


# The functions above by kind (a getitem and F.pad are told by their arguments).
_FUNCTION_KINDS = (("reshape", _RESHAPE_FUNCTIONS), ("average", _MEAN_FUNCTIONS | set(_ADAPTIVE_AVERAGES)),
                   ("expand", _EXPAND_FUNCTIONS), ("concat", _CONCAT_FUNCTIONS),
                   ("move", _MOVE_FUNCTIONS | _COPYING_PAD_FUNCTIONS))


def _pad_mode(node: fx.Node) -> Optional[str]:
    """The mode of a ``F.pad`` / ``aten.pad`` call ("constant" when not given), None for other nodes."""
    if node.op != "call_function" or node.target not in _PAD_FUNCTIONS:
        return None
    if node.target is torch.constant_pad_nd:
        return "constant"
    mode = node_arg(node, 2, "mode", "constant")
    return mode if isinstance(mode, str) else None


def constant_padding(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether ``node`` pads with a constant (zeros by default): padding no per-channel affine map passes."""
    if node.op == "call_module":
        return isinstance(module_of(gm, node), _CONSTANT_PAD_MODULES)
    return node.op == "call_function" and (node.target in _CONSTANT_PAD_FUNCTIONS or _pad_mode(node) == "constant")


def _constant_index(index: Any) -> bool:
    if isinstance(index, tuple):
        return all(isinstance(i, _INDEX_TYPES) for i in index)
    return isinstance(index, _INDEX_TYPES)


def _kind(gm: fx.GraphModule, node: fx.Node) -> Optional[str]:
    """"reshape", "expand", "move", "concat", "average" for a layout operation (or an average), else None."""
    if node.op == "call_module":
        m = module_of(gm, node)
        if isinstance(m, _RESHAPE_MODULES):
            return "reshape"
        if type(m) in _ADAPTIVE_AVERAGE_MODULES:
            return "average"
        return "move" if isinstance(m, _COPYING_PAD_MODULES) else None
    if node.op == "call_method":
        if node.target in _RESHAPE_METHODS:  # x.view(torch.float16) reinterprets bits: not a layout operation
            return None if any(isinstance(a, torch.dtype) for a in node.args[1:]) else "reshape"
        if node.target == "mean":
            return None if "dtype" in node.kwargs else "average"
        return "expand" if node.target in _EXPAND_METHODS else ("move" if node.target in _MOVE_METHODS else None)
    if node.op != "call_function" or (node.target in _MEAN_FUNCTIONS and "dtype" in node.kwargs):
        return None
    if node.target is operator.getitem:
        return "move" if len(node.args) == 2 and _constant_index(node.args[1]) else None
    kind = next((kind for kind, targets in _FUNCTION_KINDS if node.target in targets), None)
    return kind or ("move" if _pad_mode(node) in COPYING_PAD_MODES else None)


def layout_inputs(gm: fx.GraphModule, node: Any) -> Optional[List[fx.Node]]:
    """The values a layout operation moves (its data inputs: the tensor, or a concatenation's parts); None when
    ``node`` is not a layout operation."""
    if not isinstance(node, fx.Node):
        return None
    kind = _kind(gm, node)
    if kind is None:
        return None
    first = node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("tensors"))
    parts = list(first) if kind == "concat" and isinstance(first, (list, tuple)) else [first]
    return parts if parts and all(isinstance(p, fx.Node) for p in parts) else None


class _Unfollowable(Exception):
    """Raised inside :func:`run_layout` with the reason a node cannot be run on labels."""


def _run(gm: fx.GraphModule, node: fx.Node, values: Dict[fx.Node, Any]) -> Any:
    kind = _kind(gm, node)
    data = layout_inputs(gm, node) or []
    if kind in ("reshape", "expand"):
        shape = known_shape(node)
        if shape is None:
            raise _Unfollowable(f"the shape of {describe(node)} is unknown: pass example_inputs so shapes are known")
        return values[data[0]].reshape(shape) if kind == "reshape" else values[data[0]].expand(shape)

    def lookup(arg: fx.Node) -> Any:
        if arg in values:
            return values[arg]
        shape = known_shape(arg)
        if arg in data and shape is not None:  # another part of a concatenation
            return torch.full(shape, FOREIGN, dtype=torch.float64)
        raise _Unfollowable(f"{describe(node)} takes {describe(arg)}, computed in the graph, as an argument")

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lookup)
    if kind == "average":
        return _average(gm, node, args, kwargs)
    try:
        if node.op == "call_module":
            return module_of(gm, node)(*args, **kwargs)  # type: ignore[misc]
        if node.op == "call_method":
            return getattr(args[0], str(node.target))(*args[1:], **kwargs)
        return node.target(*args, **kwargs)  # type: ignore[operator]
    except Exception as exc:  # noqa: BLE001 - any op may refuse the labels' dtype or shape: then it is not followed
        raise _Unfollowable(f"{describe(node)} could not be followed ({type(exc).__name__}: {exc})") from None


def _average(gm: fx.GraphModule, node: fx.Node, args: Any, kwargs: Dict[str, object]) -> torch.Tensor:
    """The label every output of the average carries: the maximum over its window, which must equal the minimum."""
    x = args[0]
    if not isinstance(x, torch.Tensor):
        raise _Unfollowable(f"{describe(node)} could not be followed")
    if node.op == "call_method" or node.target in _MEAN_FUNCTIONS:
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dims = () if dim is None else dim
        high, low = x.amax(dims, keepdim), x.amin(dims, keepdim)
    else:
        if node.op == "call_module":
            m = module_of(gm, node)
            spatial, size = _ADAPTIVE_AVERAGE_MODULES[type(m)], m.output_size  # type: ignore[index,union-attr]
        else:
            spatial = _ADAPTIVE_AVERAGES[node.target]  # type: ignore[index]
            size = args[1] if len(args) > 1 else kwargs.get("output_size")
        pool = _ADAPTIVE_MAX[spatial]
        high, low = pool(x, size), -pool(-x, size)
    if not torch.equal(high, low):
        raise _Unfollowable(f"{describe(node)} averages values of several channels together")
    return high


def run_layout(gm: fx.GraphModule, source: fx.Node, labels: torch.Tensor,
               nodes: Sequence[fx.Node]) -> Union[Dict[fx.Node, Any], str]:
    """The labels at ``source`` and at each of ``nodes`` (layout operations, run in graph order), or the reason
    one of them cannot be followed."""
    values: Dict[fx.Node, Any] = {source: labels}
    order = {n: i for i, n in enumerate(source.graph.nodes)}
    try:
        for node in sorted(nodes, key=order.__getitem__):
            values[node] = _run(gm, node, values)
    except _Unfollowable as exc:
        return str(exc)
    return values


def axis_labels(shape: Sequence[int], axis: int) -> torch.Tensor:
    """A float64 tensor of ``shape`` holding at every element its index along ``axis``."""
    axis = axis % len(shape)
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return torch.arange(shape[axis], dtype=torch.float64).reshape(view).expand(*shape)


def along_axis(values: torch.Tensor, axis: int) -> Optional[torch.Tensor]:
    """For each index along ``axis``, the one value every element there holds, as a long tensor; None when two
    elements at one index hold different values (what :func:`index_map` gives for the axis's own indices)."""
    rows = values.movedim(axis, 0).reshape(values.shape[axis], -1)
    low, high = rows.amin(dim=1), rows.amax(dim=1)
    return low.long() if torch.equal(low, high) else None


def index_map(keys: torch.Tensor, values: torch.Tensor, size: int) -> Optional[torch.Tensor]:
    """``values`` as a function of ``keys`` (elementwise, keys in ``[0, size)``): for each key the one value every
    element with that key holds, as a long tensor (-2 for a key no element has); None when one key holds two
    different values (the two sides' axes are mixed)."""
    k, v = keys.reshape(-1).long(), values.reshape(-1).to(torch.float64)
    low = torch.full((size,), float("inf"), dtype=torch.float64).scatter_reduce(0, k, v, "amin")
    high = torch.full((size,), float("-inf"), dtype=torch.float64).scatter_reduce(0, k, v, "amax")
    seen = high >= low
    if bool((high[seen] != low[seen]).any()):
        return None
    return torch.where(seen, low, torch.full_like(low, -2.0)).long()
