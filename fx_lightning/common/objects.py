"""Objects rebuilt from a recorded one (a library's batch type, a dataclass): a fresh copy of the recorded template
and its fields set as the class sets them."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

__all__ = ["fresh_copy", "set_field"]


def fresh_copy(template: Any) -> Any:
    """A shallow copy of a recorded object without the private attributes holding a number or a tensor: the
    recorded example's state, not its fields (torch_geometric's ``Batch`` caches ``_num_graphs`` when it is made, and
    its ``num_graphs`` reads it first: kept, every object rebuilt from other tensors would count the example's
    graphs). The object then computes them from its fields, or fails, and the call is refused."""
    obj = copy.copy(template)
    for key, held in list(vars(obj).items()) if hasattr(obj, "__dict__") else []:
        if key.startswith("_") and not key.startswith("__") and isinstance(held, (bool, int, float, torch.Tensor)):
            try:
                delattr(obj, key)
            except AttributeError:  # a slot or a guarded attribute: left
                pass
    return obj


def set_field(obj: Any, key: str, value: Any) -> None:
    """``obj.key = value`` as the class does it (a batch type may keep its fields in a store of its own), else past
    a frozen dataclass's guard."""
    try:
        setattr(obj, key, value)
    except (AttributeError, TypeError, dataclasses.FrozenInstanceError):
        object.__setattr__(obj, key, value)
