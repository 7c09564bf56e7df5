"""Lightning under either name: ``lightning.pytorch`` and the standalone ``pytorch_lightning`` package are the same
code with other classes, and libraries and older projects build their Trainer from either. Every isinstance check
the callback makes on a Lightning object accepts the class of both.

``pytorch_lightning`` is never imported here: a Trainer built from it has imported it already.
"""

from __future__ import annotations

import importlib
import sys
from typing import Tuple

__all__ = ["NAMESPACES", "lightning_classes"]

NAMESPACES = ("lightning.pytorch", "pytorch_lightning")


def lightning_classes(path: str) -> Tuple[type, ...]:
    """The class at ``path`` (under the namespace, e.g. ``"callbacks.ModelCheckpoint"``) in every Lightning
    namespace that is loaded (an empty tuple matches nothing)."""
    module_path, _, name = path.rpartition(".")
    found = []
    for root in NAMESPACES:
        if root != NAMESPACES[0] and root not in sys.modules:
            continue
        try:
            cls = getattr(importlib.import_module(f"{root}.{module_path}" if module_path else root), name, None)
        except ImportError:
            continue
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)
