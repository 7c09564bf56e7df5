"""Library functions the capture keeps whole, called by name in the graph, and the objects modules kept whole take.

torch.fx writes a kept-whole function of torch's own namespace into the generated code as
``wrap("torch.nn.utils.rnn.pack_padded_sequence")``, a dotted name its own unpickler cannot find (KeyError when
the saved GraphModule is loaded). The graph calls :func:`call_by_name` instead, a plain module-level name that
round-trips, with the function's qualified name as its first argument.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.fx.node import _get_qualified_name

from fx_lightning.common.calls import Tree, tree_of, value_at
from fx_lightning.common.objects import fresh_copy, set_field

__all__ = ["call_by_name", "call_torch_functions_by_name", "ArgumentOf", "object_argument"]


def call_by_name(qualified_name: str, *args: Any, **kwargs: Any) -> Any:
    """Call the function named ``package.module.function``."""
    module, _, name = qualified_name.rpartition(".")
    function: Callable[..., Any] = getattr(importlib.import_module(module), name)
    return function(*args, **kwargs)


fx.wrap("call_by_name")  # tracing a graph that calls it (torch.fx's unpickler retraces) keeps it one call


def call_torch_functions_by_name(graph: fx.Graph) -> int:
    """Route each kept-whole call of a function in torch's namespace through :func:`call_by_name`; returns how many.

    Done on the graph before any GraphModule compiles it: compiled code runs its ``wrap(...)`` lines, and torch.fx
    keeps each in a process-wide table that every later trace reads (a dotted name there breaks them all)."""
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or not node.meta.get("is_wrapped") or node.target is call_by_name:
            continue
        qualified = _get_qualified_name(node.target)
        if qualified.startswith("torch."):
            node.args = (qualified, *node.args)
            node.target = call_by_name
            changed += 1
    return changed


class ArgumentOf(nn.Module):
    """An argument of a module kept whole (a library's batch object: torch_geometric's ``Batch``) made again from
    its tensors: torch.fx makes no graph node of such an object, so the graph passes its tensors to this module,
    which rebuilds it (a module: torch.fx's unpickler, retracing the graph, keeps it one call)."""

    def __init__(self, structure: Tree) -> None:
        super().__init__()
        self.structure = structure

    def forward(self, *leaves: Any) -> Any:
        return self.structure.rebuild(leaves)


def object_argument(value: Any) -> Optional[Tree]:
    """The structure of ``value`` with its tensors taken out (the graph keeps it: no tensor or proxy may stay in it),
    where it is an object holding tensors in fields; else None. The traced example's private state is left out
    (:func:`~fx_lightning.common.objects.fresh_copy`)."""
    tree = tree_of(value)
    if tree.kind != "obj":
        return None
    stripped = _without_tensors(tree, value)
    return None if _holds_traced(stripped) else stripped


def _without_tensors(tree: Tree, value: Any) -> Tree:
    if tree.kind in ("tensor", "const"):
        return tree
    children = [(step, _without_tensors(child, value_at(value, (step,)))) for step, child in tree.children]
    template = tree.template
    if tree.kind == "obj" and template is not None:
        template = fresh_copy(template)  # without the traced example's private state (a cached count)
        for (_, key), _child in tree.children:
            set_field(template, key, None)
    return dataclasses.replace(tree, children=children, template=template)


def _holds_traced(tree: Tree) -> bool:
    """Whether a tensor or a proxy is left in a template (a mapping of its own class, a distribution, private
    attributes): the graph could not keep it."""
    held = [tree.template] if tree.kind != "tensor" else []
    if tree.kind == "obj" and tree.template is not None and hasattr(tree.template, "__dict__"):
        held = list(vars(tree.template).values())
    return any(_has_tensor(v) for v in held) or any(_holds_traced(child) for _, child in tree.children)


def _has_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, (torch.Tensor, fx.Proxy)):
        return True
    if depth > 4:
        return False
    if isinstance(value, Mapping):  # a library's own store of fields too (torch_geometric's)
        return any(_has_tensor(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v, depth + 1) for v in value)
    return False
