"""``remove_identity`` and ``eliminate_dead_code``: the clean-up passes."""

from __future__ import annotations

import torch.fx as fx
from torch import nn

from fx_lightning.passes.base import PassContext, PassOptions, PassResult, builtin_pass
from fx_lightning.passes.graph_utils import delete_unused_attributes, delete_unused_submodules, module_of

__all__ = ["remove_identity", "eliminate_dead_code"]


# Neither pass has options of its own: PassOptions (``enabled``) is theirs.
@builtin_pass("remove_identity", options=PassOptions)
def remove_identity(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Replace calls of ``nn.Identity`` by their input."""
    result = PassResult()
    for node in list(gm.graph.nodes):
        m = module_of(gm, node)
        if type(m) is not nn.Identity:
            continue
        result.remove_identity(gm, node, "Identity called without a graph value", module=str(node.target))
    if result.changed:
        delete_unused_submodules(gm)
    return result


@builtin_pass("eliminate_dead_code", options=PassOptions)
def eliminate_dead_code(gm: fx.GraphModule, options: PassOptions, ctx: PassContext) -> PassResult:
    """Drop nodes whose results nobody uses (impure ones stay), then the attributes nobody reads."""
    result = PassResult()
    before = {n.name: n for n in gm.graph.nodes}
    gm.graph.eliminate_dead_code()
    after = {n.name for n in gm.graph.nodes}
    for name, node in before.items():
        if name not in after:
            result.change(name, "removed", op=node.op)
    freed = delete_unused_attributes(gm)
    if freed:
        result.change("<attributes>", "freed", elements=freed)
    return result
