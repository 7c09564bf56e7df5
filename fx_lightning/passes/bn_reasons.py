"""Why a BatchNorm is still in the graph, in terms of the mathematics: what stands between it and a linear layer
on either side (a nonlinearity, a residual add, a gating multiply, pooling statistics, zero padding, a channel
mixed with another axis, another reader), found by the same walks the folds use (:mod:`.bn_producer`,
:mod:`.bn_consumer`), so a reason never describes a fold that exists.
"""

from __future__ import annotations

import operator
from typing import Dict, List, Union

import torch
import torch.fx as fx

from fx_lightning.passes.base import PassContext
from fx_lightning.passes.bn_consumer import plan_into_consumers, plan_layers, reach
from fx_lightning.passes.bn_layout import constant_padding
from fx_lightning.passes.bn_producer import concat_parts, op_names, plan_into_producer, walk_back
from fx_lightning.passes.bn_views import BatchNorm, Refused, bn_input, describe, match_bn
from fx_lightning.passes.graph_utils import module_of

__all__ = ["explain_batchnorm", "op_name"]

_NONLINEAR = {
    "relu", "relu6", "gelu", "silu", "sigmoid", "tanh", "elu", "selu", "celu", "leaky_relu", "leakyrelu", "hardswish",
    "hardsigmoid", "hardtanh", "mish", "softplus", "softsign", "softmax", "log_softmax", "logsoftmax", "glu", "prelu",
    "swish", "logsigmoid", "threshold", "erf", "exp", "log", "abs", "sqrt", "rsqrt", "pow", "square", "clamp",
    "clip", "sign", "reciprocal", "sin", "cos", "max_pool1d", "max_pool2d", "max_pool3d", "maxpool1d", "maxpool2d",
    "maxpool3d", "max_pool2d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d",
    "adaptivemaxpool1d", "adaptivemaxpool2d", "adaptivemaxpool3d", "max", "min", "amax", "amin", "topk", "sort",
    "layer_norm", "layernorm", "native_layer_norm", "group_norm", "groupnorm", "native_group_norm", "instance_norm",
    "instancenorm1d", "instancenorm2d", "rms_norm", "rmsnorm", "normalize", "tanhshrink", "softshrink", "hardshrink",
    "rrelu", "gumbel_softmax", "where", "masked_fill"}
_SUMS = {"add", "sub", "rsub", "iadd", "isub", "radd"}
_PRODUCTS = {"mul", "div", "truediv", "imul", "itruediv", "rmul", "rtruediv", "matmul", "bmm", "mm", "einsum",
             "baddbmm", "addmm", "scaled_dot_product_attention", "floordiv", "outer", "bilinear"}
_STATISTICS = {"std", "var", "var_mean", "std_mean", "norm", "linalg_vector_norm", "linalg_norm", "logsumexp"}
# Means and adaptive averages are followed (bn_layout); these poolings are not.
_POOLING = {"sum", "avg_pool1d", "avg_pool2d", "avg_pool3d", "avgpool1d", "avgpool2d", "avgpool3d", "cumsum"}
_MOST = 3  # readers named in one reason


def op_name(gm: fx.GraphModule, node: fx.Node) -> str:
    """``relu`` for ``F.relu``, ``aten.relu_.default``, ``x.relu()`` and ``nn.ReLU``; ``add`` for ``operator.add``."""
    if node.op == "call_module":
        m = module_of(gm, node)
        return type(m).__name__.lower() if m is not None else ""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", None) or str(node.target)
        name = name.split(".")[0]
    else:
        return node.op
    name = name.strip("_") if name.startswith("__") else name
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


def _category(gm: fx.GraphModule, user: fx.Node, value: fx.Node) -> str:
    """What ``user``, reading the BatchNorm's values as ``value``, is, among the things no fold passes."""
    name = op_name(gm, user)
    if user.op == "output":
        return "the model's output"
    if constant_padding(gm, user):
        return "padding with a constant, which would not be normalised"
    if name in _SUMS or user.target in (operator.add, operator.sub):
        if all(a is value for a in user.all_input_nodes):
            return "the addition of a constant, which the fold does not follow"
        if name.endswith("sub") or user.target is operator.sub:
            return "the subtraction of another value"
        return "a residual add beside another branch"
    if name in _PRODUCTS or user.target in (operator.mul, operator.truediv, operator.matmul):
        return "a product with another value, such as a gate or attention"
    if name in _STATISTICS:
        return "statistics that are not linear, a standard deviation or a norm"
    if name in _POOLING:
        return "a pooling the fold does not follow, a sum or a windowed average"
    if name in _NONLINEAR:
        return "a nonlinearity"
    if match_bn(gm, user) is not None:
        return "another BatchNorm"
    return "an operation that is neither a linear layer nor one that only moves values"


