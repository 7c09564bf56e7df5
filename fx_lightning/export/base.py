"""The export format record and what every writer is handed.

An export format is declared once, as a :class:`Format` in its own module under
``fx_lightning/export/formats/``: its name, where it lives in the export directory, how it is written,
loaded and described. The config schema (``export.formats``), the writer, ``load_fused``, the manifest
and the export's README are all derived from these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch import nn

__all__ = ["FUSED_CLASS_NAME", "Format", "WriteContext", "Writer", "Loader", "pickled_classes"]

# The class name of the plain fused GraphModule and of the generated code's module.
FUSED_CLASS_NAME = "FusedModule"


@dataclass
class WriteContext:
    """What every writer gets: the fused model made plain, its example inputs and the export options."""

    model: fx.GraphModule  # plain GraphModule: default codegen, no export hooks, picklable
    args: Tuple[Any, ...]  # the example inputs, batch >= 2 along dim 0 (export specialises 0 and 1)
    dynamic_shapes: Optional[Tuple[Any, ...]]  # torch.export's dynamic_shapes for args (None: static)
    input_names: List[str]
    onnx_opset: Optional[int] = None
    # AOTInductor: one package per batch size listed (compiled for it), or one with a dynamic batch when empty.
    aoti_batch_sizes: List[int] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        """Where the model and its example inputs are: the device the artifacts are built for."""
        return next((a.device for a in self.args if isinstance(a, torch.Tensor)), torch.device("cpu"))


# write(staging_dir, ctx) -> the format's manifest entry (at least "path" and "loader")
Writer = Callable[[Path, WriteContext], Dict[str, Any]]
# load(export_dir, manifest_entry, device) -> an eval-mode module on that device
Loader = Callable[[Path, Dict[str, Any], Any], nn.Module]


@dataclass(frozen=True)
class Format:
    """One export format, declared once."""

    name: str
    path: str  # file or folder inside the export directory
    write: Writer
    load: Loader
    # How to load it without fx-lightning, for the export's README (a line or two of Markdown).
    readme: str
    # load_fused's default order when no format is named: lower first.
    preference: int
    # Modules needed to write it; checked before any work starts (pip extra named in install_hint).
    requires: Tuple[str, ...] = ()
    # What else writing it needs (a C++ compiler, say): None when available here, else what is missing.
    unavailable: Optional[Callable[[], Optional[str]]] = None
    # Modules needed to load and run it; without them the round-trip check is skipped and said so.
    runtime_requires: Tuple[str, ...] = ()
    install_hint: str = ""
    # Loading it unpickles Python objects (torch.load(weights_only=False)): only for trusted files.
    pickled_code: bool = False

    def readme_text(self, entry: Dict[str, Any]) -> str:
        """The README lines for this format; ``{pickled_note}`` expands when the entry pickled modules."""
        note = "; modules listed under `pickled_modules` in the manifest are pickled" if entry.get("pickled_modules") else ""
        return self.readme.format(path=self.path, pickled_note=note)


def pickled_classes(model: nn.Module) -> List[str]:
    """Classes a pickle of ``model`` needs that are not torch's: the training code must be importable for them."""
    names = set()
    for m in model.modules():
        cls = type(m)
        if isinstance(m, fx.GraphModule) or cls.__module__.startswith("torch."):
            continue
        names.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(names)
