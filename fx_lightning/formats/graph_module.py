"""``graph_module``: the fused ``torch.fx.GraphModule``, pickled with ``torch.save`` (code included)."""

from __future__ import annotations

from pathlib import Path
import torch
from torch import nn

from fx_lightning.errors import ExportError
from fx_lightning.formats.base import Format, FormatEntry, WriteContext, pickled_classes

__all__ = ["FORMAT"]


def _write(root: Path, ctx: WriteContext) -> FormatEntry:
    torch.save(ctx.model, root / FORMAT.path)
    return FormatEntry(
        FORMAT.path, "torch.load(path, weights_only=False)", weights_only=False, pickled_code=True,
        options={"warning": "pickled Python objects: torch.load(..., weights_only=False) runs code; load only "
                            "trusted files",
                 "requires_classes": pickled_classes(ctx.model)},
    )


def _load(root: Path, entry: FormatEntry, device: torch.device) -> nn.Module:
    # weights_only=False is required: a GraphModule pickle carries its generated code (see the manifest).
    module = torch.load(str(root / entry.path), map_location=device, weights_only=False)
    if not isinstance(module, nn.Module):
        raise ExportError(f"{root / entry.path}: holds a {type(module).__name__}, not a module.")
    return module.eval()


FORMAT = Format(
    from_program=False,
    name="graph_module",
    path="model.pt",
    write=_write,
    load=_load,
    preference=20,
    pickled_code=True,
    readme=(
        "- `{path}` (graph_module): `torch.load('{path}', weights_only=False).eval()`.\n"
        "  **This is pickled code** (weights_only=False runs it): load only files you trust."
    ),
)
