"""The export formats: every module here declares one :class:`~fx_lightning.formats.base.Format` as
``FORMAT``. Adding a format is adding a module (and its tests); ``FORMATS`` is derived, in load_fused's
order of preference."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict

from fx_lightning.formats.base import Format

__all__ = ["FORMATS"]


def _discover() -> Dict[str, Format]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        record = getattr(importlib.import_module(f"{__name__}.{info.name}"), "FORMAT", None)
        if isinstance(record, Format):
            found.append(record)
    return {f.name: f for f in sorted(found, key=lambda f: (f.preference, f.name))}


FORMATS: Dict[str, Format] = _discover()

