"""Graph passes: the registry and runner (:mod:`.base`) and the built-in passes, one module per family.

Every module of this package is imported here, which registers the passes it declares: adding a built-in
pass is one :func:`builtin_pass` declaration in a family module, and a new family module needs nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from fx_lightning.passes import base
from fx_lightning.passes.base import *  # noqa: F401,F403 - the registry's names, listed once in its __all__

__all__ = list(base.__all__)

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
