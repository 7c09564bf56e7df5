"""Views of graph nodes for the BatchNorm folds: a conv/linear with constant weights (:class:`Layer`) and a
foldable BatchNorm (:class:`BatchNorm`), in every form the capture step produces.

Modules (Conv*/ConvTranspose*/Linear; BatchNorm*/SyncBatchNorm/_BatchNormXd/subclasses keeping BatchNorm's
forward/FrozenBatchNorm2d), ``F.conv*``/``F.linear``/``F.batch_norm`` with constant (get_attr) weights, and
the ATen ops of a ``torch.export`` graph. A matcher returns the view, a :class:`Refused` saying why the node
cannot take part in a fold, or None when the node is not of that kind.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fx_lightning.passes.fold_math import bn_scale_shift, fold_bn_into_input, fold_bn_into_output
from fx_lightning.passes.graph_utils import (
    KNOWN_BATCHNORM_FORWARDS,
    add_constant,
    aten_ops,
    attr_tensor,
    call_sites,
    drop_replaced_attribute,
    get_attr_targets,
    install_module,
    is_batchnorm_like,
    module_of,
    node_arg,
)

__all__ = [
    "Layer",
    "ChannelFold",
    "apply_channel_fold",
    "feature_axis",
    "BatchNorm",
    "Refused",
    "match_layer",
    "match_bn",
    "bn_input",
    "bn_reader",
    "layer_kind",
    "is_batchnorm_node",
    "apply_layer_weights",
    "weights_refusal",
    "remove_batchnorm",
    "describe",
]

_CONV_FN = {F.conv1d, F.conv2d, F.conv3d} | aten_ops(
    "conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding", "conv3d.padding"
)
_CONVT_FN = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d} | aten_ops(
    "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input"
)
_CONVOLUTION_FN = aten_ops("convolution.default")
_LINEAR_FN = {F.linear} | aten_ops("linear.default")

_CONV_MODULES: Tuple[type, ...] = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_CONVT_MODULES: Tuple[type, ...] = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_KNOWN_LAYER_FORWARDS = {c.forward for c in _CONV_MODULES + _CONVT_MODULES + (nn.Linear,)}


@dataclass
class Layer:
    """A conv/linear call whose weights are constants, in module or functional form."""

    node: fx.Node
    kind: str  # "conv" | "conv_transpose" | "linear"
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    groups: int
    zero_padding: bool  # pads nothing (a conv whose padding is 0, or "same"/"valid" that adds none; a Linear)
    module: Optional[nn.Module] = None
    padding_mode: str = "zeros"  # what the padding holds: zeros, or copies of the input (reflect/replicate/circular)

    @property
    def out_channels(self) -> int:
        if self.kind == "conv_transpose":
            return self.weight.shape[1] * self.groups
        return self.weight.shape[0]

    @property
    def in_channels(self) -> int:
        if self.kind == "conv_transpose":
            return self.weight.shape[0]
        return self.weight.shape[1] * self.groups


@dataclass(frozen=True)
class Refused:
    """What a matcher returns for a node of its kind that cannot take part in a fold: a type of its own, so a
    caller tells it from the view by type, and ``reason`` goes into the pass's Skip as it is."""

    reason: str


def _zero(padding: Any, weight: torch.Tensor) -> bool:
    """Whether a conv's padding adds nothing: 0, "valid", or "same" with a kernel that covers one position."""
    if isinstance(padding, str):
        return padding == "valid" or (padding == "same" and all(k == 1 for k in weight.shape[2:]))
    if isinstance(padding, (tuple, list)):
        return all(p == 0 for p in padding)
    return padding == 0


