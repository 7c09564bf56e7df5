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
        before = dict(template.items())
        again = copy.copy(template)
        for key, value in items.items():
            again[key] = value
        if any(template[k] is not v for k, v in before.items()):  # the copy shares its store: undone, refused
            for k, v in before.items():
                template[k] = v
            return None
        return again if type(again) is origin and list(again.keys()) == list(items) else None
    except Exception:  # noqa: BLE001 - the class's own code refuses: a dict, as before
        return None
