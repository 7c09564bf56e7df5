"""Conditions on the sizes an artifact takes, from torch.export's guards: a forward that branches on a size
(``if T % 8 == 0``, as torchaudio's ConvTasNet pads to its stride) is captured on one side of the branch, and
torch.export's program guards that side (``(L['x'].size()[2] % 8) == 0``). The fused graph and the artifacts made
from it keep only the code on that side: without the guard they would compute it for every size. Each guard is
kept as a condition over the input leaves' sizes (``size0_2 % 8 == 0``), written in the manifest and checked by
``load_fused`` before a runtime sees a call. A guard that cannot be read this way is reported, and the capture is
then fixed to the example's sizes.

Conditions are checked by a small evaluator over integers (no ``eval``): a manifest is data, never code.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from fx_lightning.common.batches import flat_tensors
from fx_lightning.common.calls import Call, run_seeded, tree_of_call
from fx_lightning.common.rows import rows_of, take_rows
from fx_lightning.parity.compare import compare_outputs

if TYPE_CHECKING:
    from fx_lightning.signature.signature import Signature

__all__ = ["conditions_from_guards", "condition_holds", "condition_sizes", "describe_condition", "failed_condition",
           "one_row_conditions"]

_BINARY: Dict[type, Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_COMPARE: Dict[type, Callable[[int, int], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}
# The functions torch.export's guards call on sizes (``torch.sym_max(1, s0 // 20)``), by the name a condition uses.
_SYM_FUNCTIONS = {"sym_max": "max", "sym_min": "min"}
_FUNCTIONS: Dict[str, Callable[..., int]] = {"max": max, "min": min}


def conditions_from_guards(program: Any, module: nn.Module, call: Call) -> Tuple[List[str], List[str]]:
    """torch.export's guards on ``program`` (made from ``module`` called with ``call``) as conditions over the sizes
    of ``call``'s tensor leaves, and the guards that could not be read so (their text)."""
    guards = [str(g) for g in getattr(program, "_guards_code", None) or []]
    if not guards:
        return [], []
    leaves = tree_of_call(call).leaves(call)
    try:
        bound = inspect.signature(module.forward).bind(*call.args, **call.kwargs)
        named: Dict[str, object] = dict(bound.arguments)
    except (TypeError, ValueError):
        return [], guards
    # torch.export's strict route names the inputs by their flat order (the pytree of the arguments)
    named.setdefault("flat_args", torch.utils._pytree.tree_flatten((call.args, call.kwargs))[0])
    conditions, unread = [], []
    for guard in guards:
        condition = _condition(guard, named, leaves)
        if condition is None:
            unread.append(guard)
        else:
            conditions.append(condition)
    return conditions, unread


def _condition(guard: str, named: Dict[str, object], leaves: Sequence[torch.Tensor]) -> Optional[str]:
    """``guard`` with each ``L[...].size()[d]`` replaced by ``size{leaf}_{d}``; None where something else is read."""
    try:
        tree = ast.parse(guard, mode="eval")
    except SyntaxError:
        return None

    class Sizes(ast.NodeTransformer):
        def visit_Subscript(self, node: ast.Subscript) -> Any:  # L['x'].size()[2]
            call = node.value
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "size" \
                    and not call.args and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                leaf = _leaf_index(call.func.value, named, leaves)
                if leaf is not None:
                    return ast.copy_location(ast.Name(f"size{leaf}_{node.slice.value}", ast.Load()), node)
            return self.generic_visit(node)

        def visit_Attribute(self, node: ast.Attribute) -> Any:  # torch.sym_max -> max
            if isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in _SYM_FUNCTIONS:
                return ast.copy_location(ast.Name(_SYM_FUNCTIONS[node.attr], ast.Load()), node)
            return self.generic_visit(node)

    rewritten = Sizes().visit(tree)
    text = ast.unparse(rewritten)
    return text if _evaluable(rewritten.body) else None


def _leaf_index(node: ast.AST, named: Dict[str, object], leaves: Sequence[torch.Tensor]) -> Optional[int]:
    """The leaf ``L['x']['key'][0]`` is, by identity among ``leaves`` (None: not one of them)."""
    keys: List[Any] = []
    while isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        keys.append(node.slice.value)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "L") or not keys:
        return None
    value: Any = named
    for key in reversed(keys):
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            return None
    return next((i for i, leaf in enumerate(leaves) if leaf is value), None)


def _evaluable(node: ast.AST) -> bool:
    """Whether ``node`` uses only what :func:`_value` evaluates."""
    if isinstance(node, ast.Constant):
        return type(node.value) in (int, bool)
    if isinstance(node, ast.Name):
        return node.id.startswith("size")
    if isinstance(node, ast.BinOp):
        return type(node.op) in _BINARY and _evaluable(node.left) and _evaluable(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, (ast.Not, ast.USub)) and _evaluable(node.operand)
    if isinstance(node, ast.BoolOp):
        return all(_evaluable(v) for v in node.values)
    if isinstance(node, ast.Compare):
        return all(type(op) in _COMPARE for op in node.ops) and all(_evaluable(v) for v in [node.left, *node.comparators])
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS and not node.keywords and \
            len(node.args) >= 2 and all(_evaluable(a) for a in node.args)
    return False