def match_layer(gm: fx.GraphModule, node: Any) -> Union[Layer, Refused, None]:
    """A Layer, why this conv/linear cannot absorb anything (:class:`Refused`), or None (not a conv/linear)."""
    kind = layer_kind(gm, node)
    if kind is None:
        return None
    if node.op == "call_module":
        m = module_of(gm, node)
        if type(m).forward not in _KNOWN_LAYER_FORWARDS:
            return Refused(f"{type(m).__qualname__} overrides forward")
        if m._forward_hooks or m._forward_pre_hooks:
            return Refused(f"{type(m).__qualname__} has forward hooks")
        if kind == "linear":
            return Layer(node, "linear", m.weight, m.bias, 1, True, m)
        return Layer(node, kind, m.weight, m.bias, m.groups, _zero(m.padding, m.weight), m, m.padding_mode)
    # F.linear(input, weight, bias); F.conv*(input, weight, bias, stride, padding, dilation, groups);
    # aten.convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    groups = 1 if kind == "linear" else node_arg(node, 8 if node.target in _CONVOLUTION_FN else 6, "groups", 1)
    padding = 0 if kind == "linear" else node_arg(node, 4, "padding", 0)
    weight = attr_tensor(gm, node_arg(node, 1, "weight"))
    if weight is None:
        return Refused(f"{describe(node)}: weight is computed in the graph, not a constant")
    bias_arg = node_arg(node, 2, "bias")
    bias = attr_tensor(gm, bias_arg)
    if bias_arg is not None and bias is None:
        return Refused(f"{describe(node)}: bias is computed in the graph, not a constant")
    if not isinstance(groups, int):
        return Refused(f"{describe(node)}: groups is not a constant")
    return Layer(node, kind, weight, bias, groups, _zero(padding, weight))


def _set_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    if len(node.args) > index:
        node.update_arg(index, value)
    elif name in node.kwargs or len(node.args) < index:
        node.update_kwarg(name, value)
    else:
        node.args = (*node.args, value)


