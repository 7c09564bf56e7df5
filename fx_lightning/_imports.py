"""Ground floor: objects named by import path, and optional dependencies."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Iterable, List

__all__ = ["import_object", "missing_modules", "exception_text"]


def import_object(path: str) -> Any:
    """Import ``"pkg.module:attr"`` or ``"pkg.module.attr"`` (``attr`` may be dotted after the colon)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    # A leading dot would be a relative import, which importlib refuses with a TypeError.
    if not module_name or not attr or module_name.startswith("."):
        raise ValueError(f"{path!r} is not an import path ('pkg.module:name' or 'pkg.module.name')")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def missing_modules(names: Iterable[str]) -> List[str]:
    """The top-level modules among ``names`` that cannot be imported here (without importing them)."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent package that fails to import, or a bad name
            found = False
        if not found:
            missing.append(name)
    return missing


def exception_text(exc: BaseException) -> str:
    """An import failure as text: the message alone for the expected kinds, with the type otherwise."""
    expected = isinstance(exc, (ImportError, AttributeError, ValueError))
    return str(exc) if expected else f"{type(exc).__name__}: {exc}"
