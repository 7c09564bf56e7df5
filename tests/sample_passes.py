"""User passes referenced by import path from the tests ("sample_passes:...")."""

from __future__ import annotations

import copy
import operator

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassBase
from torch.fx.passes.infra.pass_base import PassResult as FxPassResult

from fx_lightning.passes import PassResult


def double_output(gm: fx.GraphModule, options: dict, ctx) -> PassResult:
    """Multiply the graph's output by options['factor'] (changes computation on purpose)."""
    result = PassResult()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    value = out.args[0]
    with gm.graph.inserting_before(out):
        scaled = gm.graph.call_function(operator.mul, (value, options.get("factor", 2.0)))
    out.args = (scaled,)
    result.change(scaled.name, "scaled output")
    return result


def breaks_graph(gm: fx.GraphModule, options: dict, ctx) -> None:
    """Leaves a node that uses a value defined after it: the graph no longer lints."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_module"]
    first, last = nodes[0], nodes[-1]
    first.args = (last,) + tuple(first.args[1:])


def raises(gm: fx.GraphModule, options: dict, ctx) -> None:
    raise ValueError("boom from a user pass")


NOT_CALLABLE = 3


def export_refuses(gm: fx.GraphModule, options: dict, ctx) -> "PassResult":
    """Routes the graph's output through a call torch.export cannot capture (a branch on a tensor's value),
    while the GraphModule itself still runs: only the export step fails."""
    result = PassResult()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        gated = gm.graph.call_function(value_gate, (out.args[0],))
    out.args = (gated,)
    result.change(gated.name, "gated output")
    return result


def value_gate(x):
    if float(x.abs().sum()) >= 0:  # data-dependent: torch.export cannot specialise on it
        return x
    return -x


# What record_dtypes saw, in call order: the dtype of the graph's floating parameters each time it ran.
SEEN_DTYPES: list = []


def record_dtypes(gm: fx.GraphModule, options: dict, ctx) -> None:
    """Changes nothing; records the dtype the graph's weights are in (the preflight's run, then the end of fit's)."""
    SEEN_DTYPES.append(next(p.dtype for p in gm.parameters() if p.is_floating_point()))


def flip_a_mask_value(gm: fx.GraphModule, options: dict, ctx) -> PassResult:
    """Changes computation on purpose: the second output (a 0/1 mask) gets its first element flipped."""
    result = PassResult()
    out = next(n for n in gm.graph.nodes if n.op == "output")
    scores, mask, labels = out.args[0]
    with gm.graph.inserting_before(out):
        flipped = gm.graph.call_function(_flip_first, (mask,))
    out.args = ((scores, flipped, labels),)
    result.change(flipped.name, "flipped a mask value")
    return result


def _flip_first(mask):
    flat = mask.clone().reshape(-1)
    flat[0] = 1.0 - flat[0]
    return flat.reshape(mask.shape)


class ScaleOutputFxPass(PassBase):
    """A torch.fx pass as torch.fx users write one: edits the graph in place and says it did."""

    def __init__(self, factor: float = 2.0) -> None:
        super().__init__()
        self.factor = factor

    def call(self, graph_module: fx.GraphModule) -> FxPassResult:
        out = next(n for n in graph_module.graph.nodes if n.op == "output")
        with graph_module.graph.inserting_before(out):
            scaled = graph_module.graph.call_function(operator.mul, (out.args[0], self.factor))
        out.args = (scaled,)
        return FxPassResult(graph_module, True)


def _rebuilt_adding_a_buffer(graph_module: fx.GraphModule, name: str, value: torch.Tensor,
                             prefix: str = "") -> fx.GraphModule:
    """A new GraphModule (a new root, the children renamed ``prefix + name``) whose output is the old one plus a
    new buffer ``name`` read with get_attr."""
    root = torch.nn.Module()
    for child_name, child in graph_module.named_children():
        root.add_module(f"{prefix}{child_name}", child)
    root.register_buffer(name, value)
    graph = copy.deepcopy(graph_module.graph)
    for node in graph.nodes:
        if node.op == "call_module":
            node.target = f"{prefix}{node.target}"
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        shifted = graph.call_function(operator.add, (out.args[0], graph.get_attr(name)))
    out.args = (shifted,)
    return fx.GraphModule(root, graph)


class RebuildWithOffsetFxPass(PassBase):
    """A torch.fx pass that returns a new GraphModule (a new root holding a new buffer the graph reads)."""

    def call(self, graph_module: fx.GraphModule) -> FxPassResult:
        return FxPassResult(_rebuilt_adding_a_buffer(graph_module, "offset", torch.tensor(0.5)), True)


class ReplaceSubmoduleByTensorFxPass(PassBase):
    """Returns a new GraphModule whose submodules are renamed (``kept_0``...) and which adds a new buffer to its
    output: names the old GraphModule had must not survive, and a buffer must stay a buffer."""

    def call(self, graph_module: fx.GraphModule) -> FxPassResult:
        return FxPassResult(_rebuilt_adding_a_buffer(graph_module, "shift", torch.full((1,), 0.25), "kept_"), True)
