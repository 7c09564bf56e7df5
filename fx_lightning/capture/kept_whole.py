"""Library functions the capture keeps whole, called by name in the graph.

torch.fx writes a kept-whole function of torch's own namespace into the generated code as
``wrap("torch.nn.utils.rnn.pack_padded_sequence")``, a dotted name its own unpickler cannot find (KeyError when
the saved GraphModule is loaded). The graph calls :func:`call_by_name` instead, a plain module-level name that
round-trips, with the function's qualified name as its first argument.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch.fx as fx
from torch.fx.node import _get_qualified_name

__all__ = ["call_by_name", "call_torch_functions_by_name"]


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
