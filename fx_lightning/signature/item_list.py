"""A list argument whose items are samples (torchvision's detectors take ``List[Tensor]`` images, one per sample,
and return one result per image), proven by experiment on an observed call or not recorded at all.

The artifact is built for the list's length in the calls observed (its items are separate tensors in the graph).
Where each item's outputs are shown to be its own (:func:`find_item_list`), a list of another length runs as pieces
of that length, the last one padded with copies of its last item whose results are dropped
(:func:`run_in_pieces`); else a list of another length is refused, as any structure the artifact was not built for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch

from fx_lightning.common.calls import Call, Step, Tree, tree_of, tree_of_call
from fx_lightning.parity.compare import compare_outputs

__all__ = ["ItemList", "find_item_list", "given_length", "run_in_pieces"]


@dataclass(frozen=True)
class ItemList:
    """``argument``: the step of forward's argument that is the list (``("arg", 0)``, ``("kwarg", "images")``);
    ``length``: the length the artifact takes; ``how``: the experiment that showed each item's outputs its own."""

    argument: Step
    length: int
    how: str

    def to_dict(self) -> Mapping[str, object]:
        return {"argument": list(self.argument), "length": self.length, "how": self.how}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ItemList":
        kind, key = data["argument"]
        return cls((str(kind), key), int(data["length"]), str(data.get("how", "")))


def _item_list_argument(tree: Tree) -> Optional[Tuple[Step, int]]:
    """The one argument of the call that is a ``list`` of two or more tensors (None: none, or several)."""
    found = [(step, len(child.children)) for step, child in tree.children
             if child.kind == "seq" and child.cls is list and len(child.children) >= 2
             and all(grand.kind == "tensor" for _, grand in child.children)]
    return found[0] if len(found) == 1 else None


def _output_items(outputs: Any, length: int) -> Optional[List[Any]]:
    """The outputs as one result per item: a ``list`` of ``length`` results of one structure (None: not that)."""
    if not isinstance(outputs, list) or len(outputs) != length:
        return None
    first = tree_of(outputs[0])
    return outputs if all(tree_of(o).same_structure(first) for o in outputs[1:]) else None


def find_item_list(call: Call, outputs: Any, run: Callable[[Call], Any]) -> Tuple[Optional[ItemList], Optional[str]]:
    """Whether ``call``'s one list argument carries samples: the outputs are a list of one result per item, and
    with every other item replaced by a copy of the first (then of the last) the model gives that item the result it
    gave it in the call. Returns the record, or None with why not (None, None: no list argument to test)."""
    found = _item_list_argument(tree_of_call(call))
    if found is None:
        return None, None
    argument, length = found
    name = f"{argument[1]}" if argument[0] == "kwarg" else f"argument {argument[1]}"
    if _output_items(outputs, length) is None:
        return None, f"{name} is a list of {length} tensors, but the outputs are not a list of one result per item"
    items = _value(call, argument)
    for index in (0, length - 1):
        try:
            got = run(_with_value(call, argument, [items[index]] * length))
        except Exception as exc:  # noqa: BLE001 - the model refuses copies of one item: no proof
            return None, f"{name} with every item a copy of item {index} makes the model raise {type(exc).__name__}"
        if _output_items(got, length) is None:
            return None, f"{name} with every item a copy of item {index} gives outputs of another structure"
        comparison = compare_outputs(got[0], outputs[index])
        if not comparison.passed:
            return None, (f"the items of {name} are not independent: with the others replaced by copies of item "
                          f"{index}, its result changed ({comparison.describe()})")
    how = (f"{name}, a list of {length} tensors, gives one result per item, and each item tried (the first, the last) "
           "gave the same result beside copies of itself as in the call")
    return ItemList(argument, length, how), None


def _value(call: Call, argument: Step) -> Any:
    kind, key = argument
    return call.args[key] if kind == "arg" else call.kwargs[key]


def _with_value(call: Call, argument: Step, value: Any) -> Call:
    kind, key = argument
    if kind == "arg":
        return Call(call.args[:key] + (value,) + call.args[key + 1:], dict(call.kwargs))
    return Call(tuple(call.args), {**call.kwargs, key: value})


def given_length(items: ItemList, call: Call) -> Optional[int]:
    """The length of the list ``call`` gives where the artifact takes one (None: no list there)."""
    kind, key = items.argument
    present = (kind == "arg" and len(call.args) > key) or (kind == "kwarg" and key in call.kwargs)
    value = _value(call, items.argument) if present else None
    return len(value) if isinstance(value, list) else None


def run_in_pieces(items: ItemList, call: Call, run: Callable[[Call], Any]) -> List[Any]:
    """``call`` with a list of another length than the artifact's, run as pieces of its length (the last padded
    with copies of its last item, their results dropped); the results in order, one per item."""
    given: Sequence[torch.Tensor] = _value(call, items.argument)
    results: List[Any] = []
    for start in range(0, len(given), items.length):
        piece = list(given[start:start + items.length])
        real = len(piece)
        piece += [piece[-1]] * (items.length - real)
        results.extend(run(_with_value(call, items.argument, piece))[:real])
    return results