def _fresh_module(m: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> nn.Module:
    """A plain Conv*/ConvTranspose*/Linear with m's hyper-parameters and the given weights."""
    if isinstance(m, nn.Linear):
        new: nn.Module = nn.Linear(m.in_features, m.out_features, bias=True, device="meta")
    else:
        base = next(c for c in _CONV_MODULES + _CONVT_MODULES if isinstance(m, c))
        # Only the transposed convs take output_padding (the plain ones refuse the keyword).
        transposed = {"output_padding": m.output_padding} if base in _CONVT_MODULES else {}
        new = base(m.in_channels, m.out_channels, m.kernel_size, stride=m.stride, padding=m.padding,
                   dilation=m.dilation, groups=m.groups, bias=True, padding_mode=m.padding_mode, device="meta",
                   **transposed)
    new.weight = nn.Parameter(weight, requires_grad=False)
    new.bias = nn.Parameter(bias, requires_grad=False)
    return new.eval()


def _module_is_exclusive(gm: fx.GraphModule, target: str) -> bool:
    prefix = target + "."
    return call_sites(gm, target) == 1 and not any(t.startswith(prefix) for t in get_attr_targets(gm))


def weights_refusal(gm: fx.GraphModule, layer: Layer, copy_shared: bool) -> Optional[str]:
    """Why :func:`apply_layer_weights` would refuse ``layer`` (None: it will not)."""
    target = str(layer.node.target)
    if layer.module is not None and not copy_shared and not _module_is_exclusive(gm, target):
        return f"module '{target}' is called at {call_sites(gm, target)} sites and copy_shared_modules is off"
    return None


def apply_layer_weights(
    gm: fx.GraphModule, layer: Layer, weight: torch.Tensor, bias: torch.Tensor, copy_shared: bool
) -> None:
    """Point ``layer.node`` at new weights without touching other call sites. The folds plan only what
    :func:`weights_refusal` allows, so a refusal here is a bug: it raises (the pass fails) rather than leave some
    layers folded and the BatchNorm there."""
    node = layer.node
    refusal = weights_refusal(gm, layer, copy_shared)
    if refusal is not None:  # pragma: no cover - planned folds passed weights_refusal
        raise RuntimeError(f"a planned fold into {describe(node)} was refused: {refusal}")
    if layer.module is not None:
        exclusive = _module_is_exclusive(gm, str(node.target))
        install_module(gm, node, _fresh_module(layer.module, weight, bias), exclusive=exclusive)
        return
    w_node = add_constant(gm, node, f"{node.name}_weight", weight)
    b_node = add_constant(gm, node, f"{node.name}_bias", bias)
    old_w, old_b = node_arg(node, 1, "weight"), node_arg(node, 2, "bias")
    _set_arg(node, 1, "weight", w_node)
    _set_arg(node, 2, "bias", b_node)
    # Free the unfused weight now, not at the end of the pass (peak memory: one copy of the weights).
    drop_replaced_attribute(gm, old_w)
    drop_replaced_attribute(gm, old_b)


def feature_axis(layer: Layer, rank: int) -> int:
    """The axis of a rank-``rank`` input or output of ``layer`` that holds its features: the last for a Linear,
    the one before the spatial axes for a conv (1 when batched, 0 when not)."""
    return rank - 1 if layer.kind == "linear" else rank - (layer.weight.dim() - 2) - 1


@dataclass
class ChannelFold:
    """A per-feature affine map to fold into ``layer``: ``x * scale + shift`` on its output features (``side``
    "output": the layer produces the BatchNorm's input) or on its input features ("input": it reads the
    BatchNorm's output). Folded in the dtype of ``scale`` (the fold dtype)."""

    layer: Layer
    scale: torch.Tensor
    shift: torch.Tensor
    side: str


def apply_channel_fold(gm: fx.GraphModule, fold: ChannelFold, copy_shared: bool) -> None:
    """Fold ``fold`` into its layer's weights (a fresh copy for a shared module)."""
    layer = fold.layer
    device = layer.weight.device
    scale, shift = fold.scale.to(device), fold.shift.to(device)
    if fold.side == "output":
        w, b = fold_bn_into_output(layer.weight, layer.bias, scale, shift, transposed=layer.kind == "conv_transpose",
                                   groups=layer.groups)
    else:
        w, b = fold_bn_into_input(layer.weight, layer.bias, scale, shift, groups=layer.groups)
    apply_layer_weights(gm, layer, w, b, copy_shared)


def layer_kind(gm: fx.GraphModule, node: Any) -> Optional[str]:
    """"conv", "conv_transpose" or "linear" for any conv/linear node (foldable or not), else None."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        m = module_of(gm, node)
        if isinstance(m, nn.Linear):
            return "linear"
        if isinstance(m, nn.modules.conv._ConvNd):
            return "conv_transpose" if isinstance(m, _CONVT_MODULES) else "conv"
        return None
    if node.op != "call_function":
        return None
    if node.target in _CONVOLUTION_FN:
        return "conv_transpose" if node_arg(node, 6, "transposed", False) else "conv"
    return next((kind for kind, fns in (("linear", _LINEAR_FN), ("conv", _CONV_FN), ("conv_transpose", _CONVT_FN))
                 if node.target in fns), None)


# ------------------------------------------------------------------------------------------ BatchNorm


_F_BN = {F.batch_norm}
_TORCH_BN = {torch.batch_norm} | aten_ops("batch_norm.default")
# Eval-mode batch_norm's own kernel (what torch.export records when BatchNorms run as it: fx_lightning.signature.program);
# it returns (output, mean, invstd): the BatchNorm's value is its item 0.
_LEGIT_BN = aten_ops("_native_batch_norm_legit_no_training.default")


def _legit_kernel(node: fx.Node) -> Optional[fx.Node]:
    """The ``_native_batch_norm_legit_no_training`` call whose output ``node`` takes (``getitem(call, 0)``)."""
    if node.op != "call_function" or node.target is not operator.getitem or len(node.args) != 2:
        return None
    call, index = node.args
    if index != 0 or not isinstance(call, fx.Node) or call.op != "call_function" or call.target not in _LEGIT_BN:
        return None
    return call


@dataclass
class BatchNorm:
    node: fx.Node
    input: Any
    num_features: int
    running_mean: torch.Tensor
    running_var: torch.Tensor
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    eps: float

    def scale_shift(self, dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
        return bn_scale_shift(self.running_mean, self.running_var, self.weight, self.bias, self.eps, dtype)


def bn_input(node: fx.Node) -> Any:
    """The value a BatchNorm call normalises (its first argument; the kernel's, for the kernel form)."""
    call = bn_reader(node)
    return call.args[0] if call.args else None


def bn_reader(node: fx.Node) -> fx.Node:
    """The node that reads a BatchNorm's input: the call itself, or the kernel behind ``getitem(kernel, 0)``."""
    return _legit_kernel(node) or node


def is_batchnorm_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A BatchNorm call: a BatchNorm module, or a functional/ATen batch_norm with running statistics (without
    them it normalises with batch statistics, e.g. weight standardisation: not a BatchNorm at inference)."""
    if node.op == "call_module":
        m = module_of(gm, node)
        return m is not None and is_batchnorm_like(m)
    if node.op != "call_function":
        return False
    if _legit_kernel(node) is not None:
        return True
    if node.target in _F_BN:
        return node_arg(node, 1, "running_mean") is not None
    return node.target in _TORCH_BN and node_arg(node, 3, "running_mean") is not None


def match_bn(gm: fx.GraphModule, node: fx.Node) -> Union[BatchNorm, Refused, None]:
    """A foldable BatchNorm, why this BatchNorm is not foldable (:class:`Refused`), or None (not a BatchNorm)."""
    if not is_batchnorm_node(gm, node):
        return None
    if not isinstance(bn_input(node), fx.Node):
        return Refused("input is not a graph value")
    if node.op == "call_module":
        m = module_of(gm, node)
        assert m is not None
        name = type(m).__qualname__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if type(m).forward not in KNOWN_BATCHNORM_FORWARDS:
                return Refused(f"{name} overrides BatchNorm's forward and was kept whole (symbolic tracing cannot "
                               "follow it, or trace.leaf_modules lists it): trace.mode: export (or auto) folds it, or "
                               "declare it under passes.batchnorm_forms.modules")
            if m.training:
                return Refused(f"{name} is in training mode")
        elif not type(m).__module__.startswith("torchvision"):
            return Refused(f"{name} is not torchvision's FrozenBatchNorm2d (unknown forward)")
        if m._forward_hooks or m._forward_pre_hooks:
            return Refused(f"{name} has forward hooks")
        if getattr(m, "running_mean", None) is None or getattr(m, "running_var", None) is None:
            return Refused(f"{name} has no running statistics (track_running_stats=False): it normalises with batch "
                           "statistics even in eval mode")
        affine = getattr(m, "affine", True)
        return BatchNorm(node, bn_input(node), m.running_mean.numel(), m.running_mean, m.running_var,
                         m.weight if affine else None, m.bias if affine else None, float(m.eps))
    kernel = _legit_kernel(node)
    if kernel is not None:  # (input, weight, bias, running_mean, running_var, momentum, eps): eval mode by definition
        w_a, b_a, rm_a, rv_a = (kernel.args[i] for i in range(1, 5))
        training, eps = False, kernel.args[6]
    elif node.target in _F_BN:  # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        rm_a, rv_a = node_arg(node, 1, "running_mean"), node_arg(node, 2, "running_var")
        w_a, b_a = node_arg(node, 3, "weight"), node_arg(node, 4, "bias")
        training, eps = node_arg(node, 5, "training", False), node_arg(node, 7, "eps", 1e-5)
    else:  # torch.batch_norm / aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
        w_a, b_a = node_arg(node, 1, "weight"), node_arg(node, 2, "bias")
        rm_a, rv_a = node_arg(node, 3, "running_mean"), node_arg(node, 4, "running_var")
        training, eps = node_arg(node, 5, "training", False), node_arg(node, 7, "eps", 1e-5)
    if training is not False:
        return Refused("functional batch_norm with training=True (or not a constant) uses batch statistics")
    rm, rv = attr_tensor(gm, rm_a), attr_tensor(gm, rv_a)
    if rm is None or rv is None:
        return Refused("functional batch_norm: running statistics are not constants")
    w, b = attr_tensor(gm, w_a), attr_tensor(gm, b_a)
    if (w_a is not None and w is None) or (b_a is not None and b is None):
        return Refused("functional batch_norm: weight or bias is computed, not a constant")
    if not isinstance(eps, (int, float)):
        return Refused("functional batch_norm: eps is not a constant")
    return BatchNorm(node, bn_input(node), rm.numel(), rm, rv, w, b, float(eps))


def describe(node: Any) -> str:
    if not isinstance(node, fx.Node):
        return repr(node)
    if node.op == "call_module":
        root = node.graph.owning_module
        m = module_of(root, node) if root is not None else None
        kind = f"{type(m).__name__} " if m is not None else ""
        return f"{node.name} ({kind}'{node.target}')"
    if node.op in ("call_function", "call_method"):
        t = node.target
        return f"{node.name} ({getattr(t, '__name__', None) or t})"
    return f"{node.name} ({node.op})"


def remove_batchnorm(gm: fx.GraphModule, bn: BatchNorm, replacement: fx.Node) -> None:
    bn.node.replace_all_uses_with(replacement)
    kernel = _legit_kernel(bn.node)
    gm.graph.erase_node(bn.node)
    if kernel is not None:  # the kernel's other items (batch statistics: unused in eval mode), then the kernel
        for user in list(kernel.users):
            if not user.users:
                gm.graph.erase_node(user)
        if kernel.users:
            return
    call = kernel if kernel is not None else bn.node
    inputs = [a for a in list(call.args) + list(call.kwargs.values()) if isinstance(a, fx.Node)]
    if kernel is not None:
        gm.graph.erase_node(kernel)
    for a in inputs:  # the functional form's statistics are get_attr nodes that are now dead
        drop_replaced_attribute(gm, a)
