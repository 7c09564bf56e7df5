"""``remove_dropout``: every Dropout module variant and functional dropout that is inactive in eval mode."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from dataclasses import dataclass

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, builtin_pass
from fx_lightning.passes.graph_utils import delete_unused_submodules, module_of, node_arg

__all__ = ["RemoveDropoutOptions", "remove_dropout", "is_dropout_node"]

aten = torch.ops.aten

# _DropoutNd covers Dropout, Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout.
_DROPOUT_MODULES = (nn.modules.dropout._DropoutNd,)
# function -> the name of its `training` argument (the third) and that argument's default
_DROPOUT_FUNCTIONS = {
    **dict.fromkeys((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d), ("training", True)),
    **dict.fromkeys((F.alpha_dropout, F.feature_alpha_dropout), ("training", False)),
    # torch.export records eval-mode Dropout1d/2d/3d (p=0 too) as aten.feature_dropout, AlphaDropout and
    # FeatureAlphaDropout as their own ATen ops: the same identity in eval mode.
    **dict.fromkeys((torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout,
                     aten.dropout.default, aten.feature_dropout.default, aten.alpha_dropout.default,
                     aten.feature_alpha_dropout.default), ("train", None)),
}


@dataclass
class RemoveDropoutOptions(PassOptions):
    # F.dropout(x, training=True) is active even in eval mode: removing it changes outputs, so it is
    # left alone (and reported) unless asked for.
    remove_active_functional: bool = False


def is_dropout_node(gm: fx.GraphModule, node: fx.Node) -> bool:
    """A Dropout module call or a functional/ATen dropout (active or not)."""
    if node.op == "call_module":
        return isinstance(module_of(gm, node), _DROPOUT_MODULES)
    return node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS


@builtin_pass("remove_dropout", options=RemoveDropoutOptions)
def remove_dropout(gm: fx.GraphModule, options: RemoveDropoutOptions, ctx: PassContext) -> PassResult:
    """Replace dropout (modules, F.* and ATen forms) by its input; it is the identity in eval mode."""
    result = PassResult()
    for node in list(gm.graph.nodes):
        if node.op == "call_module":
            m = module_of(gm, node)
            if not isinstance(m, _DROPOUT_MODULES):
                continue
            if m.training:
                result.skip(node.name, f"{type(m).__qualname__} is in training mode")
                continue
            what = type(m).__qualname__
        elif node.op == "call_function" and node.target in _DROPOUT_FUNCTIONS:
            training = node_arg(node, 2, *_DROPOUT_FUNCTIONS[node.target])
            what = getattr(node.target, "__name__", str(node.target))
            if training is not False and not options.remove_active_functional:
                result.skip(
                    node.name,
                    f"{what}(training={training!r}) is active even in eval mode; removing it changes outputs "
                    "(set passes.remove_dropout.remove_active_functional: true to remove it anyway)",
                )
                continue
        elif node.op == "call_method" and node.target == "dropout":
            result.skip(node.name, "Tensor.dropout method call: training flag unknown")
            continue
        else:
            continue
        result.remove_identity(gm, node, "input is not a graph value", op=what)
    if result.changed:
        delete_unused_submodules(gm)
    return result
