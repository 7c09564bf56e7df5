"""BatchNorm folding: ``fuse_conv_bn``, ``fuse_linear_bn`` and ``fuse_bn_into_next``.

In eval mode a BatchNorm is the per-channel affine map ``y = x * s + t`` with
``s = gamma / sqrt(running_var + eps)`` and ``t = beta - running_mean * s``. It folds exactly into
  - the conv/linear that produces its input (scale the output channels of W, ``b' = b * s + t``);
  - the Linear or unpadded conv that consumes its output (scale the input channels of W,
    ``b' = b + W @ t``). A padded conv would pad the *normalised* input with zeros, which is not
    the same as padding the raw input, so those are left alone.

Both views below accept every form the capture step produces: modules (Conv*/ConvTranspose*/Linear,
BatchNorm*/SyncBatchNorm/_BatchNormXd/subclasses keeping BatchNorm's forward/FrozenBatchNorm2d),
``F.conv*``/``F.linear``/``F.batch_norm`` with constant (get_attr) weights, and the ATen ops of a
``torch.export`` graph. A module called at several sites gets one fused copy per site; the original
stays for the other sites, so no call site is ever changed by folding another.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, builtin_pass
from fx_lightning.passes.graph_utils import (
    add_constant,
    attr_tensor,
    call_sites,
    delete_unused_attributes,
    drop_replaced_attribute,
    get_attr_targets,
    install_module,
    is_batchnorm_like,
    module_of,
    node_shape,
)

__all__ = [
    "FoldDtype",
    "FuseConvBNOptions",
    "FuseLinearBNOptions",
    "FuseBNIntoNextOptions",
    "bn_scale_shift",
    "fold_bn_into_output",
    "fold_bn_into_input",
    "is_batchnorm_node",
    "fuse_conv_bn",
    "fuse_linear_bn",
    "fuse_bn_into_next",
]

aten = torch.ops.aten


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


# ------------------------------------------------------------------------------------------ the math


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


# ------------------------------------------------------------------------------- layer (conv/linear)


def _ops(*names: str) -> set:
    found = set()
    for name in names:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(aten, packet, None), overload, None)
        if op is not None:
            found.add(op)
    return found


_CONV_FN = {F.conv1d, F.conv2d, F.conv3d} | _ops(
    "conv1d.default", "conv2d.default", "conv3d.default", "conv1d.padding", "conv2d.padding", "conv3d.padding"
)
_CONVT_FN = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d} | _ops(
    "conv_transpose1d.default", "conv_transpose2d.input", "conv_transpose3d.input"
)
_CONVOLUTION_FN = _ops("convolution.default")
_LINEAR_FN = {F.linear} | _ops("linear.default")

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
    zero_padding: bool
    module: Optional[nn.Module] = None

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


def _zero(padding: Any) -> bool:
    if isinstance(padding, str):
        return padding == "valid"
    if isinstance(padding, (tuple, list)):
        return all(p == 0 for p in padding)
    return padding == 0


def _arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def match_layer(gm: fx.GraphModule, node: Any) -> Union[Layer, str, None]:
    """A Layer, a reason why this conv/linear cannot absorb anything, or None (not a conv/linear)."""
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_module":
        m = module_of(gm, node)
        if not isinstance(m, (nn.Linear, nn.modules.conv._ConvNd)):
            return None
        if type(m).forward not in _KNOWN_LAYER_FORWARDS:
            return f"{type(m).__qualname__} overrides forward"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{type(m).__qualname__} has forward hooks"
        if isinstance(m, nn.Linear):
            return Layer(node, "linear", m.weight, m.bias, 1, True, m)
        kind = "conv_transpose" if isinstance(m, _CONVT_MODULES) else "conv"
        return Layer(node, kind, m.weight, m.bias, m.groups, _zero(m.padding), m)
    if node.op != "call_function":
        return None
    target = node.target
    if target in _LINEAR_FN:
        kind, groups, padding = "linear", 1, 0
    elif target in _CONV_FN:
        kind, groups, padding = "conv", _arg(node, 6, "groups", 1), _arg(node, 4, "padding", 0)
    elif target in _CONVT_FN:
        kind, groups, padding = "conv_transpose", _arg(node, 6, "groups", 1), _arg(node, 4, "padding", 0)
    elif target in _CONVOLUTION_FN:
        transposed = _arg(node, 6, "transposed", False)
        kind = "conv_transpose" if transposed else "conv"
        groups, padding = _arg(node, 8, "groups", 1), _arg(node, 4, "padding", 0)
    else:
        return None
    weight = attr_tensor(gm, _arg(node, 1, "weight"))
    if weight is None:
        return f"{_describe(node)}: weight is computed in the graph, not a constant"
    bias_arg = _arg(node, 2, "bias")
    bias = attr_tensor(gm, bias_arg)
    if bias_arg is not None and bias is None:
        return f"{_describe(node)}: bias is computed in the graph, not a constant"
    if not isinstance(groups, int):
        return f"{_describe(node)}: groups is not a constant"
    return Layer(node, kind, weight, bias, groups, _zero(padding))


def _set_arg(node: fx.Node, index: int, name: str, value: Any) -> None:
    args = list(node.args)
    if len(args) > index:
        args[index] = value
        node.args = tuple(args)
    elif name in node.kwargs or len(args) < index:
        node.kwargs = {**node.kwargs, name: value}
    else:
        node.args = tuple(args) + (value,)


def _fresh_module(m: nn.Module, weight: torch.Tensor, bias: torch.Tensor) -> nn.Module:
    """A plain Conv*/ConvTranspose*/Linear with m's hyper-parameters and the given weights."""
    if isinstance(m, nn.Linear):
        new: nn.Module = nn.Linear(m.in_features, m.out_features, bias=True, device="meta")
    else:
        base = next(c for c in _CONV_MODULES + _CONVT_MODULES if isinstance(m, c))
        kwargs: Dict[str, Any] = dict(
            stride=m.stride, padding=m.padding, dilation=m.dilation, groups=m.groups, bias=True,
            padding_mode=m.padding_mode, device="meta",
        )
        if base in _CONVT_MODULES:
            kwargs["output_padding"] = m.output_padding
        new = base(m.in_channels, m.out_channels, m.kernel_size, **kwargs)
    new.weight = nn.Parameter(weight, requires_grad=False)
    new.bias = nn.Parameter(bias, requires_grad=False)
    return new.eval()


