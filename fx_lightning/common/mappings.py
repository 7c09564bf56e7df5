"""A mapping of its own class built again with other items (a call's ``BatchEncoding``, torchrl's ``TensorDict``:
the model reads it as such, and a dict in its place raised in torchrl's actor)."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional

__all__ = ["own_mapping"]


def own_mapping(origin: Optional[type], rebuilds: bool, template: Any, items: Dict[Any, Any]) -> Any:
    """A mapping of class ``origin`` with ``items``: built from them where that gives it back (``rebuilds``), else a
    copy of ``template`` (the original) with its items replaced, never sharing the original's store; None where
    neither works (the caller then makes a dict)."""
    try:
        if rebuilds and origin is not None:
            return origin(items)
        if template is None:
            return None
        # A deep copy sharing only the values (tensors): nothing of the caller's mapping is written to or kept.
        again = copy.deepcopy(template, memo={id(v): v for v in template.values()})
        for key in [k for k in again.keys() if k not in items]:
            del again[key]
        for key, value in items.items():
            again[key] = value
        return again if type(again) is origin and list(again.keys()) == list(items) else None
    except Exception:  # noqa: BLE001 - the class's own code refuses: a dict, as before
        return None
