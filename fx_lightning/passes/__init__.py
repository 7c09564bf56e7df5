"""Graph passes: the registry and runner (:mod:`.base`) and the built-in passes, one module per family.

Every module of this package is imported here, which registers the passes it declares: adding a built-in
pass is one :func:`builtin_pass` declaration in a family module, and a new family module needs nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil

from fx_lightning.passes.base import (
    DEFAULT_ORDER,
    USER_PASSES,
    Change,
    PassContext,
    PassOptions,
    PassResult,
    PassSpec,
    RemainingBatchNorm,
    Skip,
    Stage,
    builtin_pass,
    builtin_passes,
    get_pass,
    plan_passes,
    register_pass,
    registered_passes,
    resolve_pass,
    run_pass,
    run_passes,
)

__all__ = [
    "PassContext",
    "PassOptions",
    "PassResult",
    "Change",
    "Skip",
    "RemainingBatchNorm",
    "PassSpec",
    "Stage",
    "USER_PASSES",
    "DEFAULT_ORDER",
    "builtin_pass",
    "builtin_passes",
    "get_pass",
    "plan_passes",
    "register_pass",
    "registered_passes",
    "resolve_pass",
    "run_pass",
    "run_passes",
]

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")