def _module_is_exclusive(gm: fx.GraphModule, target: str) -> bool:
    prefix = target + "."
    return call_sites(gm, target) == 1 and not any(t.startswith(prefix) for t in get_attr_targets(gm))


def apply_layer_weights(
    gm: fx.GraphModule, layer: Layer, weight: torch.Tensor, bias: torch.Tensor, copy_shared: bool
) -> Optional[str]:
    """Point ``layer.node`` at new weights without touching other call sites. Returns a skip reason or None."""
    node = layer.node
    if layer.module is not None:
        exclusive = _module_is_exclusive(gm, str(node.target))
        if not exclusive and not copy_shared:
            return (
                f"module '{node.target}' is called at {call_sites(gm, str(node.target))} sites and "
                "copy_shared_modules is off"
            )
        install_module(gm, node, _fresh_module(layer.module, weight, bias), exclusive=exclusive)
        return None
    w_node = add_constant(gm, node, f"{node.name}_weight", weight)
    b_node = add_constant(gm, node, f"{node.name}_bias", bias)
    old_w, old_b = _arg(node, 1, "weight"), _arg(node, 2, "bias")
    _set_arg(node, 1, "weight", w_node)
    _set_arg(node, 2, "bias", b_node)
    # Free the unfused weight now, not at the end of the pass (peak memory: one copy of the weights).
    drop_replaced_attribute(gm, old_w)
    drop_replaced_attribute(gm, old_b)
    return None


# ------------------------------------------------------------------------------------------ BatchNorm

_F_BN = {F.batch_norm}
_TORCH_BN = {torch.batch_norm} | _ops("batch_norm.default")
_KNOWN_BN_FORWARDS = {nn.modules.batchnorm._BatchNorm.forward, nn.SyncBatchNorm.forward}


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


def is_batchnorm_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    if node.op == "call_module":
        m = module_of(gm, node)
        return m is not None and is_batchnorm_like(m)
    return node.op == "call_function" and (node.target in _F_BN or node.target in _TORCH_BN)


