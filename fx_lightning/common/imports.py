"""Ground floor: objects named by import path, and optional dependencies."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any, Iterable, List

__all__ = ["import_object", "import_checked", "missing_modules", "exception_text"]


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


def import_checked(path: str, key: str, callable_required: bool = False) -> Any:
    """The object at import path ``path``; a failure is a ``ValueError`` naming ``key`` (a config key, relative)."""
    try:
        obj = import_object(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"{key}: cannot import {path!r}: {exc}.") from None
    except Exception as exc:  # noqa: BLE001 - importing user code may raise anything; name the key
        raise ValueError(f"{key}: cannot import {path!r}: {exception_text(exc)}.") from exc
    if callable_required and not callable(obj):
        raise ValueError(f"{key}: {path!r} is not callable.")
    return obj
