"""Constants of the observed calls (a flag, an enum member, a count) shown by experiment not to change the outputs:
the artifact then takes any value there, as the model does (:func:`unread_constant`)."""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, List, Optional, Sequence

import torch

from fx_lightning.common.calls import Call, Tree, tree_of, value_at
from fx_lightning.signature.sample_axis import Runner

__all__ = ["unread_constant"]


def unread_constant(tree: Tree, leaves: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], path: Sequence[Any],
                    value: Any, samples: Optional[int], run: Runner, output_tree: Tree) -> Optional[str]:
    """Whether a constant of the calls is shown not to change the outputs, by running the call with the other values
    it can take: every other member of an enum, the other bool; an int that counts the batch's samples (a graph or
    molecule count) with 1, one more and twice as many. The outputs' containers count as much as their tensors (a
    ``return_dict`` flag changes only those). Returns the values tried (None: read, untried, or it raised): the
    artifact then takes any value there, as the model does."""
    if isinstance(value, Enum):
        others: List[Any] = [m for m in type(value) if m is not value]
    elif isinstance(value, bool):
        others = [not value]
    elif type(value) is int and samples is not None and value == samples:
        others = sorted({1, value + 1, 2 * value} - {value})
    else:
        return None
    if not others or not path or path[-1][0] not in ("arg", "kwarg", "key", "attr"):
        return None
    for other in others:
        call = tree.rebuild(list(leaves))
        _put(call, path, other)
        try:
            got = run(call)
        except Exception:  # noqa: BLE001 - the model reads it
            return None
        got_tree = tree_of(got)
        if not got_tree.same_structure(output_tree):
            return None
        got_leaves = got_tree.leaves(got)
        if len(got_leaves) != len(outputs) or any(
                g.shape != o.shape or g.dtype != o.dtype or not torch.equal(g, o) for g, o in zip(got_leaves, outputs)):
            return None
    return "outputs unchanged with " + ", ".join(repr(o) for o in others)


def _put(call: Call, path: Sequence[Any], value: Any) -> None:
    """Set the value at ``path`` in ``call`` (rebuilt fresh from its tree: nothing the caller holds changes)."""
    (kind, key) = path[-1]
    parent: Any = value_at(call, path[:-1]) if len(path) > 1 else call
    if kind == "arg":
        parent.args = parent.args[:key] + (value,) + parent.args[key + 1:]
    elif kind == "kwarg":
        parent.kwargs[key] = value
    elif kind == "key":
        parent[key] = value
    else:
        try:
            setattr(parent, key, value)
        except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
            object.__setattr__(parent, key, value)