def match_bn(gm: fx.GraphModule, node: fx.Node) -> Union[BatchNorm, str, None]:
    """A foldable BatchNorm, a reason why this BatchNorm is not foldable, or None (not a BatchNorm)."""
    if not is_batchnorm_node(gm, node):
        return None
    if not node.args or not isinstance(node.args[0], fx.Node):
        return "input is not a graph value"
    if node.op == "call_module":
        m = module_of(gm, node)
        assert m is not None
        name = type(m).__qualname__
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            if type(m).forward not in _KNOWN_BN_FORWARDS:
                return f"{name} overrides BatchNorm's forward"
            if m.training:
                return f"{name} is in training mode"
        elif not type(m).__module__.startswith("torchvision"):
            return f"{name} is not torchvision's FrozenBatchNorm2d (unknown forward)"
        if m._forward_hooks or m._forward_pre_hooks:
            return f"{name} has forward hooks"
        if getattr(m, "running_mean", None) is None or getattr(m, "running_var", None) is None:
            return f"{name} has no running statistics (track_running_stats=False): it normalises with batch statistics even in eval mode"
        weight = m.weight if getattr(m, "affine", True) else None
        bias = m.bias if getattr(m, "affine", True) else None
        return BatchNorm(node, node.args[0], m.running_mean.numel(), m.running_mean, m.running_var, weight, bias, float(m.eps))
    if node.target in _F_BN:  # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps)
        rm_a, rv_a = _arg(node, 1, "running_mean"), _arg(node, 2, "running_var")
        w_a, b_a = _arg(node, 3, "weight"), _arg(node, 4, "bias")
        training, eps = _arg(node, 5, "training", False), _arg(node, 7, "eps", 1e-5)
    else:  # torch.batch_norm / aten.batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn)
        w_a, b_a = _arg(node, 1, "weight"), _arg(node, 2, "bias")
        rm_a, rv_a = _arg(node, 3, "running_mean"), _arg(node, 4, "running_var")
        training, eps = _arg(node, 5, "training", False), _arg(node, 7, "eps", 1e-5)
    if training is not False:
        return "functional batch_norm with training=True (or not a constant) uses batch statistics"
    rm, rv = attr_tensor(gm, rm_a), attr_tensor(gm, rv_a)
    if rm is None or rv is None:
        return "functional batch_norm: running statistics are not constants"
    w, b = attr_tensor(gm, w_a), attr_tensor(gm, b_a)
    if (w_a is not None and w is None) or (b_a is not None and b is None):
        return "functional batch_norm: weight or bias is computed, not a constant"
    if not isinstance(eps, (int, float)):
        return "functional batch_norm: eps is not a constant"
    return BatchNorm(node, node.args[0], rm.numel(), rm, rv, w, b, float(eps))


def _describe(node: Any) -> str:
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


def _remove_bn(gm: fx.GraphModule, bn: BatchNorm, replacement: fx.Node) -> None:
    bn.node.replace_all_uses_with(replacement)
    inputs = [a for a in list(bn.node.args) + list(bn.node.kwargs.values()) if isinstance(a, fx.Node)]
    gm.graph.erase_node(bn.node)
    for a in inputs:  # the functional form's statistics are get_attr nodes that are now dead
        if a.op == "get_attr" and not a.users:
            gm.graph.erase_node(a)


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
            if _kind_of(gm, producer) in kinds:
                result.skip(node.name, f"follows {_describe(producer)}, which cannot be folded: {layer}")
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
            result.skip(node.name, reason, into=_describe(producer))
            continue
        _remove_bn(gm, bn, producer)
        result.change(node.name, "folded", into=_describe(producer), kind=layer.kind)
    if result.changed:
        delete_unused_attributes(gm)


def _kind_of(gm: fx.GraphModule, node: Any) -> Optional[str]:
    if not isinstance(node, fx.Node):
        return None
    m = module_of(gm, node)
    if isinstance(m, nn.Linear) or (node.op == "call_function" and node.target in _LINEAR_FN):
        return "linear"
    if isinstance(m, nn.modules.conv._ConvNd) or (
        node.op == "call_function" and node.target in (_CONV_FN | _CONVT_FN | _CONVOLUTION_FN)
    ):
        return "conv_transpose" if isinstance(m, _CONVT_MODULES) or node.target in _CONVT_FN else "conv"
    return None


def _common_checks(bn: BatchNorm, layer: Layer) -> Optional[str]:
    if len(layer.node.users) != 1:
        others = [u.name for u in layer.node.users if u is not bn.node]
        return f"the output of {_describe(layer.node)} also feeds {', '.join(others)}; folding would change them"
    if layer.out_channels != bn.num_features:
        return f"{_describe(layer.node)} has {layer.out_channels} output channels, the BatchNorm {bn.num_features}"
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
            reason = f"{_describe(consumer)} pads its input, and the padding would see un-normalised zeros"
        elif layer.in_channels != bn.num_features:
            reason = f"{_describe(consumer)} has {layer.in_channels} input channels, the BatchNorm {bn.num_features}"
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
            result.skip(node.name, reason, into=_describe(consumer))
            continue
        _remove_bn(gm, bn, bn.input)
        result.change(node.name, "folded forward", into=_describe(consumer), kind=layer.kind)
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
        users = ", ".join(_describe(u) for u in node.users)
        out.append({
            "node": node.name,
            "reason": f"follows {_describe(bn.input)} (not a conv/linear it can fold into) and feeds {users}",
        })
    return out
