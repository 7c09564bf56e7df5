"""fx-lightning: fuse, verify and export PyTorch Lightning models with torch.fx.

Public API::

    from fx_lightning import FXFuseCallback, FuseConfig, fuse, fuse_and_export, load_fused, register_pass
"""

from __future__ import annotations

import importlib
from typing import Any

from fx_lightning._version import __version__
from fx_lightning.config import FuseConfig
from fx_lightning.pipeline.engine import FuseResult, fuse
from fx_lightning.errors import ConfigError, ExportError, FXLightningError, ParityError, PassError, TraceError
from fx_lightning.passes import register_pass
from fx_lightning.capture.fuse_report import FuseReport

__all__ = [
    "FXFuseCallback",
    "FuseConfig",
    "FuseResult",
    "FuseReport",
    "fuse",
    "fuse_and_export",
    "load_fused",
    "register_pass",
    "FXLightningError",
    "ConfigError",
    "TraceError",
    "PassError",
    "ParityError",
    "ExportError",
    "__version__",
]


# The callback pulls in Lightning and the exporter torch.export: import them only when asked for.
_LAZY = {"FXFuseCallback": "fx_lightning.callback", "load_fused": "fx_lightning.export.load.loader",
         "fuse_and_export": "fx_lightning.pipeline.driver"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fx_lightning' has no attribute {name!r}")
