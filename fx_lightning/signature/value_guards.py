"""Branches on tensor values (``if not padding_mask.any(): padding_mask = None``): no tracer follows them. torch.export,
given the example's values (:func:`~fx_lightning.signature.program.export_program`'s last route), captures the way
the example takes and leaves a runtime assertion in the graph for each such branch. Each is then decided by
experiment on the observed calls, never assumed:

- **needless**: every observed call that takes the other way gets the model's outputs from the graph without the
  assertions (masking with a mask of no true entry is not masking): they are dropped and every call is served;
- **kept**: no observed call took the other way. The assertions are cut out of the graph into a guard program of their
  own (``value_guards.pt2``, listed in the manifest), which every artifact's interface runs before the runtime (ONNX
  and OpenVINO drop assertions), so a call taking the other way is refused by name, never answered wrongly;
- **refused**: an observed call takes the other way and the graph gives it other outputs: no one graph answers both
  ways, and the capture says so, naming the line.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Set

import torch
import torch.fx as fx
from torch import nn

from fx_lightning.common.calls import Call, tree_of_call
from fx_lightning.errors import ExportError, ModelError, first_line
from fx_lightning.signature.program import ASSERTION_FAILED, export_program

__all__ = ["GUARDS_FILE", "ValueBranches", "value_assertions", "value_reads", "settle_value_branches",
           "guard_program", "Guarded", "load_guards", "refusal"]

GUARDS_FILE = "value_guards.pt2"
_ASSERT = torch.ops.aten._assert_scalar.default
# Where a data-dependent value enters the graph (a tensor's value read as a Python scalar).
_VALUE_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default}


@dataclass
class ValueBranches:
    """How the branches on tensor values of a capture were settled: ``sites`` (``file:line: code``), the observed
    calls that took another way (``other_way``: each shown computed by the graph), and the guard program kept
    (None: no guard needed)."""

    sites: List[str]
    other_way: int = 0
    guards: Optional["torch.export.ExportedProgram"] = None
    kept: List[str] = field(default_factory=list)


def value_assertions(graph_module: fx.GraphModule, branches_only: bool = True) -> List[fx.Node]:
    """The graph's runtime assertions on a value read from a tensor (not on sizes); ``branches_only``: less those
    that hold for every value the tensor's dtype allows (torch's own range facts: a bool read is 0 or 1)."""
    return [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is _ASSERT
            and value_reads(n) and not (branches_only and _always_holds(n))]


def _always_holds(assertion: fx.Node) -> bool:
    """Whether the assertion holds whatever its reads of bool tensors give (each tried at False and True): torch's
    own range facts (``u0 >= 0``, ``u0 <= 1``), not a branch. Conditions reading anything else are never dropped."""
    reads = value_reads(assertion)
    if not reads or any(getattr(r.args[0].meta.get("val"), "dtype", None) is not torch.bool for r in reads):
        return False

    def evaluate(node: Any, given: Dict[fx.Node, bool]) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in given:
            return given[node]
        if node.op != "call_function":
            raise LookupError(node.name)  # reads a size or a tensor: not decided by the reads alone
        args = fx.node.map_aggregate(node.args, lambda a: evaluate(a, given))
        kwargs = fx.node.map_aggregate(node.kwargs, lambda a: evaluate(a, given))
        return node.target(*args, **kwargs)

    try:
        return all(bool(evaluate(assertion.args[0], dict(zip(reads, values))))
                   for values in itertools.product((False, True), repeat=len(reads)))
    except Exception:  # noqa: BLE001 - not decidable from the reads: kept as a branch
        return False


def _ancestors(nodes: Sequence[fx.Node]) -> Set[fx.Node]:
    found: Set[fx.Node] = set()
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n not in found:
            found.add(n)
            stack.extend(n.all_input_nodes)
    return found


def value_reads(assertion: fx.Node) -> List[fx.Node]:
    """The nodes reading the tensor values ``assertion`` checks (their stack traces name the user's line)."""
    return [n for n in _ancestors([assertion]) if n.op == "call_function" and n.target in _VALUE_READS]


def _strip(graph_module: fx.GraphModule, assertions: Sequence[fx.Node]) -> None:
    """Remove ``assertions`` and what only they used (the value reads), in place."""
    inputs = _ancestors(assertions) - set(assertions)
    for node in assertions:
        graph_module.graph.erase_node(node)
    for node in reversed(list(graph_module.graph.nodes)):
        if node in inputs and not node.users and node.op == "call_function":
            graph_module.graph.erase_node(node)
    graph_module.graph.lint()
    graph_module.recompile()


def _without_assertions(graph_module: fx.GraphModule) -> fx.GraphModule:
    """A copy of the graph (weights shared) without its assertions on values: what it computes the other way."""
    graph = fx.Graph()
    out = graph.graph_copy(graph_module.graph, {})
    graph.output(out)
    graph._codegen = graph_module.graph._codegen  # the unlifted module's pytree inputs and outputs
    copy = fx.GraphModule(graph_module, graph)
    _strip(copy, value_assertions(copy, branches_only=False))
    return copy


def _slice(graph_module: fx.GraphModule, assertions: Sequence[fx.Node], keep: bool) -> fx.GraphModule:
    """What ``assertions`` read, over the call's flat tensor leaves: asserting (``keep``: the guard program) or
    returning each one's condition (to see which way a call takes, without raising)."""
    needed = _ancestors(assertions) - (set() if keep else set(assertions))
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    for node in graph_module.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node in needed:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(None if keep else tuple(env[a.args[0]] for a in assertions))
    return fx.GraphModule(graph_module, graph, class_name="ValueGuards")


def _takes(graph_module: fx.GraphModule, call: Call, run: Callable[[nn.Module, Call], Any]) -> bool:
    """Whether the graph runs on ``call`` but for its assertions on values (a size it refuses: not for this)."""
    try:
        run(graph_module, call)
    except Exception as exc:  # noqa: BLE001 - only the assertions' failure counts here
        return ASSERTION_FAILED in str(exc)
    return True


def _ways(conditions: nn.Module, leaves: Sequence[torch.Tensor]) -> Optional[List[bool]]:
    """Each assertion's condition on a call (True: the example's way); None where the call cannot be read."""
    try:
        with torch.no_grad():
            return [bool(c) for c in conditions(*leaves)]
    except Exception:  # noqa: BLE001 - a size the program refuses: judged elsewhere
        return None


def settle_value_branches(graph_module: fx.GraphModule, model: nn.Module, calls: Sequence[Call],
                          run: Callable[[nn.Module, Call], Any], difference: Callable[[Any, Any], Optional[str]],
                          leaves_of: Callable[[Call], List[torch.Tensor]],
                          sites_of: Callable[[Sequence[fx.Node]], List[str]]) -> ValueBranches:
    """Decide the graph's branches on values on the observed ``calls`` (see the module's doc); the graph loses its
    assertions in place. Raises ExportError where no assertion guards the values read, a float value is read (torch
    builds the example's float in without an assertion), or a call takes another way the graph does not compute (ModelError where the values read depend on the weights: other weights may take one way
    only). ``run`` runs a module on a call (seeded); ``difference`` says how outputs differ (None: not);
    ``sites_of`` names the lines of the assertions' branches. The first call is the one the graph was captured on.
    """
    assertions = value_assertions(graph_module)
    floats = [n for n in graph_module.graph.nodes if n.op == "call_function" and n.target in _VALUE_READS
              and getattr(n.args[0].meta.get("val"), "dtype", torch.bool).is_floating_point]
    if not assertions or floats:  # a value the example gave may be built in with no assertion saying so
        raise ExportError(
            "captured with the example's tensor values, but " + ("a float value read from a tensor (an adaptive "
                                                                 "solver's step) may be built in without an assertion"
                                                                 if floats else "no assertion guards what it read"))
    conditions = _slice(graph_module, assertions, keep=False)
    ways = [(call, _ways(conditions, leaves_of(call))) for call in calls if _takes(graph_module, call, run)]
    other_way = [call for call, way in ways if way is not None and not all(way)]
    unguarded = _without_assertions(graph_module)
    for call in other_way:
        try:
            problem = difference(run(unguarded, call), run(model, call))
        except Exception as exc:  # noqa: BLE001 - the graph cannot even run that way
            problem = f"raises {first_line(exc, with_type=True)}"
        if problem is not None:  # the way a call takes may depend on the weights: not proven before training then
            error = ModelError if any(n.op == "get_attr" for n in _ancestors(assertions)) else ExportError
            raise error(
                f"the model branches on tensor values at {'; '.join(sites_of(assertions))}: the observed calls take "
                f"both ways ({len(other_way)} of {len(calls)} the other way from the example's), and the graph "
                f"captured on the example's way {problem} on one of them, so no one graph answers both ways")
    # An assertion every call met is kept: no call showed what the graph computes the other way.
    kept = [a for i, a in enumerate(assertions) if all(way is None or way[i] for _, way in ways)]
    guards = guard_program(graph_module, kept, leaves_of(calls[0])) if kept else None
    branches = ValueBranches(sites_of(assertions), len(other_way), guards, kept=sites_of(kept) if kept else [])
    _strip(graph_module, value_assertions(graph_module, branches_only=False))
    return branches


def guard_program(graph_module: fx.GraphModule, assertions: Sequence[fx.Node], leaves: Sequence[torch.Tensor]
                  ) -> "torch.export.ExportedProgram":
    """The assertions and what they read, as a program of their own over the call's flat tensor leaves (each size
    kept dynamic unless what they read fixes it): it returns nothing and raises where a call takes another way."""
    sliced = _slice(graph_module, assertions, keep=True)
    dims = [{d: torch.export.Dim.AUTO for d in range(t.dim())} or None for t in leaves]
    return export_program(sliced, Call(tuple(leaves)), dims).program


def refusal(what: str, sites: Sequence[str], exc: BaseException) -> ExportError:
    """The error of a call a guard refuses."""
    return ExportError(
        f"{what}: this call takes another way at the model's branch on tensor values ({'; '.join(sites)}) than every "
        f"call observed in training and validation took, and the artifact computes that way only "
        f"({first_line(exc)}). Train or validate on calls that take it too, so that both ways are captured or shown "
        "the same")


class Guarded(nn.Module):
    """``module`` behind its value guards: each call's tensor leaves are checked first, a call taking another way
    refused by name (the fused model itself, as parity and the callback give it)."""

    def __init__(self, module: nn.Module, guards: nn.Module, sites: Sequence[str], what: str) -> None:
        super().__init__()
        self.module, self.guards, self.sites, self.what = module, guards, list(sites), what

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        call = Call(args, kwargs)
        try:
            self.guards(*[t for t in tree_of_call(call).leaves(call) if isinstance(t, torch.Tensor)])
        except RuntimeError as exc:
            raise refusal(self.what, self.sites, exc) from None
        return self.module(*args, **kwargs)


def load_guards(root: Path) -> nn.Module:
    """The guard program an export keeps beside its artifacts. torch warns, once per value it reads, that the value's
    symbol is not in the graph it deserialised (the assertions read it, not a size): said here instead."""
    serialiser = logging.getLogger("torch._export.serde.serialize")
    level = serialiser.level
    serialiser.setLevel(logging.ERROR)
    try:
        return torch.export.load(str(root / GUARDS_FILE)).module()
    finally:
        serialiser.setLevel(level)