def _value(node: ast.AST, sizes: Dict[str, int]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return sizes[node.id]
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_value(node.left, sizes), _value(node.right, sizes))
    if isinstance(node, ast.UnaryOp):
        operand = _value(node.operand, sizes)
        return (not operand) if isinstance(node.op, ast.Not) else -operand
    if isinstance(node, ast.BoolOp):
        values = [_value(v, sizes) for v in node.values]
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare):
        left = _value(node.left, sizes)
        for op, right_node in zip(node.ops, node.comparators):
            right = _value(right_node, sizes)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return _FUNCTIONS[node.func.id](*(_value(a, sizes) for a in node.args))
    raise ValueError(f"not a size condition: {ast.dump(node)}")


@functools.lru_cache(maxsize=None)
def _parsed(condition: str) -> Tuple[ast.expr, Tuple[Tuple[str, int, int], ...]]:
    """``condition`` parsed once (it is checked on every call), with its sizes: (name, leaf, dim)."""
    body = ast.parse(condition, mode="eval").body
    if not _evaluable(body):  # a manifest edited by hand: nothing it says can be checked
        raise ValueError(f"not a size condition: {condition!r}")
    names = sorted({node.id for node in ast.walk(body) if isinstance(node, ast.Name) and node.id.startswith("size")})
    return body, tuple((name, *map(int, name[len("size"):].split("_"))) for name in names)  # type: ignore[misc]


def condition_sizes(condition: str) -> List[Tuple[int, int]]:
    """The (input leaf, dimension) pairs ``condition`` reads."""
    return [(leaf, dim) for _, leaf, dim in _parsed(condition)[1]]


def condition_holds(condition: str, tensors: Sequence[Any]) -> bool:
    """Whether the sizes of ``tensors`` (the artifact's input leaves, in order) meet ``condition``."""
    body, sizes = _parsed(condition)
    return bool(_value(body, {name: int(tensors[leaf].shape[dim]) for name, leaf, dim in sizes}))


def describe_condition(condition: str, names: Sequence[str]) -> str:
    """``condition`` as people read it: ``(x dim 2 % 8) == 0``."""
    tree = ast.parse(condition, mode="eval")

    class Named(ast.NodeTransformer):
        def visit_Name(self, node: ast.Name) -> Any:
            if not node.id.startswith("size"):
                return node
            leaf, _, dim = node.id[len("size"):].partition("_")
            return ast.Name(f"{names[int(leaf)]}.shape[{dim}]", ast.Load())

    return ast.unparse(Named().visit(tree))


def failed_condition(conditions: Sequence[str], tensors: Sequence[Any], names: Sequence[str]) -> Optional[str]:
    """Why ``tensors`` are refused by the first condition they fail (None: they meet every one)."""
    for condition in conditions:
        if not condition_holds(condition, tensors):
            read = {leaf for leaf, _ in condition_sizes(condition)}
            sizes = ", ".join(f"{names[i]}.shape = {list(tensors[i].shape)}" for i in sorted(read))
            return (f"{sizes}; the artifact takes only sizes where {describe_condition(condition, names)} (the model "
                    "branches on that size, and the captured graph holds the branch taken in the calls observed)")
    return None


def one_row_conditions(graph: nn.Module, working: nn.Module, call: Call, signature: Optional["Signature"],
                       conditions: Sequence[str]) -> List[str]:
    """``conditions`` as one row of ``call`` shows them, the graph and the model run on it once. torch.export takes a
    dynamic size to be 2 or more, so a branch the model takes on a batch of one (``if x.shape[0] == 1``) is not in
    the graph and not guarded: where the graph fails or gives other values than the model on one row, the sample
    axis must not be 1 (a condition added). Where it gives the model's own, the guards on sample axes one row fails
    only said so (RAFT runs both images through one encoder, ``torch.cat`` then ``chunk``: torch.export guards the
    halves' size against 1): they take one row."""
    if signature is None or not signature.batched:
        return list(conditions)
    tree = tree_of_call(call)
    leaves = tree.leaves(call)
    axes = signature.input_axes()
    first = next((i for i, a in enumerate(axes) if a is not None), None)
    if first is None or len(leaves) != len(axes) or rows_of(leaves, axes) in (None, 1):
        return list(conditions)
    one = take_rows(leaves, axes, 0, 1)
    not_one = f"size{first}_{axes[first]} != 1"
    try:
        expected = flat_tensors(run_seeded(working, tree.rebuild(one)))
    except Exception:  # noqa: BLE001 - the model itself does not run one row: nothing to guard
        return list(conditions)
    try:
        got = flat_tensors(run_seeded(graph, tree.rebuild(one)))
    except Exception:  # noqa: BLE001 - the graph does not: refused by name instead of by the runtime
        return [*conditions, not_one]
    if len(got) != len(expected) or any(g.numel() != e.numel() for g, e in zip(got, expected)):
        return list(conditions)  # another structure at one row (a squeeze): the interface rebuilds it
    if not compare_outputs([g.reshape(-1) for g in got], [e.reshape(-1) for e in expected]).passed:
        return [*conditions, not_one]
    # Only a condition on sample axes alone is shown not to matter at one row (the other sizes were the call's).
    on_samples = [c for c in conditions if all(axes[leaf] == dim for leaf, dim in condition_sizes(c))]
    return [f"({c}) or {not_one.replace('!=', '==')}" if c in on_samples and not condition_holds(c, one) else c
            for c in conditions]