def _after(gm: fx.GraphModule, stops: List[fx.Node], values: Dict[fx.Node, fx.Node]) -> List[str]:
    """The readers that stop a forward fold, grouped by what they are: ``a nonlinearity (relu (relu), ...)``."""
    groups: Dict[str, List[str]] = {}
    for stop in stops:
        groups.setdefault(_category(gm, stop, values[stop]), []).append(describe(stop))
    out = []
    for category, nodes in groups.items():
        named = ", ".join(nodes[:_MOST]) + (f" and {len(nodes) - _MOST} more" if len(nodes) > _MOST else "")
        out.append(category if category == "the model's output" else f"{category} ({named})")
    return out


def _before(gm: fx.GraphModule, producer: object, chain: List[fx.Node]) -> str:
    """What produces the BatchNorm's input, when it is not a layer it folds into."""
    through = f" (through {op_names(chain)})" if chain else ""
    if not isinstance(producer, fx.Node):
        return "its input is not a graph value"
    d = describe(producer)
    name = op_name(gm, producer)
    if producer.op == "placeholder":
        return f"it normalises a model input{through}: no layer produces it"
    if producer.op == "get_attr":
        return f"it normalises a constant{through}"
    if concat_parts(producer) is not None:
        return f"its input{through} is {d}, a concatenation of values that are not all conv outputs"
    if name in _SUMS or producer.target in (operator.add, operator.sub):
        return f"its input{through} is a sum of branches ({d}): no one layer produces it"
    if name in _PRODUCTS or producer.target in (operator.mul, operator.truediv, operator.matmul):
        return f"its input{through} is a product of computed values ({d})"
    if name in _STATISTICS or name in _POOLING:
        return f"its input{through} is pooled ({d}), not a layer's output"
    if name in _NONLINEAR:
        return f"{d}{through} is not linear"
    if constant_padding(gm, producer):
        return f"{d}{through} pads with a constant, which the BatchNorm normalises and a fold would not"
    return f"{d}{through} is not a conv or linear layer"


def _producer_side(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, copy_shared: bool) -> str:
    plan = plan_into_producer(gm, ctx, node, bn, ("conv", "conv_transpose", "linear"), copy_shared, torch.float64)
    if isinstance(plan, str):
        return plan
    if plan is not None:
        return f"{plan.into} could take it (the fold into it did not run)"
    producer, chain = walk_back(gm, bn_input(node))
    return _before(gm, producer, chain)


def _consumer_side(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, bn: BatchNorm, copy_shared: bool) -> str:
    found = reach(gm, node)
    values = {stop: next((a for a in stop.all_input_nodes if a is node or a in found.layout), node)
              for stop in found.stops}
    reached = _after(gm, found.stops, values)
    planned = plan_layers(gm, ctx, node, bn, found, copy_shared, torch.float64) if found.layers else []
    refusals = [planned] if isinstance(planned, str) else [f for f in planned if isinstance(f, str)]
    if not reached and not refusals:
        plan = plan_into_consumers(gm, ctx, node, bn, copy_shared, torch.float64)
        return plan if isinstance(plan, str) else f"{plan.into} could take it (the fold into it did not run)"
    parts = ([f"it reaches {', '.join(reached)}"] if reached else []) + list(dict.fromkeys(refusals))
    return "; and ".join(parts)


def explain_batchnorm(gm: fx.GraphModule, ctx: PassContext, node: fx.Node, copy_shared: bool = True) -> str:
    """Why the BatchNorm ``node`` folds neither into what produces its input nor into what reads its output."""
    bn: Union[BatchNorm, Refused, None] = match_bn(gm, node)
    if bn is None:
        return "not a BatchNorm"
    if isinstance(bn, Refused):
        return bn.reason
    before = _producer_side(gm, ctx, node, bn, copy_shared)
    after = _consumer_side(gm, ctx, node, bn, copy_shared)
    return f"no exact fold: before it, {before}; after it, {after}"
