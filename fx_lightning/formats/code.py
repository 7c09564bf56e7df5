"""``code``: a readable Python package (``fused_module/``) that rebuilds the fused model, plus its weights."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import torch
from torch import nn

from fx_lightning._version import __version__
from fx_lightning.errors import ExportError
from fx_lightning.formats.base import FUSED_CLASS_NAME, Format, FormatEntry, WriteContext, pickled_classes
from fx_lightning.formats.codegen import generate_code

__all__ = ["FORMAT"]

PACKAGE = "fused_module"


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    folder = root / PACKAGE
    folder.mkdir()
    source, weights, pickled = generate_code(ctx.model, folder, PACKAGE, __version__)
    torch.save(weights, folder / "weights.pt")
    (folder / "module.py").write_text(source, encoding="utf-8")
    (folder / "__init__.py").write_text(
        f'"""Fused model written by fx-lightning: ``from {PACKAGE} import {FUSED_CLASS_NAME}, load``."""\n'
        f"from .module import {FUSED_CLASS_NAME}, load\n\n__all__ = [\"{FUSED_CLASS_NAME}\", \"load\"]\n",
        encoding="utf-8",
    )
    return FormatEntry(
        PACKAGE, f"sys.path.insert(0, export_dir); from {PACKAGE} import load; model = load()",
        weights_only=not pickled, pickled_code=bool(pickled),
        options={"pickled_modules": pickled, "requires_classes": pickled_classes(ctx.model) if pickled else []},
    )


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    folder = root / entry.path
    init = folder / "__init__.py"
    # A unique module name: two exports loaded in one process must not share sys.modules entries.
    name = f"_fx_fused_{uuid.uuid4().hex[:12]}"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    if spec is None or spec.loader is None:
        raise ExportError(f"{init}: cannot import the generated package.")
    package = importlib.util.module_from_spec(spec)
    sys.modules[name] = package
    try:
        spec.loader.exec_module(package)
        return package.load(map_location=device)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


FORMAT = Format(
    from_program=False,
    name="code",
    path=PACKAGE,
    write=_write,
    load=_load,
    preference=30,
    readme=(
        "- `{path}/` (code): readable Python; `sys.path.insert(0, '.')`, then\n"
        "  `from {path} import load; model = load()`. Weights load with weights_only=True{pickled_note}."
    ),
    triton_refusal="Python source needs Triton's Python backend and a model.py written for it",
)
